"""The ``mnist1d`` job: the package's own generator, nothing downloaded, shards by label."""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gossipd.node.cli.main import main
from gossipd.node.errors import JobError
from gossipd.node.jobs.mnist1d import cache_path, mnist1d_data, read_cached
from gossipd.node.jobs.registry import JobSpec, build_job
from gossipd.node.launch.launcher import check_spec
from gossipd.node.launch.meshspec import MeshSpec
from gossipd.node.launch.processes import free_ports
from tests.daemons import write_node_config


def test_the_data_is_make_datasets_default_split_and_no_global_rng_moves() -> None:
    from mnist1d.data import get_dataset_args, make_dataset

    random.seed(7)
    np.random.seed(7)
    expected_draws = (random.random(), np.random.rand())
    random.seed(7)
    np.random.seed(7)
    x, y, test_x, test_y = mnist1d_data()
    assert (random.random(), np.random.rand()) == expected_draws

    reference = make_dataset(get_dataset_args())  # moves the global RNGs: a test may
    assert x.shape == (4000, 40) and test_x.shape == (1000, 40)
    assert np.array_equal(x, reference["x"].astype(np.float32))
    assert np.array_equal(y, reference["y"])
    assert np.array_equal(test_x, reference["x_test"].astype(np.float32))
    assert np.array_equal(test_y, reference["y_test"])


def test_the_generated_set_is_kept_on_disk_and_a_damaged_copy_is_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A site start generated the set again each time (5.5 s of CPU); it is kept under
    $XDG_CACHE_HOME/gossipd after the first time, read back the same, and a file that is
    not the set is ignored (and replaced by the next generation)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = cache_path()
    assert path is not None and path.parent == tmp_path / "gossipd"
    mnist1d_data.cache_clear()
    try:
        generated = mnist1d_data()
        assert path.exists() and list(path.parent.iterdir()) == [path]  # no partial file
        mnist1d_data.cache_clear()
        read = mnist1d_data()
    finally:
        mnist1d_data.cache_clear()
    for a, b in zip(generated, read, strict=True):
        assert np.array_equal(a, b) and a.dtype == b.dtype
    path.write_bytes(b"not an npz file")
    assert read_cached(path) is None
    np.savez(path, x=np.zeros((3, 40)), y=np.zeros(3), x_test=np.zeros(1), y_test=np.zeros(1))
    assert read_cached(path) is None


def test_by_label_shards_hold_few_classes_and_together_cover_the_training_set() -> None:
    jobs = [build_job(JobSpec("mnist1d", shard_index=i, num_shards=4)) for i in range(4)]
    ids = np.concatenate([job.sample_ids for job in jobs])
    assert sorted(ids.tolist()) == list(range(4000))
    for job in jobs:
        assert len(torch.unique(job.train_y)) <= 4  # ten classes over four sites
        assert torch.equal(job.test_y, jobs[0].test_y)  # all ten classes, the same everywhere
    assert len(torch.unique(jobs[0].test_y)) == 10


@pytest.mark.parametrize(("model", "parameters"), [("cnn", 5210), ("mlp", 15210)])
def test_models_are_the_papers_sizes_and_depend_on_the_seed_alone(
    model: str, parameters: int
) -> None:
    a, b, c = (build_job(JobSpec("mnist1d", seed=s, options={"model": model})) for s in (3, 3, 4))
    assert sum(p.numel() for p in a.model.parameters()) == parameters
    triples = zip(a.model.parameters(), b.model.parameters(), c.model.parameters(), strict=True)
    for pa, pb, pc in triples:
        assert torch.equal(pa, pb)
        assert not torch.equal(pa, pc)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"model": "resnet"}, "option 'model' must be 'cnn' or 'mlp', got 'resnet'"),
        ({"partition": "by_site"}, "option 'partition' must be 'iid' or 'by_label'"),
        ({"classes": 3}, "job 'mnist1d' has no option(s) classes"),
    ],
)
def test_a_bad_option_is_a_clear_error(options: dict[str, object], message: str) -> None:
    with pytest.raises(JobError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_job(JobSpec("mnist1d", options=options))


def test_training_lowers_the_loss_and_reports_accuracy_over_all_classes() -> None:
    job = build_job(JobSpec("mnist1d", seed=1, options={"partition": "iid"}))
    before = job.evaluate()
    for _ in range(300):
        job.train_step()
    after = job.evaluate()
    assert after["test_loss"] < before["test_loss"]
    assert 0.0 <= after["test_accuracy"] <= 1.0


MISSING = (
    "job 'mnist1d' takes its data from the mnist1d package, which is not installed here: "
    "pip install mnist1d==0.0.2.post1"
)


def test_a_missing_package_is_one_line_from_the_node_and_mesh_up_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "mnist1d", None)  # as if it were not installed
    config = write_node_config(
        tmp_path, "a", free_ports(1)[0], tmp_path / "a", job={"name": "mnist1d"}
    )
    assert main(["node", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gossipd: error: {MISSING}") and err.count("\n") == 1, err
    assert not (tmp_path / "a" / "node.json").exists()  # nothing started

    with pytest.raises(JobError, match=re.escape(MISSING)):
        check_spec(MeshSpec(nodes=2, job="mnist1d"))
    with pytest.raises(JobError, match=re.escape(MISSING)):
        build_job(JobSpec("mnist1d"))
