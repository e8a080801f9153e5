"""Three real daemons on loopback train digits together through `gossipd mesh up`.

Counted in steps, not seconds (1,000 each): a loaded machine trains as far, only
slower; at 15 s per protocol the six runs took 4.6 minutes of the suite. They run the
launcher `gossipd mesh up` runs, in this process, with daemons forked from the test fork
server (node/launch/forked.py), which spares each daemon about 4 s of CPU on imports; the
executable itself runs in tests/test_launcher.py and tests/test_demo.py.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from gossipd.node.launch.forked import fork_node
from gossipd.node.launch.launcher import run_mesh
from gossipd.node.launch.meshspec import MeshSpec
from gossipd.node.protocols import PROTOCOLS, keeps_weights

NODES = 3
STEPS = 1000


def forked_mesh(tmp_path: Path, protocol: str, plot: Path) -> tuple[dict[str, Any], str]:
    """The run's result, and what `mesh up` printed while it ran."""
    # 1,000 digits steps are under a second of training: a share of so short a run buys
    # too few pushes for consensus to fall 10x (the README's "CPU budget for gossip" says
    # so; at 0.1 a loaded CI run of sumweight fell 9.5x). The protocols are what this
    # tests; the budget has its own tests. Paced for the same reason: unpaced, 1,000 steps
    # took 0.3 s on a fast 2-core VM and pushsum-expgraph's consensus fell 7.5x.
    spec = MeshSpec(
        nodes=NODES,
        job="digits",
        protocol=protocol,
        duration_s=0.0,
        max_steps=STEPS,
        max_steps_per_s=400.0,
        cpu_share=1.0,
        workdir=tmp_path / "mesh",
        plot_path=plot,
        quiet=True,
    )
    progress = io.StringIO()
    return run_mesh(spec, progress, fork_node), progress.getvalue()


@pytest.mark.timeout(480)
@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_three_process_digits_mesh_reaches_90_percent_and_consensus_falls_10x(
    tmp_path: Path, protocol: str
) -> None:
    plot = tmp_path / "mesh.png"
    result, printed = forked_mesh(tmp_path, protocol, plot)
    check(result, tmp_path, protocol, plot)
    check_words(result, printed, tmp_path, protocol)


def check(result: dict[str, Any], tmp_path: Path, protocol: str, plot: Path) -> None:
    assert len(result["nodes"]) == NODES
    assert result["protocol"] == protocol
    for node in result["nodes"]:
        assert node["test_accuracy"] >= 0.90, node
        assert node["steps"] > 0
        assert node["round"] > 0, node
    assert result["consensus_distance_end"] * 10 <= result["consensus_distance_start"], result
    if keeps_weights(protocol):
        # Nothing was lost or created: every push was acknowledged before it was committed.
        assert abs(result["sum_weight_end"] - result["sum_weight_start"]) < 1e-9, result
        assert result["sum_weight_start"] == float(NODES)
    else:  # a pull protocol: no weights; it reports how long its trainer waited for pulls
        assert all(0.0 <= n["wait_fraction"] < 1.0 for n in result["nodes"]), result
        assert all(n["scheduling"] == "decentralized" for n in result["nodes"]), result
    assert result["exit_codes"] == [0] * NODES
    assert plot.stat().st_size > 10_000
    # Each daemon left a final checkpoint and a history of evaluations.
    for i in range(NODES):
        node_dir = tmp_path / "mesh" / f"node-{i}"
        assert (node_dir / "checkpoint.pt").exists()
        assert (node_dir / "history.jsonl").read_text().strip()


def check_words(result: dict[str, Any], printed: str, tmp_path: Path, protocol: str) -> None:
    """What `mesh up` and each daemon's progress line say is the protocol's own doing: a
    pulling one's pulls and waits, never pushes it does not make."""
    lines = printed.splitlines()
    header = next(line.split() for line in lines if line.split()[:1] == ["time_s"])
    progress = [
        line
        for i in range(NODES)
        for line in (tmp_path / "mesh" / f"node-{i}" / "node.log").read_text().splitlines()
        if " progress: step " in line
    ]
    assert progress, "no daemon logged a progress line"
    if keeps_weights(protocol):
        assert header[-2:] == ["mean_loss", "consensus"], header
        assert all("pushes acknowledged" in line for line in progress), progress
        return
    assert f"gossipd: {protocol}: each node averages with models it pulls; each schedules " \
        "its pulls itself (decentralized" in printed  # fmt: skip
    assert header[-2:] == ["pulls", "waiting"], header
    assert all("pulls merged" in line and "push" not in line for line in progress), progress
    assert all(n["pulls"]["merged"] > 0 for n in result["nodes"]), result["nodes"]
