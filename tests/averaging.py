"""Three daemons averaging with training off (learning rate 0): the right answer is known,
the mean of the initial models. Shared by the averaging tests of every protocol and of
every codec (tests/test_mesh_averaging.py, tests/test_compressed_mesh.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gossipd.node.launch.forked import fork_node
from gossipd.node.launch.localmesh import LocalMesh, MeshSpec

SETTLE_S = 120.0


@dataclass
class Averaged:
    """What a run left: the initial models, each node's last status, its final model, and
    the exit codes."""

    initial: list[torch.Tensor]
    states: list[dict[str, Any]]
    models: list[torch.Tensor]
    codes: list[int | None]


def averaging_spec(protocol: str, **settings: Any) -> MeshSpec:
    """Three nodes of the synthetic job, 3,000 steps at learning rate 0, pushing every step."""
    return MeshSpec(
        protocol=protocol,
        nodes=3,
        job="synthetic",
        learning_rate=0.0,
        max_steps=3000,
        duration_s=0.0,
        push_probability=1.0,
        # 3,000 synthetic steps take well under a second of CPU: a budget of that
        # little wall-clock time pays for too few pushes to reach the mean (0.002
        # apart at the default 0.03). The budget is tested in test_cpu_budget_holds.
        cpu_share=1.0,
        eval_every_steps=0,
        checkpoint_every_steps=0,
        **settings,
    )


def average(spec: MeshSpec, tmp_path: Path) -> Averaged:
    """Run ``spec`` until every node finished and nothing is in flight, then stop it."""
    with LocalMesh(spec, tmp_path, fork_node) as mesh:
        for i in range(spec.nodes):
            mesh.start(i)
        mesh.load_plan()
        asyncio.run(mesh.wait_ready())
        initial = mesh.initial_models()
        states = asyncio.run(mesh.wait_settled(SETTLE_S))
        models = asyncio.run(mesh.pull_all())
        codes = [mesh.stop(i) for i in sorted(mesh.procs)]
    return Averaged(initial, states, models, codes)
