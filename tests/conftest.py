"""Fixtures that start real daemons as subprocesses on free loopback ports and always reap them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from gossipd.node.errors import GossipdError
from gossipd.node.launch.localmesh import free_ports, spawn_node, stop_process, stop_processes
from gossipd.node.net.status import query_status
from gossipd.node.shared.tls import Credentials

# Files whose tests run real meshes for tens of seconds, roughly longest first. They are
# queued before the rest (with `--dist loadfile --no-loadscope-reorder`, xdist hands out
# files in collection order): a long file started last keeps one worker busy long after
# the other has run out of work, which was a few minutes of the suite's wall time.
SLOW_FILES_FIRST = (
    "test_mesh_digits.py", "test_mesh_averaging.py", "test_ranks.py", "test_bench_wan.py",
    "test_overlap_mesh.py", "test_allreduce.py", "test_insider_streams.py",
    "test_dashboards.py", "test_containers.py", "test_crash_all_sites.py",
    "test_crash_one_site.py", "test_crash_recovery.py", "test_insider_weight.py",
    "test_mqtt_outage.py", "test_coordinator_client.py", "test_demo.py",
    "test_bench_overlap.py", "test_bench_protocols.py", "test_bench_transport.py",
    "test_liveness.py", "test_attacks.py", "test_mqtt.py", "test_overlap_daemon.py",
    "test_operator.py", "test_sim.py", "test_clean_shutdown.py", "test_leaving_receiver.py",
    "test_lost_ack.py", "test_mass_faults.py", "test_bulk_lane.py",
)  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slow files first, each file's tests in their own order (a stable sort)."""
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


torch.set_num_threads(1)
START_TIMEOUT_S = 120.0
TEST_STEPS_PER_S = 100.0


@dataclass
class DaemonHandle:
    node_id: str
    address: str
    data_dir: Path
    config_path: Path
    proc: subprocess.Popen[bytes]
    tls: Credentials | None = None  # what this test presents to it (None: plaintext)

    def status(self, *, checksum: bool = False) -> dict[str, Any]:
        return asyncio.run(query_status(self.address, 10.0, checksum=checksum, tls=self.tls))

    def log(self) -> str:
        path = self.data_dir / "node.log"
        return path.read_text() if path.exists() else ""

    def node_json(self) -> dict[str, Any]:
        return json.loads((self.data_dir / "node.json").read_text())

    def stop(self, timeout_s: float = 60.0) -> int:
        return stop_process(self.proc, timeout_s)


def wait_until(
    check: Callable[[], bool],
    what: str,
    timeout_s: float = 120.0,
    also: Callable[[], None] = lambda: None,
) -> None:
    """Poll ``check`` until it holds; ``also`` runs each round (e.g. raise if a child died)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        also()
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def scrape_metrics(port: int) -> dict[str, float]:
    """One scrape of a node's Prometheus endpoint: sample name with labels -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in lines
        if line and not line.startswith("#")
    }


def toml_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def write_config(path: Path, config: dict[str, Any]) -> None:
    top = [f"{k} = {toml_value(v)}" for k, v in config.items() if not isinstance(v, dict)]
    sections = [
        f"[{k}]\n" + "\n".join(f"{kk} = {toml_value(vv)}" for kk, vv in v.items())
        for k, v in config.items()
        if isinstance(v, dict)
    ]
    path.write_text("\n".join(top) + "\n\n" + "\n\n".join(sections) + "\n")


@contextlib.contextmanager
def coordinator_process(config: dict[str, Any], workdir: Path) -> Iterator[dict[str, Any]]:
    """`gossipd coordinator` on ``config`` (written to ``workdir/coord.toml``; give it
    ``listen`` and ``metrics.listen`` on port 0), once it serves: yields the addresses it
    bound (its ``coordinator.json``). Always reaped."""
    from gossipd.coordinator.server import INFO_FILE

    path = workdir / "coord.toml"
    write_config(path, config)
    log_path = workdir / "coord.log"
    proc = spawn_node(path, log_path, "coordinator")
    try:
        info = Path(config["data_dir"]) / INFO_FILE

        def alive() -> None:
            if proc.poll() is not None:
                raise AssertionError(f"coordinator exited:\n{log_path.read_text()[-3000:]}")

        wait_until(info.exists, "the coordinator to serve", 30.0, alive)
        yield json.loads(info.read_text())
    finally:
        stop_process(proc, 15.0)


def write_node_config(
    tmp_path: Path, node_id: str, port: int, data_dir: Path, **config: Any
) -> Path:
    """A daemon's TOML with the test defaults (synthetic job, lr 0, no pushes, no periodic
    checkpoints, no CPU budget for gossip: tests count pushes against their own timeouts
    on loaded machines, and tests/test_cpu_budget.py covers the budget); sections given
    in ``config`` are merged key by key over them.

    The trainer is paced to ``TEST_STEPS_PER_S``: these tests wait on gossip, not on
    steps, and a trainer stepping flat out took a core from every other test's daemons.
    """
    full: dict[str, Any] = {
        "mesh_id": "test-mesh",
        "node_id": node_id,
        "listen": f"127.0.0.1:{port}",
        "data_dir": str(data_dir),
        "job": {
            "name": "synthetic",
            "learning_rate": 0.0,
            "eval_every_steps": 0,
            "max_steps_per_s": TEST_STEPS_PER_S,
        },
        "gossip": {"push_probability": 0.0, "cpu_share": 1.0},
        "checkpoint": {"every_steps": 0},
        # Plaintext unless a test gives certificates: TLS has its own tests, and a
        # user's paths (demo, mesh up) default to it.
        "tls": {"insecure": True},
    }
    for key, value in config.items():
        if isinstance(value, dict) and isinstance(full.get(key), dict):
            full[key] = {**full[key], **value}
        else:
            full[key] = value
    config_path = tmp_path / f"{node_id}.toml"
    write_config(config_path, full)
    return config_path


def start_daemon(
    tmp_path: Path, node_id: str, port: int, *, client_tls: Credentials | None = None, **config: Any
) -> DaemonHandle:
    """``client_tls``: the certificate the test presents to this daemon (None: plaintext)."""
    data_dir = tmp_path / node_id
    data_dir.mkdir(parents=True, exist_ok=True)
    config_path = write_node_config(tmp_path, node_id, port, data_dir, **config)
    proc = spawn_node(config_path, data_dir / "node.log")
    return answering(
        DaemonHandle(node_id, f"127.0.0.1:{port}", data_dir, config_path, proc, client_tls)
    )


def answering(handle: DaemonHandle) -> DaemonHandle:
    """``handle`` once its daemon answers Status; stopped and raised if it never does."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if handle.proc.poll() is not None:
            raise RuntimeError(
                f"{handle.node_id} exited with {handle.proc.returncode}:\n{handle.log()}"
            )
        try:
            handle.status()
            return handle
        except GossipdError:
            if time.monotonic() > deadline:
                handle.stop()
                raise RuntimeError(
                    f"{handle.node_id} did not answer Status:\n{handle.log()}"
                ) from None
            time.sleep(0.2)
        except BaseException:
            handle.stop()  # never leave a daemon behind, whatever went wrong
            raise


def restart_daemon(handle: DaemonHandle) -> DaemonHandle:
    """Start ``handle``'s daemon again from its config and data dir (it resumes from its
    checkpoint); the old process must have exited. Returns the new handle."""
    assert handle.proc.poll() is not None, f"{handle.node_id} is still running"
    proc = spawn_node(handle.config_path, handle.data_dir / "node.log")
    return answering(replace(handle, proc=proc))


def left_running(workdir: Path) -> list[int]:
    """Processes whose command line names the run's files (its sites)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if str(workdir).encode() in cmdline:
                found.append(int(entry.name))
    return found


def kill_hard(handle: DaemonHandle) -> None:
    """``kill -9``: no hand-off, no final checkpoint, whatever was in flight is cut."""
    handle.proc.kill()
    handle.proc.wait(timeout=30)


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


# -- Helpers for fault and adversary tests (test_liveness, test_attacks, test_mass_faults) --


def status_of(handle: DaemonHandle, *, checksum: bool = False) -> dict[str, Any]:
    """Status straight from the RPC (``checksum`` asks the node to hash its model).

    Keys that ``status_dict`` may not know yet are filled from the reply, so a
    test reads a counter the node does not report as 0 and fails on its assertion.
    """

    from gossipd.node.net.status import status_dict
    from gossipd.proto import gossip_pb2 as pb
    from gossipd.proto import gossip_pb2_grpc as pb_grpc

    async def call() -> pb.StatusReply:
        tls = handle.tls or Credentials(insecure=True)
        async with tls.channel(handle.address, []) as channel:
            return await pb_grpc.GossipStub(channel).Status(
                pb.StatusRequest(checksum=checksum), timeout=20.0
            )

    reply = asyncio.run(call())
    out = status_dict(reply)
    out.setdefault("pushes_acked", reply.pushes_acked)
    out.setdefault("pushes_failed", reply.pushes_failed)
    out.setdefault("pushes_merged", reply.pushes_merged)
    out.setdefault(
        "peers",
        [
            {"node_id": p.node_id, "address": p.address, "incarnation": p.incarnation}
            for p in reply.peers
        ],
    )
    out.setdefault("suspected_peers", list(reply.suspected_peers))
    out.setdefault("rejected", dict(reply.rejected))
    out.setdefault("reserved_weights", list(reply.reserved_weights))
    return out


def check_alive(handles: list[DaemonHandle]) -> None:
    """Raise (with its log's tail) if any daemon has exited: pass as ``wait_until(also=...)``."""
    for h in handles:
        if h.proc.poll() is not None:
            raise AssertionError(f"{h.node_id} exited with {h.proc.returncode}:\n{h.log()[-3000:]}")


def stop_all(handles: list[DaemonHandle]) -> None:
    """Teardown: SIGCONT (in case a test left one stopped), then SIGTERM and reap each."""
    import os
    import signal

    for h in handles:
        if h.proc.poll() is None:
            os.kill(h.proc.pid, signal.SIGCONT)
    stop_processes([h.proc for h in handles], 60.0)


def start_mesh(
    tmp_path: Path, node_ids: list[str], *, ready_timeout_s: float = 120.0, **config: Any
) -> list[DaemonHandle]:
    """Start one daemon per id at once, each seeded with all the others; wait for a full mesh.

    Node i gets ``job.seed = i`` (distinct models) and ``gossip.seed = i`` (its own
    peer choices) unless ``config`` sets them. Every daemon started is stopped if
    the mesh does not come up.
    """
    from concurrent.futures import ThreadPoolExecutor

    ports = free_ports(len(node_ids))
    addresses = [f"127.0.0.1:{p}" for p in ports]

    def start(index: int) -> DaemonHandle:
        cfg = dict(config)
        cfg["job"] = {"seed": index, **config.get("job", {})}
        cfg["gossip"] = {"seed": index, **config.get("gossip", {})}
        seeds = [a for i, a in enumerate(addresses) if i != index]
        return start_daemon(tmp_path, node_ids[index], ports[index], seeds=seeds, **cfg)

    handles: list[DaemonHandle] = []
    with ThreadPoolExecutor(len(node_ids)) as pool:
        futures = [pool.submit(start, i) for i in range(len(node_ids))]
        errors = []
        for future in futures:
            try:
                handles.append(future.result())
            except Exception as err:
                errors.append(err)
    if errors:
        stop_all(handles)
        raise errors[0]
    try:
        wait_mesh_live(handles, ready_timeout_s)
    except BaseException:
        stop_all(handles)
        raise
    return handles


def wait_mesh_live(handles: list[DaemonHandle], timeout_s: float = 120.0) -> None:
    """Until every daemon lists every other one as live."""
    ids = {h.node_id for h in handles}

    def full() -> bool:
        return all(set(status_of(h)["live_peers"]) >= ids - {h.node_id} for h in handles)

    what = f"{sorted(ids)} to see each other live"
    wait_until(full, what, timeout_s, lambda: check_alive(handles))


class sigstopped:
    """SIGSTOP ``handle`` for the block (a hung process, its sockets still open); always SIGCONT."""

    def __init__(self, handle: DaemonHandle) -> None:
        self.handle = handle

    def __enter__(self) -> DaemonHandle:
        import os
        import signal

        os.kill(self.handle.proc.pid, signal.SIGSTOP)
        return self.handle

    def __exit__(self, *exc: object) -> None:
        import os
        import signal

        if self.handle.proc.poll() is None:
            os.kill(self.handle.proc.pid, signal.SIGCONT)


def open_fds(handle: DaemonHandle) -> int:
    import os

    return len(os.listdir(f"/proc/{handle.proc.pid}/fd"))


def thread_count(handle: DaemonHandle) -> int:
    for line in Path(f"/proc/{handle.proc.pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError(f"no Threads line for pid {handle.proc.pid}")


def wait_counters_grow(
    handles: list[DaemonHandle],
    keys: tuple[str, ...],
    margin: int,
    what: str,
    timeout_s: float = 60.0,
    every: Callable[[], None] = lambda: None,
) -> None:
    """Until each of ``keys`` grew by ``margin`` on every one of ``handles`` (from now).

    ``every`` runs at each poll (e.g. to check an invariant while waiting); on a
    timeout the message says where each counter got to.
    """
    start = {h.node_id: status_of(h) for h in handles}
    latest = dict(start)

    def grown() -> bool:
        every()
        for h in handles:
            latest[h.node_id] = status_of(h)
        return all(
            latest[h.node_id].get(k, 0) - start[h.node_id].get(k, 0) >= margin
            for h in handles
            for k in keys
        )

    try:
        wait_until(grown, what, timeout_s, lambda: check_alive(handles))
    except AssertionError as err:
        seen = {
            h.node_id: {k: (start[h.node_id].get(k), latest[h.node_id].get(k)) for k in keys}
            for h in handles
        }
        raise AssertionError(f"{err}; (start, latest) per node: {seen}") from None


def stop_in_turn(handles: list[DaemonHandle], timeout_s: float = 60.0) -> list[list[float]]:
    """SIGTERM one daemon at a time (each hands its weight to a live peer as it leaves).

    Before stopping the next one, wait until the rest no longer list the one that
    left as live. Returns each daemon's final per-segment sum-weights from its
    ``summary.json``.
    """
    import os
    import signal

    weights = []
    for i, h in enumerate(handles):
        if h.proc.poll() is None:
            os.kill(h.proc.pid, signal.SIGCONT)
        code = h.stop(timeout_s)
        assert code == 0, f"{h.node_id} exited with {code}:\n{h.log()[-3000:]}"
        weights.append(json.loads((h.data_dir / "summary.json").read_text())["sum_weights"])
        rest = handles[i + 1 :]
        if rest:
            wait_gone(h.node_id, rest, timeout_s)
    return weights


def wait_gone(node_id: str, handles: list[DaemonHandle], timeout_s: float = 60.0) -> None:
    """Until none of ``handles`` lists ``node_id`` as live."""
    wait_until(
        lambda: all(node_id not in status_of(h)["live_peers"] for h in handles),
        f"{[h.node_id for h in handles]} to see {node_id} gone",
        timeout_s,
        lambda: check_alive(handles),
    )
