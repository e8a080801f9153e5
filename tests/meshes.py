"""Meshes of real daemons for fault and adversary tests (test_liveness, test_attacks,
test_mass_faults and others): start them fully connected, read their Status, wait on
their counters, stop, hang and probe them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gossipd.node.launch.localmesh import free_ports, stop_processes
from gossipd.node.shared.tls import Credentials
from tests.daemons import DaemonHandle, start_daemon, wait_until


def status_of(handle: DaemonHandle, *, checksum: bool = False) -> dict[str, Any]:
    """Status straight from the RPC (``checksum`` asks the node to hash its model).

    Keys that ``status_dict`` may not know yet are filled from the reply, so a
    test reads a counter the node does not report as 0 and fails on its assertion.
    """

    from gossipd.node.net.status.query import status_dict
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
