"""Gossip's CPU budget (``gossip.cpu_share``): measured, enforced by holding pushes, exported.

The share itself is checked with a scripted clock and CPU counter; the hold on real
daemons that train digits and push at every step, one with a budget no gossip can
stay under and one without a budget, side by side.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gossipd.node.config import parse_config
from gossipd.node.cpubudget import SAMPLE_S, WINDOW_S, CpuBudget, available_cpus
from gossipd.node.errors import ConfigError
from gossipd.node.mesh import free_ports
from tests.conftest import (
    DaemonHandle,
    check_alive,
    scrape_metrics,
    start_daemon,
    status_of,
    stop_all,
    stop_in_turn,
    wait_mesh_live,
    wait_until,
)


class Clocks:
    """A wall clock and a process CPU counter the test moves by hand."""

    def __init__(self) -> None:
        self.wall = 100.0
        self.cpu = 10.0

    def advance(self, wall_s: float, cpu_s: float) -> None:
        self.wall += wall_s
        self.cpu += cpu_s


def budget(share: float, clocks: Clocks) -> CpuBudget:
    return CpuBudget(share, cpus=1.0, process_cpu=lambda: clocks.cpu, clock=lambda: clocks.wall)


def test_share_is_the_cpu_the_trainer_did_not_spend_over_the_nodes_cores() -> None:
    clocks = Clocks()
    b = CpuBudget(0.1, cpus=2.0, process_cpu=lambda: clocks.cpu, clock=lambda: clocks.wall)
    b.gossip_share()
    clocks.advance(1.0, 1.5)
    b.add_training(1.1)  # 0.4 CPU-s of gossip in 1 s on 2 cores
    assert b.gossip_share() == pytest.approx(0.2)


@pytest.mark.parametrize(
    ("cpu_max", "expected"),
    [("max 100000\n", None), ("50000 100000\n", 0.5), ("junk", None), (None, None)],
)
def test_the_nodes_cores_are_its_affinity_or_a_lower_cgroup_quota(
    tmp_path: Path, cpu_max: str | None, expected: float | None
) -> None:
    path = tmp_path / "cpu.max"
    if cpu_max is not None:
        path.write_text(cpu_max)
    affinity = float(len(os.sched_getaffinity(0)))
    assert available_cpus(path) == (expected if expected is not None else affinity)


def test_share_is_the_part_of_the_cpu_the_trainer_did_not_spend() -> None:
    clocks = Clocks()
    b = budget(0.1, clocks)
    b.gossip_share()
    for _ in range(10):  # 1 s: 0.8 CPU-s training, 0.2 CPU-s the rest
        clocks.advance(SAMPLE_S, 0.1)
        b.add_training(0.08)
        b.gossip_share()
    assert b.gossip_share() == pytest.approx(0.2)


def test_only_the_last_window_counts() -> None:
    clocks = Clocks()
    b = budget(0.1, clocks)
    b.gossip_share()
    for _ in range(int(WINDOW_S / SAMPLE_S) * 2):  # a gossip-heavy past...
        clocks.advance(SAMPLE_S, 0.1)
        b.add_training(0.01)
        b.gossip_share()
    assert b.gossip_share() == pytest.approx(0.9)
    for _ in range(int(WINDOW_S / SAMPLE_S) + 2):  # ...then training alone
        clocks.advance(SAMPLE_S, 0.1)
        b.add_training(0.1)
        b.gossip_share()
    assert b.gossip_share() == pytest.approx(0.0)


def test_pushes_wait_only_while_over_and_the_trainer_steps() -> None:
    clocks = Clocks()
    b = budget(0.1, clocks)
    b.gossip_share()
    b.released()
    clocks.advance(1.0, 1.0)
    b.add_training(0.5)  # gossip took half
    assert b.wait_s() == 0.0, "a trainer that does not step cannot be starved"
    b.training = True
    assert b.wait_s() > 0.0
    unlimited = budget(1.0, clocks)
    unlimited.training = True
    unlimited.gossip_share()
    unlimited.released()
    clocks.advance(1.0, 1.0)
    assert unlimited.gossip_share() == pytest.approx(1.0)
    assert unlimited.wait_s() == 0.0, "cpu_share = 1 never holds a push"


def test_over_the_share_pushes_are_paced_at_the_rate_scaled_by_share_over_measured() -> None:
    """Not held until the share falls (every node of a mesh then stops and bursts at
    once): the node's own push rate is scaled down, pushes spread evenly."""
    clocks = Clocks()
    b = budget(0.1, clocks)
    b.training = True
    b.gossip_share()
    step = 0.125  # a binary fraction: the scripted clock adds up exactly
    for _ in range(10):  # 10 pushes, gossip at 0.2 of the core: twice the share
        clocks.advance(step, step)
        b.add_training(step * 0.8)
        assert b.gossip_share() == pytest.approx(0.2)
        b.released()
    # 10 pushes in the 2 s window: 5 a second, to be halved: one every 0.4 s.
    assert b.wait_s() == pytest.approx(0.4)
    clocks.advance(2 * step, 2 * step)
    b.add_training(2 * step * 0.8)
    assert b.wait_s() == pytest.approx(0.15)
    clocks.advance(2 * step, 2 * step)
    b.add_training(2 * step * 0.8)
    assert b.wait_s() == 0.0


def test_over_the_share_a_node_still_pushes_but_one_per_window_times_measured_over_share() -> None:
    """Inbound traffic alone can keep a node over its share: it still moves its weight, at
    a rate that keeps falling with the overshoot, also once its last push left the window."""
    clocks = Clocks()
    b = budget(0.1, clocks)
    b.training = True
    b.gossip_share()
    clocks.advance(1.0, 1.0)  # all of it gossip, none of it our pushes
    assert b.wait_s() == 0.0, "the very first push goes at once"
    b.released()
    assert b.wait_s() == pytest.approx(WINDOW_S * 10.0)  # then one per window x measured/share
    clocks.advance(WINDOW_S + 1.0, WINDOW_S + 1.0)  # the push left the window; still 10x over
    assert b.wait_s() == pytest.approx(WINDOW_S * 10.0 - (WINDOW_S + 1.0))
    clocks.advance(WINDOW_S * 10.0, WINDOW_S * 10.0)
    assert b.wait_s() == 0.0


def test_the_record_of_pushes_stays_bounded_when_nothing_is_paced() -> None:
    """With cpu_share = 1 (or a trainer that never steps) nothing asks how long to wait,
    yet every push is recorded: the record must still forget what left the window."""
    clocks = Clocks()
    b = budget(1.0, clocks)
    for _ in range(10_000):  # 1000 pushes a second for 10 s
        clocks.advance(0.001, 0.001)
        b.released()
    assert len(b._releases) <= WINDOW_S / 0.001 + 1


@pytest.mark.parametrize("share", [0.0, -0.1, 1.5])
def test_a_share_outside_0_1_is_refused(share: float) -> None:
    with pytest.raises(ConfigError, match="cpu_share"):
        parse_config({"mesh_id": "m", "node_id": "a", "gossip": {"cpu_share": share}}, "test.toml")


def _metrics(handle: DaemonHandle) -> dict[str, float]:
    return scrape_metrics(handle.node_json()["metrics_port"])


def test_a_node_over_its_budget_holds_its_pushes_and_keeps_the_mass(tmp_path: Path) -> None:
    """``thrifty`` may give gossip 0.1% of its CPU, which no node pushing at every step
    stays under: its pushes wait (counted, up to the 5 s cap each) yet still go and are
    acknowledged. ``free`` (cpu_share = 1) never holds one. Both train the whole time;
    the mesh keeps its weight."""
    ports = free_ports(2)
    common = {
        "job": {"name": "digits", "learning_rate": 0.05, "duration_s": 600.0},
        "checkpoint": {"every_steps": 0},
    }
    handles: list[DaemonHandle] = []
    try:
        for i, (node_id, share) in enumerate([("thrifty", 0.001), ("free", 1.0)]):
            handles.append(
                start_daemon(
                    tmp_path,
                    node_id,
                    ports[i],
                    seeds=[f"127.0.0.1:{ports[1 - i]}"],
                    gossip={"push_probability": 1.0, "seed": i, "cpu_share": share},
                    **common,
                )
            )
        thrifty, free = handles
        wait_mesh_live(handles)

        def thrifty_held_and_delivered() -> bool:
            m = _metrics(thrifty)
            return (
                m.get("gossipd_pushes_held_total", 0) >= 2
                and status_of(thrifty)["pushes_acked"] >= 2
            )

        wait_until(
            thrifty_held_and_delivered,
            "thrifty to hold pushes for its budget and still deliver some",
            120.0,
            lambda: check_alive(handles),
        )
        thrifty_m, free_m = _metrics(thrifty), _metrics(free)
        assert thrifty_m["gossipd_gossip_cpu_budget"] == pytest.approx(0.001)
        assert thrifty_m["gossipd_push_held_seconds_total"] > 0
        assert 0 < thrifty_m["gossipd_gossip_cpu_share"] <= 1
        assert free_m["gossipd_gossip_cpu_budget"] == 1.0
        assert free_m.get("gossipd_pushes_held_total", 0) == 0
        assert status_of(free)["pushes_acked"] > status_of(thrifty)["pushes_acked"], (
            "the node without a budget should have pushed more"
        )
        weights = stop_in_turn(handles)
    finally:
        stop_all(handles)
    assert sum(w[0] for w in weights) == pytest.approx(2.0, abs=1e-9)


def test_the_runs_share_counts_only_the_time_the_trainer_stepped() -> None:
    """The mean over the run (summary.json) weighs every stretch of training by its
    length and leaves out the time the trainer did not step."""
    clocks = Clocks()
    b = budget(0.1, clocks)
    b.gossip_share()
    b.training = True
    clocks.advance(1.0, 0.5)
    b.add_training(0.4)  # 0.1 CPU-s of gossip in 1 s
    b.gossip_share()
    b.training = False
    clocks.advance(5.0, 5.0)  # not training: not counted, whatever gossip took
    b.gossip_share()
    b.training = True
    clocks.advance(3.0, 3.0)
    b.add_training(2.1)  # 0.9 CPU-s of gossip in 3 s
    assert b.mean_share_while_training() == pytest.approx((0.1 + 0.9) / (1.0 + 3.0))
