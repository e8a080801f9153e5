"""The fixed cost of one push: CPU-milliseconds per push on each side, and its latency.

A real receiver daemon takes ``pushes`` small pushes one after another from a real
sender node in this process, exactly as `bench transport` pushes a large model.
The payload is small (a few KiB by default) so what is measured is what every
push pays whatever its size: the call or stream set-up, frames, validation, the
inbox hand-off to the receiver's trainer, the merge, the acknowledgement. On a
machine where every core also trains, each CPU-millisecond here is taken from a
trainer, so this row is what bounds how often a site can mix.

CPU time is read from the kernel: this process's for the sender (it does nothing
else meanwhile) and ``/proc/PID/stat`` for the receiver daemon.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

from gossipd.bench import transport as tb
from gossipd.node.compression.codecs import Codec
from gossipd.node.errors import GossipdError
from gossipd.node.model.segments import FlatModel
from gossipd.node.net.dial.client import PeerClient
from gossipd.node.protocols.base import Push
from gossipd.node.trainer.messages import OutboundPush

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` (fields 14 and 15 of its stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S


async def _pushes(
    address: str, flat: FlatModel, pushes: int, tls: dict[str, Any], receiver_pid: int
) -> dict[str, float]:
    sender = await tb._sender_node(flat, tb.Setting(1, 1024, 1), tls)
    assert sender.identity is not None
    client = PeerClient(
        address, sender.identity, codec=Codec.RAW, tls=sender.tls, expected="receiver", streams=1
    )
    snapshot = flat.snapshot()
    weights = dict.fromkeys(range(len(flat.plan)), 0.0)
    latencies: list[float] = []
    try:
        if not await sender.peering.verify(address):
            raise GossipdError(f"the receiver at {address} did not answer a handshake")
        await tb._accepted_by(address, sender)
        warmup = max(10, pushes // 10)
        for sequence in range(1, warmup + pushes + 1):
            if sequence == warmup + 1:
                cpu0, rcpu0, wall0 = time.process_time(), _cpu_s(receiver_pid), time.perf_counter()
            out = OutboundPush(Push("receiver", sequence, weights), snapshot)
            t0 = time.perf_counter()
            acks = await client.push(out, tb.TIMEOUT_S)
            latencies.append(time.perf_counter() - t0)
            if len(acks) != len(weights):
                raise GossipdError(f"push {sequence} was not acknowledged whole: {acks}")
        wall = time.perf_counter() - wall0
        sender_cpu = time.process_time() - cpu0
        receiver_cpu = _cpu_s(receiver_pid) - rcpu0
    finally:
        await client.close()
        await sender.close(grace_s=0.1)
    timed = latencies[-pushes:]
    return {
        "sender_cpu_ms": sender_cpu / pushes * 1e3,
        "receiver_cpu_ms": receiver_cpu / pushes * 1e3,
        "latency_ms_median": statistics.median(timed) * 1e3,
        "latency_ms_p90": statistics.quantiles(timed, n=10)[-1] * 1e3,
        "pushes_per_s": pushes / wall,
    }


def bench_push_cost(pushes: int = 1000, numel: int = 1024, secure: bool = True) -> dict[str, Any]:
    """Per-push CPU and latency between a sender node and a receiver daemon."""
    model = tb.bench_job(tb._job_spec(numel, numel, seed=2)).model
    flat = FlatModel(model, tb.MiB)
    setting = tb.Setting(1, 1024, 1)
    with tempfile.TemporaryDirectory(prefix="gossipd-bench-") as tmp:
        workdir = Path(tmp)
        config = tb._receiver_config(workdir, numel, numel, setting, secure)
        tls = tb._site_tls(workdir, secure, "sender")
        with tb._daemon(config, workdir / "receiver") as address:
            pid = tb.daemon_pid(workdir / "receiver")
            result = asyncio.run(_pushes(address, flat, pushes, tls, pid))
    result.update(pushes=pushes, payload_bytes=numel * 4, mtls=secure)
    return result


def print_cost(rows: list[dict[str, Any]], file: TextIO) -> None:
    """The per-push table: CPU on each side and latency, one row per payload and TLS mode."""
    head = (
        f"{'per-push fixed cost':<26} {'sender CPU-ms':>13} {'receiver CPU-ms':>15} "
        f"{'latency ms (median, p90)':>25} {'pushes/s':>9}"
    )
    print(head, file=file)
    print("-" * len(head), file=file)
    for r in rows:
        label = f"{r['payload_bytes'] // 1024} KiB, {'mTLS' if r['mtls'] else 'plaintext'}"
        print(
            f"{label:<26} {r['sender_cpu_ms']:>13.2f} {r['receiver_cpu_ms']:>15.2f} "
            f"{r['latency_ms_median']:>16.2f}, {r['latency_ms_p90']:>6.2f} "
            f"{r['pushes_per_s']:>9.0f}",
            file=file,
        )
