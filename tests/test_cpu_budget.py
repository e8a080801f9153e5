"""Gossip's CPU budget (``gossip.cpu_share``): what it measures and counts as gossip.

The share is checked with a scripted clock and CPU counter (tests/cpu_clocks.py); what
the node may use (affinity, a cgroup quota), torch.distributed's threads counted as
training, and the setting's bounds. How the budget holds pushes is in
tests/test_cpu_budget_holds.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gossipd.node.errors import ConfigError
from gossipd.node.launch.localmesh import free_ports
from gossipd.node.net.limits.cpu_budget import (
    SAMPLE_S,
    WINDOW_S,
    CollectiveThreads,
    CpuBudget,
    available_cpus,
)
from gossipd.node.shared.config import parse_config
from tests.cpu_clocks import Clocks, budget


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


def _task(tasks: Path, tid: int, name: str, utime: int, stime: int) -> None:
    """A /proc/self/task/<tid> entry: its name, and a stat line whose name has a space
    and a parenthesis, as a thread's may."""
    (tasks / str(tid)).mkdir(parents=True, exist_ok=True)
    (tasks / str(tid) / "comm").write_text(name + "\n")
    fields = ["S", *["0"] * 10, str(utime), str(stime), *["0"] * 8]
    (tasks / str(tid) / "stat").write_text(f"{tid} (a (b) c) {' '.join(fields)}\n")


def test_torch_distributed_threads_are_told_by_name_and_keep_their_cpu_once_gone(
    tmp_path: Path,
) -> None:
    tasks = tmp_path / "task"
    ticks = os.sysconf("SC_CLK_TCK")
    _task(tasks, 1, "python", 500, 500)  # the trainer and the network: not collectives
    _task(tasks, 2, "gloo_tcp_loop", 3 * ticks, ticks)
    _task(tasks, 3, "pt_gloo_runloop", ticks, 0)
    _task(tasks, 4, "python", ticks, 0)  # started, not yet named by torch
    threads = CollectiveThreads(tasks)
    assert threads.cpu_s() == pytest.approx(5.0)
    _task(tasks, 2, "gloo_tcp_loop", 4 * ticks, ticks)
    _task(tasks, 4, "pt_gloo_runloop", 2 * ticks, 0)
    for entry in (tasks / "3").iterdir():  # the thread exits: what it spent stays
        entry.unlink()
    (tasks / "3").rmdir()
    assert threads.cpu_s() == pytest.approx(8.0)
    assert CollectiveThreads(tmp_path / "absent").cpu_s() == 0.0


RANK_SCRIPT = textwrap.dedent(
    """
    import sys, time, torch, torch.distributed as dist
    from gossipd.node.net.limits.cpu_budget import CollectiveThreads
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    values = torch.randn(5210)
    threads = CollectiveThreads()
    before = (time.process_time(), time.thread_time(), threads.cpu_s())
    for _ in range(1000):
        dist.all_reduce(values)
    after = (time.process_time(), time.thread_time(), threads.cpu_s())
    print(*(a - b for a, b in zip(after, before)))
    dist.destroy_process_group()
    """
)


def test_a_multi_rank_sites_collectives_are_counted_where_gloo_spends_them() -> None:
    """Two real gloo ranks all-reduce a mnist1d model's worth of floats: most of the CPU
    is spent on gloo's own threads, not the caller's (which is all the trainer thread's
    clock sees), and the named threads account for it."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_ports(1)[0])}
    env.update(WORLD_SIZE="2", GLOO_SOCKET_IFNAME="lo")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT],
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert [p.returncode for p in procs] == [0, 0], outputs
    process_s, caller_s, collective_s = map(float, outputs[0][0].split())
    off_caller = process_s - caller_s
    assert off_caller > caller_s  # the clock the trainer thread reads misses most of it
    assert collective_s >= 0.8 * off_caller, (process_s, caller_s, collective_s)


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


@pytest.mark.parametrize("share", [0.0, -0.1, 1.5])
def test_a_share_outside_0_1_is_refused(share: float) -> None:
    with pytest.raises(ConfigError, match="cpu_share"):
        parse_config({"mesh_id": "m", "node_id": "a", "gossip": {"cpu_share": share}}, "test.toml")


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
