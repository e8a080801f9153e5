"""Short real meshes of the built-in tasks where averaging matters, sized for CI.

mnist1d: a label-skewed site alone cannot score much above the share of the test set its
own classes make up: it never saw the others. Of 3 sites, each alone scored at best
0.385-0.398 over 2,000 steps (evaluated every 100; measured 2026-11-27); of 4, 0.28-0.31
(docs/jobs.md). A site's local model swings from evaluation to evaluation (0.3 to 0.78
within 500 steps, measured: it drifts to its own classes between merges), so the bar is
on each site's best evaluation, which only a site that learnt classes it never saw can
pass.

shakespeare: with every play's text, lone sites trail the pooled model by only 0.09 nats a
character after 3,000 steps (docs/jobs.md), minutes of CPU for four sites. Where averaging
pays within CI's budget is where a site's data is scarce: with 10,000 characters each
(``train_chars``) a lone site overfits, so its best evaluation is a floor however long it
trains: 2.370-2.431 nats a character over 12 runs of 3,000 steps (4 sites x seeds 0-2, best
at steps 800-1,200, measured 2026-11-29). Four such sites in a mesh reach below 2.30.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from gossipd.node.launch.forked import fork_node
from gossipd.node.launch.launcher import run_mesh
from gossipd.node.launch.meshspec import MeshSpec

MNIST1D_SITES = 3
MNIST1D_LONE_BEST = 0.40  # the best evaluation of 3 label-skewed sites alone, rounded up
MNIST1D_BAR = 0.50
STEPS = 1700  # measured: each of 3 sites first at 0.50 after 800-1,400 steps
# Paced, so a fast machine pushes as often per step as the one the bar was measured on:
# unpaced, 3 sites at 210 steps a second each had best evaluations of 0.49-0.73 and failed
# the bar in a loaded CI run; paced at 120, 0.74-0.91 in three runs.
STEPS_PER_S = 120.0
SHAKESPEARE_SITES = 4
SHAKESPEARE_LONE_BEST = 2.37  # the best evaluation of a lone site of 10,000 characters
SHAKESPEARE_BAR = 2.30
SHAKESPEARE_STEPS = 2000
SHAKESPEARE_STEPS_PER_S = 60.0  # paced as the mnist1d test is, for the same reason


@pytest.mark.timeout(400)
def test_label_skewed_mnist1d_sites_together_pass_every_lone_sites_accuracy(
    tmp_path: Path,
) -> None:
    """Sum-weight gossip with a push after every step (the CPU budget off: what is
    tested is that averaging teaches each site the classes it never sees)."""
    spec = MeshSpec(
        nodes=MNIST1D_SITES,
        job="mnist1d",
        protocol="sumweight",
        push_probability=1.0,
        cpu_share=1.0,
        duration_s=0.0,
        max_steps=STEPS,
        max_steps_per_s=STEPS_PER_S,
        eval_every_steps=100,
        insecure=True,
        workdir=tmp_path,
        quiet=True,
    )
    result = run_mesh(spec, io.StringIO(), fork_node)
    assert result["exit_codes"] == [0] * MNIST1D_SITES, result
    assert result["sum_weight_start"] == MNIST1D_SITES
    assert abs(result["sum_weight_end"] - MNIST1D_SITES) < 1e-9, result
    for i, node in enumerate(result["nodes"]):
        assert node["steps"] == STEPS, node
        history = (tmp_path / f"node-{i}" / "history.jsonl").read_text().splitlines()
        best = max(json.loads(line)["test_accuracy"] for line in history)
        assert best >= MNIST1D_BAR > MNIST1D_LONE_BEST, (i, best)


@pytest.mark.timeout(400)
def test_shakespeare_sites_scarce_in_data_together_pass_every_lone_sites_loss(
    tmp_path: Path,
) -> None:
    """A 1-layer, width-32 model, 10,000 characters a site: a site alone overfits near 2.37;
    averaging gives each site the others' text. Measured, each site's best after 2,000 paced
    steps: 2.157-2.163 on a quiet box, 2.204-2.215 beside two busy loops (about 40 s)."""
    spec = MeshSpec(
        nodes=SHAKESPEARE_SITES,
        job="shakespeare",
        job_options={"layers": 1, "width": 32, "context": 32, "train_chars": 10_000},
        protocol="sumweight",
        push_probability=1.0,
        cpu_share=1.0,
        duration_s=0.0,
        max_steps=SHAKESPEARE_STEPS,
        max_steps_per_s=SHAKESPEARE_STEPS_PER_S,
        eval_every_steps=100,
        insecure=True,
        workdir=tmp_path,
        quiet=True,
    )
    result = run_mesh(spec, io.StringIO(), fork_node)
    assert result["exit_codes"] == [0] * SHAKESPEARE_SITES, result
    assert abs(result["sum_weight_end"] - SHAKESPEARE_SITES) < 1e-9, result
    for i, node in enumerate(result["nodes"]):
        assert node["steps"] == SHAKESPEARE_STEPS, node
        history = (tmp_path / f"node-{i}" / "history.jsonl").read_text().splitlines()
        best = min(json.loads(line)["test_loss"] for line in history)
        assert best <= SHAKESPEARE_BAR < SHAKESPEARE_LONE_BEST, (i, best)
