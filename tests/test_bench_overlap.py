"""`gossipd bench overlap --quick --sim-only`, and the relations its table must show.

Only the simulator part: its clock is virtual and every draw is seeded, so the
relations hold on any machine and under any load. The real part is timed on a
shared machine and is run by hand (bench/README.md), never asserted here.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from gossipd.bench import overlap as bench
from gossipd.bench.overlap_sim import MODES

CHANCE = 0.1  # ten digit classes


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    png = tmp_path_factory.mktemp("bench") / "overlap.png"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # module-scoped fixtures cannot use capsys
        assert bench.main(["--quick", "--sim-only", "--json", "--plot", str(png)]) == 0
    result = json.loads(out.getvalue().strip().splitlines()[-1])
    assert Path(result["plot"]) == png and png.stat().st_size > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "real" not in result  # --sim-only
    return result


def _cells(table: dict[str, Any]) -> dict[tuple[int, str], dict[str, Any]]:
    return {(r["fast_nodes"], r["mode"]): r for r in table["sim"]["rows"]}


def test_every_fast_count_runs_every_mode(table: dict) -> None:
    fasts = table["sim"]["settings"]["fast_counts"]
    assert fasts == [0, 6]
    assert set(_cells(table)) == {(f, label) for f in fasts for label, _, _ in MODES}


def test_scheduled_overlap_waits_under_3_percent_where_pulling_after_the_period_waits(
    table: dict,
) -> None:
    """On a 1.6 s period a slow pull takes 0.46 s: `none` waits it every period the node
    pulls over a slow link; scheduled overlap starts it that much before the period ends."""
    cells = _cells(table)
    for fast in (0, 6):
        none = cells[(fast, "none")]
        assert none["wait_mean"] > 0.10, none["wait_mean"]
        for label in ("scheduled+coordinator", "scheduled, decentralized"):
            scheduled = cells[(fast, label)]
            assert scheduled["wait_mean"] < bench.GOAL_WAIT, (fast, label, scheduled["wait_mean"])
            assert scheduled["wait_mean"] < none["wait_mean"] / 3
            # Not waiting buys steps: more of them in the same virtual budget.
            assert scheduled["steps_per_node"] > none["steps_per_node"]
        assert cells[(fast, "naive")]["wait_mean"] < bench.GOAL_WAIT  # a whole period to land
    # With 6 fast nodes, pulls between two of them are short: `none` waits less than with 0.
    assert cells[(6, "none")]["wait_mean"] < cells[(0, "none")]["wait_mean"]


def test_every_mode_learns_and_draws_the_models_together(table: dict) -> None:
    for (fast, label), row in _cells(table).items():
        assert row["accuracy_end"] > 3 * CHANCE, (fast, label, row["accuracy_end"])
        assert row["accuracy_end"] > row["accuracy"][0], (fast, label)
        assert row["consensus_error_end"] < 0.25 * row["consensus_error_start"], (fast, label)
        assert row["refused"] == 0
        assert (
            len(row["accuracy"]) == len(row["times_s"]) == table["sim"]["settings"]["periods"] + 1
        )


def test_the_paced_job_trains_digits_and_refuses_a_bad_compute_time() -> None:
    """The real part's plugin job, as a daemon builds it: a real digits step (the
    model moves), and a ``compute_s`` that is no number of seconds refused by name."""
    import torch

    from gossipd.bench.overlap_mesh import JOB
    from gossipd.node.errors import JobError
    from gossipd.node.jobs.registry import JobSpec, build_job

    job = build_job(JobSpec(JOB, seed=3, options={"compute_s": 0.0, "model": "mlp"}))
    before = [p.detach().clone() for p in job.model.parameters()]
    assert torch.isfinite(torch.tensor(job.train_step()))
    assert any(not torch.equal(a, b) for a, b in zip(before, job.model.parameters(), strict=True))
    assert 0.0 <= job.evaluate()["test_accuracy"] <= 1.0
    for bad in (-1.0, 11, "fast", True):
        with pytest.raises(JobError, match="compute_s"):
            build_job(JobSpec(JOB, options={"compute_s": bad}))
