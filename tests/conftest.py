"""Pytest's hooks and fixtures for the whole suite: slow files first, one torch thread, and
the ``daemons`` fixture that starts real daemons and always reaps them.

The code that starts and drives daemons lives in :mod:`tests.daemons` (one daemon) and
:mod:`tests.meshes` (several, and the fault tests' probes); its names are imported here
too, so ``from tests.conftest import ...`` keeps working.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gossipd.node.launch.localmesh import free_ports
from tests.daemons import (
    START_TIMEOUT_S,
    TEST_STEPS_PER_S,
    DaemonHandle,
    answering,
    coordinator_process,
    kill_hard,
    left_running,
    restart_daemon,
    scrape_metrics,
    start_daemon,
    toml_value,
    wait_until,
    write_config,
    write_node_config,
)
from tests.meshes import (
    check_alive,
    open_fds,
    sigstopped,
    start_mesh,
    status_of,
    stop_all,
    stop_in_turn,
    thread_count,
    wait_counters_grow,
    wait_gone,
    wait_mesh_live,
)

__all__ = [
    "START_TIMEOUT_S",
    "TEST_STEPS_PER_S",
    "DaemonHandle",
    "answering",
    "check_alive",
    "coordinator_process",
    "daemons",
    "kill_hard",
    "left_running",
    "open_fds",
    "restart_daemon",
    "scrape_metrics",
    "sigstopped",
    "start_daemon",
    "start_mesh",
    "status_of",
    "stop_all",
    "stop_in_turn",
    "thread_count",
    "toml_value",
    "wait_counters_grow",
    "wait_gone",
    "wait_mesh_live",
    "wait_until",
    "write_config",
    "write_node_config",
]

# Files whose tests run real meshes for tens of seconds, roughly longest first. They are
# queued before the rest (with `--dist loadfile --no-loadscope-reorder`, xdist hands out
# files in collection order): a long file started last keeps one worker busy long after
# the other has run out of work, which was a few minutes of the suite's wall time.
SLOW_FILES_FIRST = (
    "test_demo.py", "test_mesh_digits.py", "test_mesh_averaging.py", "test_ranks.py",
    "test_nat_mesh.py", "test_bench_wan_runs.py", "test_job_meshes.py", "test_diloco.py",
    "test_relay_mesh.py",
    "test_overlap_mesh.py", "test_allreduce.py", "test_insider_streams.py",
    "test_insider_persyn.py", "test_insider_persyn_cap.py",
    "test_dashboards.py", "test_containers.py", "test_crash_all_sites.py",
    "test_crash_one_site.py", "test_crash_recovery.py", "test_insider_weight.py",
    "test_mqtt_outage.py", "test_coordinator_client.py",
    "test_bench_overlap.py", "test_bench_protocols.py", "test_bench_transport.py",
    "test_liveness.py", "test_attacks.py", "test_attacks_membership.py", "test_mqtt.py",
    "test_overlap_daemon.py", "test_operator.py", "test_sim.py", "test_clean_shutdown.py",
    "test_leaving_receiver.py", "test_lost_ack.py", "test_mass_faults.py", "test_bulk_lane.py",
    "test_bulk_lane_hostile.py", "test_first_mesh.py", "test_startup_mismatch.py",
)  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slow files first, each file's tests in their own order (a stable sort)."""
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


torch.set_num_threads(1)


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[Any]:
    """Factory: ``daemons(node_id, **config)`` starts a daemon; all are stopped at teardown."""
    started: list[DaemonHandle] = []
    ports = iter(free_ports(16))

    def start(node_id: str, port: int | None = None, **config: Any) -> DaemonHandle:
        handle = start_daemon(tmp_path, node_id, port or next(ports), **config)
        started.append(handle)
        return handle

    start.ports = ports  # type: ignore[attr-defined]
    yield start
    for handle in started:
        handle.stop()
