"""`python -m gossipd.bench.shaping`: does the ``[link]`` knob shape a push as asked?

A receiver daemon (a real ``gossipd node`` process with mutual TLS, as in
``gossipd bench transport``) is pushed a model of known size S by a sender node in this process
whose config has a ``[link]`` table; the sender's own client is used, so the push
goes through the same shaper a daemon's pushes do. With latency L and rate R a
push should take about L + S/R plus what it takes unshaped. Each setting's
median is printed next to that expectation; nothing is asserted (the tests do
that, with lower bounds only).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gossipd.bench.transport import (
    MESH,
    TIMEOUT_S,
    Setting,
    _accepted_by,
    _daemon,
    _job_spec,
    _receiver_config,
    _site_tls,
    bench_job,
)
from gossipd.node.model.segments import FlatModel
from gossipd.node.net.network import Network
from gossipd.node.protocols.base import Push
from gossipd.node.shared.config import parse_config
from gossipd.node.trainer.messages import OutboundPush
from gossipd.node.trainer.replica import Replica

MiB = 1 << 20
SETTING = Setting(segment_mb=4, chunk_kb=1024, streams=4)


async def _timed_pushes(
    address: str, flat: FlatModel, link: dict[str, float], reps: int, tls: dict[str, Any]
) -> list[float]:
    """``reps`` pushes of the whole model (weight 0: the receiver's mass is unchanged)
    by a fresh sender node shaped by ``link``, after one unshaped-size warm-up push."""
    config = parse_config(
        {
            "mesh_id": MESH,
            "node_id": "sender",
            "metrics": {"listen": ""},
            "gossip": {"segment_bytes": SETTING.segment_mb * MiB, "push_timeout_s": TIMEOUT_S},
            "membership": {"anti_entropy_interval_s": 3600.0},
            "link": link,
            "tls": tls,
        },
        "bench sender",
    )
    sender = Network(config, Replica.from_config(config, flat.module))
    await sender.start()
    times: list[float] = []
    try:
        if not await sender.peering.verify(address):
            raise RuntimeError(f"the receiver at {address} did not answer a handshake")
        await _accepted_by(address, sender)
        client = sender.client(address, "receiver")
        snapshot = flat.snapshot()
        weights = dict.fromkeys(range(len(flat.plan)), 0.0)
        for sequence in range(reps + 1):
            out = OutboundPush(Push("receiver", sequence + 1, weights), snapshot)
            started = time.perf_counter()
            acks = await client.push(out, TIMEOUT_S, config.gossip.progress_timeout_s)
            elapsed = time.perf_counter() - started
            if sorted(a.segment for a in acks) != sorted(weights):
                raise RuntimeError(f"push {sequence + 1} was not acknowledged whole: {acks}")
            if sequence:  # the first one warms the connection up
                times.append(elapsed)
    finally:
        await sender.close(grace_s=0.1)
    return times


def run(size_mb: float, latency_ms: float, rate_mbit: float, reps: int) -> list[dict[str, Any]]:
    """Off, latency only, rate only, both: one row each, pushed to one receiver daemon."""
    numel = int(size_mb * MiB) // 4
    model = bench_job(_job_spec(numel, numel, seed=2)).model
    flat = FlatModel(model, SETTING.segment_mb * MiB)
    nbytes = numel * 4
    links = [
        ("off", {}),
        (f"latency {latency_ms:g} ms", {"latency_ms": latency_ms}),
        (f"rate {rate_mbit:g} Mbit/s", {"rate_mbit": rate_mbit}),
        ("both", {"latency_ms": latency_ms, "rate_mbit": rate_mbit}),
    ]
    rows = []
    with tempfile.TemporaryDirectory(prefix="gossipd-bench-shaping-") as tmp:
        workdir = Path(tmp)
        config = _receiver_config(workdir, numel, numel, SETTING, secure=True)
        tls = _site_tls(workdir, True, "sender")
        with _daemon(config, workdir / "receiver") as address:
            for label, link in links:
                times = asyncio.run(_timed_pushes(address, flat, link, reps, tls))
                rate_bytes_s = link.get("rate_mbit", 0.0) * 1e6 / 8
                shaped_s = link.get("latency_ms", 0.0) / 1000
                shaped_s += nbytes / rate_bytes_s if rate_bytes_s else 0.0
                rows.append(
                    {
                        "link": label,
                        "bytes": nbytes,
                        "shaping_s": shaped_s,  # L + S/R: what the knob should add
                        "median_s": statistics.median(times),
                        "times_s": times,
                    }
                )
    off_s = rows[0]["median_s"]
    for row in rows:
        row["expected_s"] = off_s + row["shaping_s"]
    return rows


def print_table(rows: list[dict[str, Any]], file: Any = sys.stdout) -> None:
    print(f"{'link':<22} {'L + S/R s':>10} {'expected s':>11} {'median s':>9}", file=file)
    for r in rows:
        print(
            f"{r['link']:<22} {r['shaping_s']:>10.3f} {r['expected_s']:>11.3f} "
            f"{r['median_s']:>9.3f}",
            file=file,
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gossipd.bench.shaping",
        description="Push a model of known size through a [link]-shaped sender: off, "
        "latency only, rate only, both; print each median next to unshaped + L + S/R.",
    )
    parser.add_argument(
        "--size-mb", type=float, default=16.0, help="model size S in MiB (default: 16)"
    )
    parser.add_argument(
        "--latency-ms",
        type=float,
        default=100.0,
        help="the sender's [link] latency_ms, L (default: 100)",
    )
    parser.add_argument(
        "--rate-mbit",
        type=float,
        default=80.0,
        help="the sender's [link] rate_mbit, R (default: 80)",
    )
    parser.add_argument("--reps", type=int, default=3, help="timed pushes per row (default: 3)")
    parser.add_argument(
        "--json", action="store_true", help="the table to stderr, one JSON line to stdout"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rows = run(args.size_mb, args.latency_ms, args.rate_mbit, args.reps)
    print_table(rows, file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
