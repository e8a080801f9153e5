"""Tests for gossipd.node.jobs.registry: shards, seeds, frozen (lr=0) steps, plugins, and errors."""

from __future__ import annotations

import re
import textwrap

import numpy as np
import pytest
import torch

from gossipd.node.errors import JobError
from gossipd.node.jobs.registry import BUILTIN_JOBS, JobSpec, build_job, stratified_split


def _bits(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every floating tensor of the model as raw integers, so -0.0 vs 0.0 or NaN would show."""
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().clone()
        out[name] = t.view(torch.int32) if t.dtype == torch.float32 else t
    return out


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------
# digits


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_digits_single_node_reaches_90pct_on_a_quarter_shard_within_600_steps(model: str) -> None:
    job = build_job(
        JobSpec("digits", seed=0, shard_index=2, num_shards=4, options={"model": model})
    )
    reached = None
    for step in range(1, 601):
        job.train_step()
        if step % 20 == 0 and job.evaluate()["test_accuracy"] >= 0.90:
            reached = step
            break
    assert reached is not None, f"{model} stayed below 0.90: {job.evaluate()}"


@pytest.mark.parametrize("partition", ["iid", "by_label"])
@pytest.mark.parametrize("num_shards", [1, 4, 7])
def test_digits_shards_are_disjoint_and_cover_the_train_split(
    num_shards: int, partition: str
) -> None:
    jobs = [
        build_job(
            JobSpec(
                "digits", shard_index=i, num_shards=num_shards, options={"partition": partition}
            )
        )
        for i in range(num_shards)
    ]
    ids = [j.sample_ids for j in jobs]
    union = np.concatenate(ids)
    assert len(union) == len(set(union.tolist())), "a sample is in two shards"
    assert len(union) == 1797 - len(jobs[0].test_ids)
    assert set(union.tolist()).isdisjoint(jobs[0].test_ids.tolist())
    assert set(union.tolist()) | set(jobs[0].test_ids.tolist()) == set(range(1797))
    sizes = [len(i) for i in ids]
    assert max(sizes) - min(sizes) <= 1


def test_digits_by_label_shards_see_few_classes() -> None:
    job = build_job(JobSpec("digits", num_shards=5, options={"partition": "by_label"}))
    assert len(torch.unique(job.train_y)) <= 3


def test_digits_test_split_is_identical_across_shards_and_seeds_and_stratified() -> None:
    ref = build_job(JobSpec("digits"))
    for spec in [JobSpec("digits", seed=5, shard_index=3, num_shards=4), JobSpec("digits", seed=9)]:
        job = build_job(spec)
        assert np.array_equal(job.test_ids, ref.test_ids)
        assert torch.equal(job.test_x, ref.test_x) and torch.equal(job.test_y, ref.test_y)
    assert len(ref.test_ids) == 360
    counts = torch.bincount(ref.test_y, minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37  # 20% of each class (174..183 per class)
    assert float(ref.train_x.min()) >= 0.0 and float(ref.train_x.max()) <= 1.0


@pytest.mark.parametrize("seed", [0, 1, 7, 42, 1234])
def test_digits_data_and_split_are_scikit_learns_without_importing_it(seed: int) -> None:
    """The job reads the bundled CSV and splits it itself; both must be what
    ``load_digits`` and a stratified ``train_test_split`` give, draw for draw."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    ids = np.arange(len(digits.target))
    train, test = train_test_split(ids, test_size=0.2, random_state=seed, stratify=digits.target)
    ours = stratified_split(digits.target, test_fraction=0.2, seed=seed)
    assert np.array_equal(ours[0], train) and np.array_equal(ours[1], test)
    job = build_job(JobSpec("digits"))
    expected = torch.from_numpy((digits.data / 16.0).astype(np.float32))
    assert torch.equal(job.test_x, expected[job.test_ids.copy()].reshape(job.test_x.shape))
    assert torch.equal(job.test_y, torch.from_numpy(digits.target[job.test_ids]).long())


def test_digits_evaluate_reports_accuracy_and_loss() -> None:
    metrics = build_job(JobSpec("digits")).evaluate()
    assert set(metrics) == {"test_accuracy", "test_loss"}
    assert all(isinstance(v, float) for v in metrics.values())


# ---------------------------------------------------------------------------
# seeds


SEEDED_SPECS = [
    ("digits", {}),
    ("digits", {"model": "cnn"}),
    ("synthetic", {}),
    ("synthetic", {"numel": 10_000}),
]


@pytest.mark.parametrize(("name", "options"), SEEDED_SPECS)
def test_same_seed_gives_identical_init_and_different_seeds_differ(
    name: str, options: dict[str, object]
) -> None:
    a = _bits(build_job(JobSpec(name, seed=1, options=options)).model)
    b = _bits(build_job(JobSpec(name, seed=1, shard_index=1, num_shards=2, options=options)).model)
    c = _bits(build_job(JobSpec(name, seed=2, options=options)).model)
    assert _same_bits(a, b)
    drawn = [k for k in a if a[k].dim() >= 2 or k == "bulk"]  # Linear/Conv weights, bulk pad
    assert drawn and all(not torch.equal(a[k], c[k]) for k in drawn)


def test_building_a_job_neither_reads_nor_moves_the_global_rng() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_job(JobSpec("digits", options={"model": "cnn"}))
    build_job(JobSpec("synthetic", options={"numel": 1000}))
    assert torch.equal(torch.rand(3), expected)


def test_same_seed_replays_the_same_losses_and_another_seed_does_not() -> None:
    def losses(seed: int) -> list[float]:
        job = build_job(JobSpec("digits", seed=seed, num_shards=4))
        return [job.train_step() for _ in range(30)]

    assert losses(3) == losses(3)
    assert losses(3) != losses(4)


# ---------------------------------------------------------------------------
# synthetic and frozen (lr = 0) training


@pytest.mark.parametrize(
    ("name", "options"),
    [("synthetic", {}), ("synthetic", {"numel": 5000}), ("digits", {"model": "cnn"})],
)
def test_lr_zero_leaves_parameters_and_buffers_bit_identical(
    name: str, options: dict[str, object]
) -> None:
    job = build_job(JobSpec(name, seed=7, learning_rate=0.0, options=options))
    before = _bits(job.model)
    losses = [job.train_step() for _ in range(60)]
    assert _same_bits(before, _bits(job.model))
    assert all(np.isfinite(losses))


def test_setting_lr_to_zero_on_a_live_optimizer_freezes_the_model() -> None:
    job = build_job(JobSpec("synthetic", learning_rate=0.1))
    job.train_step()
    for group in job.optimizer.param_groups:
        group["lr"] = 0.0
    before = _bits(job.model)
    for _ in range(50):
        job.train_step()
    assert _same_bits(before, _bits(job.model))


def test_synthetic_positive_lr_lowers_test_loss_towards_the_noise_floor() -> None:
    job = build_job(JobSpec("synthetic", seed=3, num_shards=2, shard_index=1))
    start = job.evaluate()["test_loss"]
    for _ in range(400):
        job.train_step()
    end = job.evaluate()
    assert set(end) == {"test_loss"}
    assert end["test_loss"] < start / 10
    assert end["test_loss"] < 3 * 0.1**2  # noise std 0.1


def test_synthetic_numel_pads_the_model_and_bulk_takes_no_gradient_memory() -> None:
    job = build_job(JobSpec("synthetic", options={"numel": 1_000_000, "dim": 8}))
    assert sum(p.numel() for p in job.model.parameters()) == 1_000_000
    bulk_before = job.model.bulk.detach().clone()
    for _ in range(5):
        job.train_step()
    assert job.model.bulk.grad is None
    assert job.optimizer.state.get(job.model.bulk, {}) == {}
    assert torch.equal(job.model.bulk, bulk_before)
    assert job.model.head.weight.grad is not None


# ---------------------------------------------------------------------------
# errors


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        (JobSpec("mnist"), "digits, mnist1d, shakespeare, synthetic"),
        (JobSpec("digits", shard_index=4, num_shards=4), "shard_index 4"),
        (JobSpec("digits", num_shards=0), "num_shards must be >= 1"),
        (JobSpec("digits", num_shards=5000), "num_shards=5000 exceeds"),
        (JobSpec("digits", learning_rate=-0.1), "learning_rate"),
        (JobSpec("digits", learning_rate=float("nan")), "learning_rate"),
        (JobSpec("digits", batch_size=0), "batch_size"),
        (JobSpec("digits", options={"modle": "cnn"}), "modle"),
        (JobSpec("digits", options={"model": "resnet"}), "'resnet'"),
        (JobSpec("digits", options={"partition": "dirichlet"}), "'dirichlet'"),
        (JobSpec("synthetic", options={"dim": 0}), "'dim'"),
        (JobSpec("synthetic", options={"numel": 10}), "numel"),
        (JobSpec("synthetic", options={"noise": -1}), "'noise'"),
    ],
)
def test_bad_specs_raise_job_error_naming_the_value(spec: JobSpec, fragment: str) -> None:
    with pytest.raises(JobError, match=re.escape(fragment)):
        build_job(spec)


def test_unknown_job_message_names_the_plugin_syntax() -> None:
    with pytest.raises(JobError, match=r"package\.module:factory"):
        build_job(JobSpec("cifar"))


@pytest.mark.parametrize("name", BUILTIN_JOBS)
def test_every_builtin_job_builds_and_steps(name: str) -> None:
    job = build_job(JobSpec(name))
    assert np.isfinite(job.train_step())
    assert "test_loss" in job.evaluate()


# ---------------------------------------------------------------------------
# plugins

PLUGIN_SOURCE = textwrap.dedent(
    """
    import torch
    from gossipd.node.jobs.registry import SyntheticJob

    seen = []

    def good(spec):
        seen.append(spec)
        return SyntheticJob(spec.__class__("synthetic", seed=spec.seed))

    class _NoOptimizer:
        model = torch.nn.Linear(2, 1)
        def train_step(self):
            return 0.0
        def evaluate(self):
            return {}

    def no_optimizer(spec):
        return _NoOptimizer()

    def wrong_types(spec):
        job = _NoOptimizer()
        job.optimizer = "sgd"
        job.evaluate = 3
        return job

    def explodes(spec):
        raise ValueError("boom at lr=" + str(spec.learning_rate))

    not_callable = 42
    """
)


@pytest.fixture
def plugin_path(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "gossipd_test_plugin.py").write_text(PLUGIN_SOURCE)
    (tmp_path / "gossipd_broken_plugin.py").write_text("raise RuntimeError('broken on import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_plugin_factory_receives_the_spec_and_its_job_trains(plugin_path: None) -> None:
    import gossipd_test_plugin

    spec = JobSpec("gossipd_test_plugin:good", seed=4, options={"anything": 1})
    job = build_job(spec)
    assert gossipd_test_plugin.seen[-1] is spec
    assert np.isfinite(job.train_step())


@pytest.mark.parametrize(
    ("name", "fragments"),
    [
        ("gossipd_no_such_module:f", ["gossipd_no_such_module", "ModuleNotFoundError"]),
        ("gossipd_broken_plugin:f", ["RuntimeError", "broken on import"]),
        ("gossipd_test_plugin:missing", ["'missing' is missing"]),
        ("gossipd_test_plugin:not_callable", ["'not_callable'", "not callable"]),
        ("gossipd_test_plugin:no_optimizer", ["missing 'optimizer'"]),
        ("gossipd_test_plugin:wrong_types", ["'optimizer' is a str", "'evaluate' is not callable"]),
        ("gossipd_test_plugin:explodes", ["ValueError", "boom at lr=None"]),
        (":factory", ["package.module:factory"]),
        ("a:b:c", ["package.module:factory"]),
    ],
)
def test_bad_plugins_raise_job_error_saying_what_is_wrong(
    plugin_path: None, name: str, fragments: list[str]
) -> None:
    with pytest.raises(JobError) as info:
        build_job(JobSpec(name))
    for fragment in fragments:
        assert fragment in str(info.value)


def test_the_documented_import_path_of_the_jobs_still_gives_every_name() -> None:
    # docs/library.md: plugins import JobSpec from gossipd.node.trainer.jobs, where the jobs
    # lived before they had a room of their own (gossipd.node.jobs).
    from gossipd.node.jobs import registry
    from gossipd.node.trainer import jobs as documented

    assert documented.JobSpec is registry.JobSpec
    assert documented.__all__ == registry.__all__
    assert all(getattr(documented, name) is getattr(registry, name) for name in registry.__all__)
