"""Baselines for `gossipd bench transport`: raw TCP, gloo, hivemind, each peer a process.

Every child process is reaped (terminate, then kill after a timeout), and every
wait is bounded, so a wedged baseline cannot hang the benchmark.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import queue
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gossipd.node.launch.localmesh import free_ports

MiB = 1 << 20
TIMEOUT_S = 120.0


def _tcp_receiver(port: int, nbytes: int, reps: int) -> None:
    buf = bytearray(nbytes)
    view = memoryview(buf)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for _ in range(reps + 1):
            got = 0
            while got < nbytes:
                n = sock.recv_into(view[got:], min(nbytes - got, MiB))
                if n == 0:
                    return
                got += n
            sock.sendall(b"k")


def bench_raw_tcp(payload: memoryview, reps: int, piece_bytes: int = MiB) -> list[float]:
    """sendall of the model in 1 MiB pieces, timed until the receiver's 1-byte ack."""
    nbytes = len(payload)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        peer = mp.get_context("spawn").Process(target=_tcp_receiver, args=(port, nbytes, reps))
        peer.start()
        times = []
        try:
            server.settimeout(TIMEOUT_S)
            conn, _ = server.accept()
            with conn:
                conn.settimeout(TIMEOUT_S)
                for rep in range(reps + 1):
                    t0 = time.perf_counter()
                    for start in range(0, nbytes, piece_bytes):
                        conn.sendall(payload[start : start + piece_bytes])
                    if conn.recv(1) != b"k":
                        raise RuntimeError("raw TCP receiver closed early")
                    if rep:
                        times.append(time.perf_counter() - t0)
        finally:
            _reap(peer)
    return times


def _worker_setup(log: str) -> None:
    """Send a worker's stdout and stderr (library chatter) to ``log``; one torch thread."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    torch.set_num_threads(1)


def _gloo_worker(rank: int, port: int, numel: int, reps: int, log: str, results: Any) -> None:
    import torch.distributed as dist

    _worker_setup(log)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    try:
        tensor, ack = torch.ones(numel), torch.zeros(1)
        times = []
        for rep in range(reps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(tensor, 1)
                dist.recv(ack, 1)
            else:
                dist.recv(tensor, 0)
                dist.send(ack, 0)
            if rep:
                times.append(time.perf_counter() - t0)
        if rank == 0:
            results.put(times)
    finally:
        dist.destroy_process_group()


def bench_gloo(numel: int, reps: int) -> list[float]:
    """dist.send/recv of the whole model as one float32 tensor, timed until a 1-float ack."""
    return _run_pair(_gloo_worker, (free_ports(1)[0], numel, reps))


def _hivemind_worker(rank: int, numel: int, reps: int, log: str, results: Any) -> None:
    """Both peers in one new process group, so one killpg also ends hivemind's children."""
    del rank
    os.setsid()
    _worker_setup(log)
    mp.set_start_method("fork", force=True)  # hivemind's own processes need fork
    import hivemind
    from hivemind.averaging.control import AveragingStage

    dhts: list[Any] = []
    averagers: list[Any] = []
    times, matchmaking = [], []
    try:
        dhts.append(hivemind.DHT(start=True))
        dhts.append(hivemind.DHT(initial_peers=dhts[0].get_visible_maddrs(), start=True))
        for i, dht in enumerate(dhts):
            tensor = torch.full((numel,), float(i))
            averagers.append(
                hivemind.DecentralizedAverager(
                    [tensor], dht, prefix="bench", target_group_size=2, start=True
                )
            )
        for rep in range(reps + 1):
            t0 = time.perf_counter()
            controls = [a.step(wait=False, require_trigger=True) for a in averagers]
            while any(c.stage != AveragingStage.AWAITING_TRIGGER for c in controls):
                if time.perf_counter() - t0 > 60 or any(c.done() for c in controls):
                    raise RuntimeError("hivemind matchmaking did not form a group of 2")
                time.sleep(0.001)
            t1 = time.perf_counter()
            for c in controls:
                c.allow_allreduce()
            for c in controls:
                c.result(timeout=TIMEOUT_S)
            if rep:
                matchmaking.append(t1 - t0)
                times.append(time.perf_counter() - t1)
        results.put({"allreduce": times, "matchmaking": matchmaking})
    finally:
        for obj in [*averagers, *dhts]:
            with contextlib.suppress(Exception):
                obj.shutdown()


_GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", 16 * MiB),
    ("grpc.max_send_message_length", 16 * MiB),
]


def _identity(b: bytes) -> bytes:
    return b


async def _grpc_sink(port: int, reps: int) -> None:
    """Serve ``bench.Sink``: Push counts a stream's bytes, Stop ends the server."""
    import asyncio

    import grpc

    async def count(frames: Any, context: Any) -> bytes:
        total = 0
        async for frame in frames:
            total += len(frame)
        return str(total).encode()

    done = asyncio.Event()

    async def stop(request: bytes, context: Any) -> bytes:
        done.set()
        return b""

    server = grpc.aio.server(options=_GRPC_OPTIONS)
    handlers = {
        "Push": grpc.stream_unary_rpc_method_handler(count, _identity, _identity),
        "Stop": grpc.unary_unary_rpc_method_handler(stop, _identity, _identity),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Sink", handlers),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(done.wait(), TIMEOUT_S * (reps + 2))
    await server.stop(1.0)


async def _grpc_push(port: int, nbytes: int, reps: int, channels: int) -> list[float]:
    """Stream ``nbytes`` in 1 MiB messages over ``channels`` connections, ``reps`` timed
    times after a warm-up, then stop the sink."""
    import asyncio

    import grpc

    local = [*_GRPC_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]  # one TCP connection each
    chans = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=local) for _ in range(channels)]
    for chan in chans:
        await asyncio.wait_for(chan.channel_ready(), TIMEOUT_S)
    calls = [c.stream_unary("/bench.Sink/Push", _identity, _identity) for c in chans]
    piece, per_stream = b"\0" * MiB, nbytes // (MiB * channels)

    async def frames() -> Any:
        for _ in range(per_stream):
            yield piece

    times = []
    for rep in range(reps + 1):
        t0 = time.perf_counter()
        await asyncio.gather(*(call(frames(), timeout=TIMEOUT_S) for call in calls))
        if rep:
            times.append(time.perf_counter() - t0)
    await chans[0].unary_unary("/bench.Sink/Stop", _identity, _identity)(b"", timeout=TIMEOUT_S)
    for chan in chans:
        await chan.close()
    return times


def _grpc_worker(
    rank: int, port: int, nbytes: int, reps: int, channels: int, log: str, results: Any
) -> None:
    """Rank 1 serves a stream that only counts bytes; rank 0 streams 1 MiB messages to it,
    then tells it to stop (a server left waiting would hold the run up until reaped)."""
    import asyncio

    _worker_setup(log)
    if rank == 1:
        asyncio.run(_grpc_sink(port, reps))
    else:
        results.put(asyncio.run(_grpc_push(port, nbytes, reps, channels)))


def bench_grpc_bare(nbytes: int, reps: int, channels: int = 4) -> list[float]:
    """grpc.aio alone: the ceiling any gRPC transport in Python reaches on this machine."""
    return _run_pair(_grpc_worker, (free_ports(1)[0], nbytes, reps, channels))


def bench_hivemind(numel: int, reps: int) -> dict[str, list[float]]:
    """Two DecentralizedAveragers; all-reduce time from the trigger, after the group formed."""
    return _run_pair(_hivemind_worker, (numel, reps), ranks=1, timeout_s=60.0 + 30.0 * reps)


def _run_pair(
    target: Callable[..., None], args: tuple[Any, ...], ranks: int = 2, timeout_s: float = TIMEOUT_S
) -> Any:
    """Run ``target(rank, *args, log, results)`` in ``ranks`` processes; return what rank 0 puts."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.NamedTemporaryFile(prefix="gossipd-bench-", suffix=".log") as log:
        procs = [
            ctx.Process(target=target, args=(rank, *args, log.name, results))
            for rank in range(ranks)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                with contextlib.suppress(queue.Empty):
                    return results.get(timeout=0.5)
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    why = f"exit code {failed[0]}" if failed else f"no result in {timeout_s:.0f} s"
                    tail = Path(log.name).read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"{target.__name__}: {why}; its log ends:\n{tail}")
        finally:
            for p in procs:
                _reap(p, group=target is _hivemind_worker)


def _reap(proc: mp.process.BaseProcess, group: bool = False, timeout_s: float = 10.0) -> None:
    proc.join(timeout_s)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if group and proc.pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)  # hivemind's DHT and averager children
        if proc.is_alive():
            os.kill(proc.pid, sig)  # type: ignore[arg-type]
            proc.join(timeout_s)
