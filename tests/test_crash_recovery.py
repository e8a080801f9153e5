"""Kill -9 one daemon mid-run: the rest keep training; restarted, it resumes and catches up.

The fault is injected at a named point (the victim's first checkpoint at step
CHECKPOINT_EVERY or later), not after a sleep.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from gossipd.node.launch.forked import fork_node
from gossipd.node.launch.localmesh import LocalMesh, MeshSpec, consensus_distance
from tests.conftest import wait_until

CHECKPOINT_EVERY = 100
TIMEOUT_S = 180.0


def test_killed_node_others_continue_and_restart_resumes_from_checkpoint(tmp_path: Path) -> None:
    spec = MeshSpec(
        nodes=3,
        job="digits",
        duration_s=0.0,
        push_probability=0.5,
        checkpoint_every_steps=CHECKPOINT_EVERY,
        eval_every_steps=0,
    )
    status = lambda mesh, i: asyncio.run(mesh.status(i))  # noqa: E731
    with LocalMesh(spec, tmp_path, fork_node) as mesh:
        for i in range(3):
            mesh.start(i)
        mesh.load_plan()
        asyncio.run(mesh.wait_ready())
        ckpt = mesh.node_dir(2) / "checkpoint.pt"
        wait_until(ckpt.exists, "node-2's first periodic checkpoint", TIMEOUT_S, mesh.check_alive)
        saved_step = torch.load(ckpt, weights_only=True)["step"]
        assert saved_step >= CHECKPOINT_EVERY

        mesh.kill(2)
        at_kill = [status(mesh, i)["step"] for i in (0, 1)]
        wait_until(
            lambda: all("node-2" not in status(mesh, i)["live_peers"] for i in (0, 1)),
            "survivors to mark node-2 down",
            TIMEOUT_S,
            mesh.check_alive,
        )
        wait_until(
            lambda: all(status(mesh, i)["step"] >= at_kill[i] + 300 for i in (0, 1)),
            "survivors to keep training",
            TIMEOUT_S,
            mesh.check_alive,
        )

        saved_step = torch.load(ckpt, weights_only=True)["step"]
        mesh.start(2)
        wait_until(lambda: _answers(mesh, 2), "node-2 to restart", TIMEOUT_S, mesh.check_alive)
        resumed = status(mesh, 2)
        assert resumed["step"] >= saved_step, (resumed, saved_step)
        asyncio.run(mesh.wait_ready())
        wait_until(
            lambda: status(mesh, 2)["step"] >= saved_step + 300,
            "node-2 to train past its checkpoint",
            TIMEOUT_S,
            mesh.check_alive,
        )
        # Caught up: the restarted node's model is back in consensus with the others.
        wait_until(
            lambda: consensus_distance(asyncio.run(mesh.pull_all())) < 0.05,
            "consensus including the restarted node",
            TIMEOUT_S,
            mesh.check_alive,
        )
        assert "resumed node-2" in (mesh.node_dir(2) / "node.log").read_text()
        for i in sorted(mesh.procs):
            assert mesh.stop(i) == 0


def _answers(mesh: LocalMesh, index: int) -> bool:
    try:
        asyncio.run(mesh.status(index))
    except Exception:
        return False
    return True
