"""`gossipd bench transport`: goodput of one model push between two daemons on loopback.

A receiver daemon (`gossipd node`, a real process) is sent the whole model by a
:class:`~gossipd.node.transport.PeerClient` of a real sender node in this process
(the receiver accepts pushes only from a peer it has dialled back), exactly as a
node pushes to a peer: handshake, segments split over ``streams`` client streams,
validation, checksum, assembly, merge on the receiver's trainer thread, acks.
Goodput is model bytes over the wall time of ``push()`` (the ack included). The
same run times a raw TCP socket and torch.distributed gloo send/recv between two
processes, and hivemind's DecentralizedAverager where it is installed, and prints
each as a ratio of raw TCP; ``--json`` puts one JSON object on the last line.

The model is a stack of equal float32 tensors (``--tensor-mb``), so
``segment_bytes`` cuts it into segments the way it cuts a real network. The
receiver stops stepping after one step, so its trainer merges each push at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gossipd.bench.baselines import bench_gloo, bench_grpc_bare, bench_hivemind, bench_raw_tcp
from gossipd.node import certs
from gossipd.node.codec import Codec
from gossipd.node.config import parse_config
from gossipd.node.jobs import JobSpec
from gossipd.node.mesh import spawn_node, stop_process
from gossipd.node.messages import OutboundPush
from gossipd.node.network import Network
from gossipd.node.protocols.base import Push
from gossipd.node.replica import Replica
from gossipd.node.segments import FlatModel
from gossipd.node.status import query_status
from gossipd.node.tls import Credentials
from gossipd.node.transport import PeerClient
from gossipd.node.wire import Limits

MiB = 1 << 20
JOB_NAME = "gossipd.bench.transport:bench_job"
MESH = "bench"
TIMEOUT_S = 120.0


# ---------------------------------------------------------------------------
# The benchmark's model: a plugin job both sides build from the same options


class _BenchJob:
    """``numel`` float32 parameters in tensors of ``tensor_numel``; nothing ever trains."""

    def __init__(self, spec: JobSpec) -> None:
        numel = int(spec.options.get("numel", 1 << 20))  # type: ignore[call-overload]
        per = int(spec.options.get("tensor_numel", numel))  # type: ignore[call-overload]
        gen = torch.Generator().manual_seed(spec.seed)
        sizes = [min(per, numel - start) for start in range(0, numel, per)]
        self.model = nn.ParameterList(
            nn.Parameter(torch.empty(n).normal_(0.0, 0.02, generator=gen)) for n in sizes
        )
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.0)

    def train_step(self) -> float:
        return 0.0

    def evaluate(self) -> dict[str, float]:
        return {}


def bench_job(spec: JobSpec) -> _BenchJob:
    """Plugin factory named by the receiver's config (``job.name = JOB_NAME``)."""
    return _BenchJob(spec)


def _job_spec(numel: int, tensor_numel: int, seed: int) -> JobSpec:
    return JobSpec(JOB_NAME, seed=seed, options={"numel": numel, "tensor_numel": tensor_numel})


# ---------------------------------------------------------------------------
# gossipd: a receiver daemon process and a PeerClient here


@dataclass(frozen=True)
class Setting:
    segment_mb: int
    chunk_kb: int
    streams: int

    @property
    def label(self) -> str:
        return f"segment {self.segment_mb} MiB, chunk {self.chunk_kb} KiB, streams {self.streams}"


def _tls(workdir: Path, secure: bool) -> dict[str, Any]:
    """Config [tls] for ``receiver`` and ``sender``: a throwaway CA, or plaintext."""
    if not secure:
        return {"insecure": True}
    if not (workdir / "ca.pem").exists():
        certs.init_ca(workdir, mesh_id=MESH)
        for node_id in ("receiver", "sender"):
            certs.issue(node_id, workdir)
    return {"ca": workdir / "ca.pem"}


def _site_tls(workdir: Path, secure: bool, node_id: str) -> dict[str, Any]:
    tls = _tls(workdir, secure)
    if secure:
        tls.update(cert=workdir / f"{node_id}.pem", key=workdir / f"{node_id}.key")
    return tls


def _receiver_config(
    workdir: Path, numel: int, tensor_numel: int, setting: Setting, secure: bool
) -> Path:
    options = f"{{ numel = {numel}, tensor_numel = {tensor_numel} }}"
    tls = "\n".join(
        f"{k} = {json.dumps(v if isinstance(v, bool) else str(v))}"
        for k, v in _site_tls(workdir, secure, "receiver").items()
    )
    text = f"""\
mesh_id = "{MESH}"
node_id = "receiver"
listen = "127.0.0.1:0"
data_dir = "{workdir / "receiver"}"
shutdown_timeout_s = 5.0

[job]
name = "{JOB_NAME}"
seed = 1
learning_rate = 0.0
max_steps = 1
eval_every_steps = 0
options = {options}

[gossip]
segment_bytes = {setting.segment_mb * MiB}
chunk_bytes = {setting.chunk_kb * 1024}
push_timeout_s = {TIMEOUT_S}

[gossip.sumweight]
push_probability = 0.0

[membership]
anti_entropy_interval_s = 3600.0

[checkpoint]
every_steps = 0

[tls]
{tls}
"""
    path = workdir / "receiver.toml"
    path.write_text(text)
    return path


@contextlib.contextmanager
def _daemon(config: Path, data_dir: Path, timeout_s: float = 60.0) -> Iterator[str]:
    """A `gossipd node` process; yields its address once it serves, and always stops it."""
    log = data_dir.parent / "receiver.log"
    proc = spawn_node(config, log)
    try:
        info = data_dir / "node.json"
        deadline = time.monotonic() + timeout_s
        while not info.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"receiver daemon did not come up:\n{log.read_text()[-2000:]}")
            time.sleep(0.05)
        yield json.loads(info.read_text())["address"]
    finally:
        stop_process(proc, timeout_s=20.0)


async def _sender_node(flat: FlatModel, setting: Setting, tls: dict[str, Any]) -> Network:
    """A real node that answers the receiver's dial-back, so its pushes are accepted."""
    config = parse_config(
        {
            "mesh_id": MESH,
            "node_id": "sender",
            "metrics": {"listen": ""},
            "gossip": {
                "segment_bytes": setting.segment_mb * MiB,
                "sumweight": {"push_probability": 0.0},
            },
            "membership": {"anti_entropy_interval_s": 3600.0},
            "tls": tls,
        },
        "bench sender",
    )
    node = Network(config, Replica.from_config(config, flat.module))
    await node.start()
    return node


async def _accepted_by(address: str, node_id: str, tls: Credentials) -> None:
    """Until the receiver has dialled the sender back and counts it as a live peer."""
    deadline = time.monotonic() + TIMEOUT_S
    while node_id not in (await query_status(address, TIMEOUT_S, tls=tls))["live_peers"]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the receiver at {address} never accepted {node_id!r}")
        await asyncio.sleep(0.05)


async def _push_and_pull(
    address: str,
    flat: FlatModel,
    setting: Setting,
    reps: int,
    pull: bool,
    tls: dict[str, Any],
) -> dict[str, list[float]]:
    sender = await _sender_node(flat, setting, tls)
    assert sender.identity is not None
    client = PeerClient(
        address,
        sender.identity,
        codec=Codec.RAW,
        chunk_bytes=setting.chunk_kb * 1024,
        streams=setting.streams,
        tls=sender.tls,
        expected="receiver",
    )
    snapshot = flat.snapshot()
    weights = dict.fromkeys(range(len(flat.plan)), 0.0)
    times: dict[str, list[float]] = {"push": [], "pull": []}
    try:
        if not await sender.peering.verify(address):
            raise RuntimeError(f"the receiver at {address} did not answer a handshake")
        await _accepted_by(address, "sender", sender.tls)
        for sequence in range(reps + 1):  # the first push warms the connection up
            out = OutboundPush(Push("receiver", sequence + 1, weights), snapshot)
            t0 = time.perf_counter()
            acks = await client.push(out, TIMEOUT_S)
            elapsed = time.perf_counter() - t0
            if sorted(a.segment for a in acks if not a.duplicate) != sorted(weights):
                raise RuntimeError(f"push {sequence + 1} was not merged whole: {acks}")
            if sequence:
                times["push"].append(elapsed)
        for rep in range(reps + 1 if pull else 0):
            t0 = time.perf_counter()
            model = await client.pull(flat.plan, Limits(), TIMEOUT_S)
            elapsed = time.perf_counter() - t0
            if len(model.values) != len(flat.plan):
                raise RuntimeError("pull returned a partial model")
            del model
            if rep:
                times["pull"].append(elapsed)
    finally:
        await client.close()
        await sender.close(grace_s=0.1)
    return times


def bench_gossipd(
    numel: int,
    tensor_numel: int,
    settings: list[Setting],
    reps: int,
    pull: bool,
    tls_modes: tuple[bool, ...] = (False, True),
) -> list[dict[str, Any]]:
    """One receiver daemon per segment size and TLS mode; every setting pushes to it.

    Plaintext and mutual TLS run one after the other in the same run, so their
    ratio is measured side by side (TLS: the push rows say "mTLS").
    """
    rows = []
    for secure in tls_modes:
        suffix = " (mTLS)" if secure else ""
        for segment_mb in sorted({s.segment_mb for s in settings}):
            group = [s for s in settings if s.segment_mb == segment_mb]
            model = bench_job(_job_spec(numel, tensor_numel, seed=2)).model
            flat = FlatModel(model, segment_mb * MiB)
            with tempfile.TemporaryDirectory(prefix="gossipd-bench-") as tmp:
                workdir = Path(tmp)
                config = _receiver_config(workdir, numel, tensor_numel, group[0], secure)
                tls = _site_tls(workdir, secure, "sender")
                with _daemon(config, workdir / "receiver") as address:
                    for i, setting in enumerate(group):
                        do_pull = pull and i == 0
                        times = asyncio.run(
                            _push_and_pull(address, flat, setting, reps, do_pull, tls)
                        )
                        label = f"{setting.label} ({len(flat.plan)} segments)"
                        rows.append(_row("gossipd push" + suffix, label, times["push"]))
                        if do_pull:
                            label = (
                                f"segment {segment_mb} MiB, chunk {setting.chunk_kb} KiB, 1 stream"
                            )
                            rows.append(_row("gossipd pull" + suffix, label, times["pull"]))
    return rows


# ---------------------------------------------------------------------------
# Report


def _row(method: str, settings: str, times: list[float], nbytes: int = 0) -> dict[str, Any]:
    return {"method": method, "settings": settings, "times_s": times, "nbytes": nbytes}


def _finish(rows: list[dict[str, Any]], nbytes: int) -> None:
    raw = next((r for r in rows if r["method"] == "raw TCP"), None)
    raw_best = max(nbytes / t for t in raw["times_s"]) / 1e9 if raw else float("nan")
    for r in rows:
        r["nbytes"] = r["nbytes"] or nbytes
        rates = [r["nbytes"] / t / 1e9 for t in r["times_s"]]
        r["gbps_best"] = max(rates)
        r["gbps_median"] = statistics.median(rates)
        r["ratio_vs_raw_tcp"] = r["gbps_best"] / raw_best


def print_table(rows: list[dict[str, Any]], file: Any = sys.stdout) -> None:
    width = max(len(r["settings"]) for r in rows)
    mw = max(16, *(len(r["method"]) for r in rows))
    head = f"{'method':<{mw}} {'settings':<{width}} {'GB/s best':>9} {'median':>7} {'vs TCP':>6}"
    print(head, file=file)
    print("-" * len(head), file=file)
    for r in rows:
        print(
            f"{r['method']:<{mw}} {r['settings']:<{width}} {r['gbps_best']:>9.2f} "
            f"{r['gbps_median']:>7.2f} {r['ratio_vs_raw_tcp']:>6.2f}",
            file=file,
        )


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['method']}\n{r['settings']}" for r in rows]
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(rows) + 1.5))
    y = range(len(rows))
    ax.barh(y, [r["gbps_best"] for r in rows], color="tab:blue", label="best")
    ax.barh(y, [r["gbps_median"] for r in rows], color="tab:orange", height=0.4, label="median")
    raw = [r["gbps_best"] for r in rows if r["method"] == "raw TCP"]
    if raw:
        ax.axvline(raw[0] / 2, color="gray", linestyle="--", label="half of raw TCP")
    ax.set_yticks(list(y), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("goodput, GB/s (model bytes / wall time)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------
# Command line

DEFAULT_SETTINGS = ("4:1024:1", "4:1024:4", "16:1024:4", "16:4096:4", "64:4096:4")
QUICK_SETTINGS = ("16:1024:1", "16:1024:4")


# What `--help` says: the module docstring in plain words, without its markup.
DESCRIPTION = (
    "Goodput of one model push between two gossipd daemons on loopback. A real receiver "
    "daemon is sent the whole model by a real sender node, exactly as nodes push to each "
    "other: handshake, segments split over client streams, validation, checksum, assembly, "
    "merge on the receiver's trainer thread, acks. Goodput is model bytes over the wall time "
    "of the push, the ack included. The same run times a raw TCP socket and torch.distributed "
    "gloo send/recv between two processes, and hivemind's DecentralizedAverager where it is "
    "installed, and prints each as a ratio of raw TCP. The model is a stack of equal float32 "
    "tensors (--tensor-mb)."
)


def _setting(text: str) -> Setting:
    try:
        segment_mb, chunk_kb, streams = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--setting {text!r} is not SEGMENT_MB:CHUNK_KB:STREAMS (for example 16:1024:4)"
        ) from None
    if min(segment_mb, chunk_kb, streams) < 1 or chunk_kb > 4096:
        raise argparse.ArgumentTypeError(
            f"--setting {text!r}: all parts must be positive and chunks at most 4096 KiB "
            "(the receiver's limits.max_chunk_bytes)"
        )
    return Setting(segment_mb, chunk_kb, streams)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gossipd bench transport", description=DESCRIPTION)
    p.add_argument(
        "--size-mb", type=int, default=256, help="model size in MiB (default: %(default)s)"
    )
    p.add_argument(
        "--tensor-mb", type=int, default=4, help="MiB per model tensor (default: %(default)s)"
    )
    p.add_argument(
        "--reps", type=int, default=None, help="timed repetitions (default: 5, with --quick 2)"
    )
    p.add_argument(
        "--setting",
        type=_setting,
        action="append",
        help="gossipd push setting SEGMENT_MB:CHUNK_KB:STREAMS, repeatable "
        f"(default: {' '.join(DEFAULT_SETTINGS)})",
    )
    p.add_argument(
        "--quick", action="store_true", help="two gossipd settings, 2 reps (default: all, 5 reps)"
    )
    p.add_argument("--no-pull", action="store_true", help="do not time PullModel")
    p.add_argument("--skip-gloo", action="store_true", help="do not time torch.distributed gloo")
    p.add_argument(
        "--skip-hivemind", action="store_true", help="do not time hivemind, even if installed"
    )
    p.add_argument(
        "--hivemind-floats", type=int, default=None, help="floats averaged (default: the model's)"
    )
    p.add_argument(
        "--plot",
        default="bench-transport.png",
        help="PNG path, '' for none (default: %(default)s)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="one JSON object as the last stdout line, the table on stderr",
    )
    return p


def _optional(
    rows: list[dict[str, Any]], notes: list[str], name: str, run: Callable[[], Any]
) -> None:
    """Run an optional baseline; a failure becomes a note instead of ending the benchmark."""
    try:
        rows.append(run())
    except Exception as err:
        notes.append(f"{name}: failed, left out: {err}")


def _hivemind_row(numel: int, reps: int) -> dict[str, Any]:
    result = bench_hivemind(numel, reps)
    mm = statistics.median(result["matchmaking"])
    label = f"2-peer all-reduce of {numel / 1e6:.1f}M floats, after {mm:.2f} s matchmaking"
    return _row("hivemind", label, result["allreduce"], numel * 4)


def main(argv: list[str] | None = None) -> int:
    if argv and argv[0] == "--":  # `gossipd bench transport -- --json ...`
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)
    reps = max(1, args.reps or (2 if args.quick else 5))
    settings = args.setting or [
        _setting(t) for t in (QUICK_SETTINGS if args.quick else DEFAULT_SETTINGS)
    ]
    numel = args.size_mb * MiB // 4
    nbytes = numel * 4
    tensor_numel = min(numel, max(1, args.tensor_mb * MiB // 4))
    out = sys.stderr if args.json else sys.stdout
    notes: list[str] = []

    payload = torch.ones(numel)
    rows = [_row("raw TCP", "1 MiB sendall, 1-byte ack", bench_raw_tcp(_bytes_of(payload), reps))]
    del payload
    if not args.skip_gloo:
        _optional(
            rows,
            notes,
            "gloo",
            lambda: _row("gloo", "send/recv, 1-float ack", bench_gloo(numel, reps)),
        )
    _optional(
        rows,
        notes,
        "grpc.aio",
        lambda: _row(
            "grpc.aio bare",
            "1 MiB messages, 4 channels, no-op servicer",
            bench_grpc_bare(nbytes, reps),
        ),
    )
    rows += bench_gossipd(numel, tensor_numel, settings, reps, pull=not args.no_pull)
    if args.skip_hivemind:
        notes.append("hivemind: skipped (--skip-hivemind)")
    elif importlib.util.find_spec("hivemind") is None:
        notes.append("hivemind: not installed (pip install 'gossipd[bench]'), skipped")
    else:
        hm_numel = args.hivemind_floats or numel
        _optional(rows, notes, "hivemind", lambda: _hivemind_row(hm_numel, reps))
    _finish(rows, nbytes)

    title = f"gossipd bench transport: {args.size_mb} MiB model, loopback, {os.cpu_count()} CPUs"
    print(title, file=out)
    print_table(rows, file=out)
    best = max((r for r in rows if r["method"] == "gossipd push"), key=lambda r: r["gbps_best"])
    print(
        f"best gossipd push: {best['ratio_vs_raw_tcp']:.2f} x raw TCP ({best['settings']})",
        file=out,
    )
    for row in rows:
        if row["method"] == "gossipd push (mTLS)":
            plain = next(
                r
                for r in rows
                if r["method"] == "gossipd push" and r["settings"] == row["settings"]
            )
            print(
                f"mTLS push: {row['gbps_best'] / plain['gbps_best']:.2f} x plaintext push "
                f"({row['settings']})",
                file=out,
            )
    for note in notes:
        print(note, file=out)
    if args.plot:
        plot(rows, Path(args.plot), title)
        print(f"plot: {args.plot}", file=out)
    if args.json:
        print(json.dumps(_summary(rows, best, nbytes, tensor_numel * 4, reps, notes)))
    return 0


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.numpy()).cast("B")


def _summary(
    rows: list[dict[str, Any]],
    best: dict[str, Any],
    nbytes: int,
    tensor_bytes: int,
    reps: int,
    notes: list[str],
) -> dict[str, Any]:
    by_method: dict[str, float] = {}
    for r in rows:
        by_method[r["method"]] = max(by_method.get(r["method"], 0.0), r["gbps_best"])
    bare = by_method.get("grpc.aio bare")
    return {
        "ratio_vs_raw_tcp": best["ratio_vs_raw_tcp"],
        "ratio_vs_grpc_aio_bare": best["gbps_best"] / bare if bare else None,
        "best_push_settings": best["settings"],
        "gbps": {m.replace(" ", "_"): v for m, v in by_method.items()},
        "model_bytes": nbytes,
        "tensor_bytes": tensor_bytes,
        "reps": reps,
        "rows": rows,
        "notes": notes,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "grpcio": importlib.metadata.version("grpcio"),
        },
    }


if __name__ == "__main__":
    sys.exit(main())
