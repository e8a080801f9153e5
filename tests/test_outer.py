"""The outer optimizer of ``persyn`` (node/trainer/outer.py): DiLoCo's outer Nesterov step
after each burst of averaging (docs/protocols/persyn.md, "Outer optimizer").

The arithmetic against torch's own SGD, on tensors and numpy vectors alike; the core's
schedule (one OuterStep the step after each burst, none with the defaults); the settings;
the simulator and two real daemons, which carry the same action out.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from gossipd.node.errors import ConfigError
from gossipd.node.launch.forked import fork_node
from gossipd.node.launch.localmesh import LocalMesh, MeshSpec
from gossipd.node.protocols import CoreSettings, build
from gossipd.node.protocols.base import OuterStep, StepEnded, ViewChanged
from gossipd.node.shared.config import parse_config
from gossipd.node.sim import SimSpec
from gossipd.node.sim.driver import Simulation
from gossipd.node.trainer.outer import OuterNesterov


def _averages(n: int, dim: int = 7) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(dim, generator=g, dtype=torch.float64) for _ in range(n)]


@pytest.mark.parametrize(("lr", "momentum"), [(0.7, 0.9), (1.0, 0.5), (0.3, 0.0)])
def test_the_outer_step_is_torch_sgd_with_nesterov_on_the_pseudo_gradient(
    lr: float, momentum: float
) -> None:
    first, *rest = _averages(6)
    shared = torch.nn.Parameter(first.clone())
    sgd = torch.optim.SGD([shared], lr=lr, momentum=momentum, nesterov=momentum > 0)
    ours, on_numpy = OuterNesterov(lr, momentum), OuterNesterov(lr, momentum)
    assert torch.equal(ours.step(0, first), first)  # the first only records the model
    on_numpy.step(0, first.numpy())
    for averaged in rest:
        shared.grad = shared.detach() - averaged
        sgd.step()
        torch.testing.assert_close(ours.step(0, averaged), shared.detach(), rtol=0, atol=1e-12)
        np.testing.assert_allclose(on_numpy.step(0, averaged.numpy()), shared.detach().numpy())
    assert ours.nbytes == 7 * 8 * (2 if momentum else 1)


def test_learning_rate_one_without_momentum_is_the_average_itself() -> None:
    outer = OuterNesterov(1.0, 0.0)
    for averaged in _averages(4):  # θ − 1·(θ − x̄): x̄ up to rounding
        torch.testing.assert_close(outer.step(0, averaged), averaged, rtol=0, atol=1e-12)


def test_a_recorded_model_is_a_copy_the_caller_cannot_change() -> None:
    x = torch.ones(3)
    outer = OuterNesterov(0.5, 0.0)
    outer.step(0, x)
    x += 1  # training goes on in place
    assert torch.equal(outer.step(0, torch.zeros(3)), torch.full((3,), 0.5))


@pytest.mark.parametrize(("lr", "momentum"), [(0.0, 0.9), (-1.0, 0.0), (0.7, 1.0), (0.7, -0.1)])
def test_bad_outer_settings_are_refused(lr: float, momentum: float) -> None:
    with pytest.raises(ValueError, match="outer learning rate"):
        OuterNesterov(lr, momentum)
    data = {
        "mesh_id": "m",
        "node_id": "a",
        "tls": {"insecure": True},
        "gossip": {
            "protocol": "persyn",
            "persyn": {"outer_learning_rate": lr, "outer_momentum": momentum},
        },
    }
    with pytest.raises(ConfigError, match=r"gossip\.persyn\.outer_"):
        parse_config(data, "site.toml")


def _outer_steps(options: dict[str, float], nodes: int = 4, steps: int = 40) -> list[int]:
    core = build("persyn", CoreSettings("n0", 2, options={"average_every_steps": 10, **options}))
    core.handle(ViewChanged(frozenset(f"n{i}" for i in range(nodes))))
    at = []
    for step in range(1, steps + 1):
        actions = core.handle(StepEnded(step, float(step)))
        outer = [a for a in actions if isinstance(a, OuterStep)]
        if outer:
            assert outer == [OuterStep(step // 10, options["outer_learning_rate"], 0.9)]
            at.append(step)
    return at


def test_the_core_asks_for_an_outer_step_the_step_after_each_burst() -> None:
    # N = 4: sub-rounds 0 and 1 at steps 10 and 11, the outer step at 12; and so on.
    assert _outer_steps({"outer_learning_rate": 0.7, "outer_momentum": 0.9}) == [12, 22, 32]
    assert _outer_steps({"outer_learning_rate": 0.7, "outer_momentum": 0.9}, nodes=8) == [
        13,
        23,
        33,
    ]
    core = build("persyn", CoreSettings("n0", 2, options={"average_every_steps": 10}))
    core.handle(ViewChanged(frozenset({"n0", "n1"})))
    for step in range(1, 41):  # the defaults: no outer step, plain averaging
        assert not any(isinstance(a, OuterStep) for a in core.handle(StepEnded(step, 1.0)))


def test_the_simulator_carries_the_outer_step_out_and_keeps_the_sum_of_weights() -> None:
    spec = SimSpec(
        protocol="persyn",
        nodes=4,
        rounds=60,
        predict=False,
        check_invariants=True,
        options={"average_every_steps": 10, "outer_learning_rate": 0.7, "outer_momentum": 0.9},
    )
    sim = Simulation(spec)
    result = sim.run()
    assert sorted(sim.outers) == [0, 1, 2, 3]
    assert all(o.steps >= 0 and len(o.shared) == spec.segments for o in sim.outers.values())
    assert result.invariant_mass_error is not None and result.invariant_mass_error <= 1e-12
    # Training off: the bursts still bring the vectors together.
    assert result.consensus_error_end < 0.1 * result.consensus_error_start


def test_two_daemons_run_persyn_with_an_outer_step_and_keep_their_weight(tmp_path: Path) -> None:
    spec = MeshSpec(
        protocol="persyn",
        nodes=2,
        job="digits",
        max_steps=200,
        duration_s=0.0,
        cpu_share=1.0,
        eval_every_steps=100,
        checkpoint_every_steps=0,
        protocol_options={
            "average_every_steps": 10,
            "outer_learning_rate": 0.7,
            "outer_momentum": 0.9,
        },
    )
    with LocalMesh(spec, tmp_path, fork_node) as mesh:
        for i in range(spec.nodes):
            mesh.start(i)
        asyncio.run(mesh.wait_ready())
        states = asyncio.run(mesh.wait_settled(180.0))
        codes = [mesh.stop(i) for i in sorted(mesh.procs)]
    assert codes == [0, 0]
    assert sum(s["sum_weights"][0] for s in states) == pytest.approx(2.0, abs=1e-12)
    logs = [p.read_text() for p in sorted(tmp_path.rglob("node.log"))]
    assert len(logs) == 2
    for text in logs:
        assert "persyn: outer optimizer on (learning rate 0.7, momentum 0.9)" in text
