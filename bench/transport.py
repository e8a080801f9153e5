"""`gossipd bench transport`: goodput of one model push between two daemons on loopback.

A receiver daemon (`gossipd node`, a real process) is sent the whole model by a
:class:`~gossipd.node.net.dial.client.PeerClient` of a real sender node in this process
(the receiver accepts pushes only from a peer it has dialled back), exactly as a
node pushes to a peer: handshake, segments split over ``streams`` client streams,
validation, checksum, assembly, merge on the receiver's trainer thread, acks.
Goodput is model bytes over the wall time of ``push()`` (the ack included). The
same run times a raw TCP socket (first, and again last: every ratio is to its best
time of both) and torch.distributed gloo send/recv between two processes, and
hivemind's DecentralizedAverager where it is installed, and prints each as a ratio
of raw TCP; ``--json`` puts one JSON object on the last line. Plaintext and mutual
TLS pushes alternate within each repetition, each to a receiver of its own.

The model is a stack of equal float32 tensors (``--tensor-mb``), so
``segment_bytes`` cuts it into segments the way it cuts a real network. The
receiver stops stepping after one step, so its trainer merges each push at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gossipd.bench.transport_report import row
from gossipd.node.compression.codecs import Codec
from gossipd.node.jobs.registry import JobSpec
from gossipd.node.launch.forked import fork_node
from gossipd.node.launch.processes import stop_process
from gossipd.node.model.segments import FlatModel
from gossipd.node.net.dial.client import PeerClient
from gossipd.node.net.network import Network
from gossipd.node.net.status.query import query_status
from gossipd.node.net.wire.frames import Limits
from gossipd.node.protocols.base import Push
from gossipd.node.shared import certs
from gossipd.node.shared.config import parse_config
from gossipd.node.trainer.memory import keep_freed_buffers
from gossipd.node.trainer.messages import OutboundPush
from gossipd.node.trainer.replica import Replica

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


def daemon_pid(data_dir: Path) -> int:
    """The process id a daemon wrote into its ``node.json``."""
    return int(json.loads((data_dir / "node.json").read_text())["pid"])


@contextlib.contextmanager
def _daemon(config: Path, data_dir: Path, timeout_s: float = 60.0) -> Iterator[str]:
    """A `gossipd node` process (forked, as the launcher's nodes are: its start-up is not
    what is measured); yields its address once it serves, and always stops it."""
    log = data_dir.parent / "receiver.log"
    proc = fork_node(config, log)
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


async def _accepted_by(address: str, sender: Network) -> None:
    """Until the receiver has dialled ``sender`` back and counts this incarnation of it as
    a live peer. Each setting starts a new sender under the same node id, and the one
    before it can still be listed live: its id alone said "accepted" a moment too early,
    and the first push was refused (the new incarnation not yet verified)."""
    assert sender.identity is not None
    me = sender.identity
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        status = await query_status(address, TIMEOUT_S, tls=sender.tls)
        known = {p["node_id"]: p["incarnation"] for p in status["peers"]}
        if me.node_id in status["live_peers"] and known.get(me.node_id) == me.incarnation:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the receiver at {address} never accepted {me.node_id!r}")
        await asyncio.sleep(0.05)


async def _push_and_pull(
    targets: list[tuple[str, dict[str, Any]]],
    flat: FlatModel,
    setting: Setting,
    reps: int,
    pull: bool,
    bulk: bool = True,
) -> list[dict[str, list[float]]]:
    """Push (and pull) the model to every receiver in ``targets`` (address, sender's
    [tls]), one after the other within each repetition, so that what the machine does
    meanwhile falls on all of them alike: one timing list per target."""
    snapshot = flat.snapshot()
    weights = dict.fromkeys(range(len(flat.plan)), 0.0)
    times: list[dict[str, list[float]]] = [{"push": [], "pull": []} for _ in targets]
    async with contextlib.AsyncExitStack() as stack:
        clients = []
        for address, tls in targets:
            sender = await _sender_node(flat, setting, tls)
            stack.push_async_callback(sender.close, grace_s=0.1)
            assert sender.identity is not None
            client = PeerClient(
                address,
                sender.identity,
                codec=Codec.RAW,
                chunk_bytes=setting.chunk_kb * 1024,
                streams=setting.streams,
                tls=sender.tls,
                expected="receiver",
                bulk=bulk,
            )
            stack.push_async_callback(client.close)
            if not await sender.peering.verify(address):
                raise RuntimeError(f"the receiver at {address} did not answer a handshake")
            await _accepted_by(address, sender)
            clients.append(client)
        for sequence in range(reps + 1):  # the first push warms each connection up
            for client, timed in zip(clients, times, strict=True):
                out = OutboundPush(Push("receiver", sequence + 1, weights), snapshot)
                t0 = time.perf_counter()
                acks = await client.push(out, TIMEOUT_S)
                elapsed = time.perf_counter() - t0
                if sorted(a.segment for a in acks if not a.duplicate) != sorted(weights):
                    raise RuntimeError(f"push {sequence + 1} was not merged whole: {acks}")
                if sequence:
                    timed["push"].append(elapsed)
        for rep in range(reps + 1 if pull else 0):
            for client, timed in zip(clients, times, strict=True):
                t0 = time.perf_counter()
                model = await client.pull(flat.plan, Limits(), TIMEOUT_S)
                elapsed = time.perf_counter() - t0
                if len(model.values) != len(flat.plan):
                    raise RuntimeError("pull returned a partial model")
                del model
                if rep:
                    timed["pull"].append(elapsed)
    return times


def bench_gossipd(
    numel: int,
    tensor_numel: int,
    settings: list[Setting],
    reps: int,
    pull: bool,
    tls_modes: tuple[bool, ...] = (False, True),
) -> list[dict[str, Any]]:
    """Per segment size one receiver daemon per TLS mode; every setting pushes to each.

    Plaintext and mutual TLS are timed in turn within each repetition (a plaintext
    push, then an mTLS one, then the next pair), so their ratio compares pushes a
    fraction of a second apart rather than minutes: on a shared machine the load
    changes within a run (TLS: the push rows say "mTLS"). Each setting pushes (and
    pulls) twice: on the receiver's bulk lane, then with the lane off in the sender,
    in gRPC chunk frames (those rows say "frames"). Rows come per mode, plaintext
    first.
    """
    keep_freed_buffers()  # this process hosts the sending node: its heap is tuned as a node's
    rows: dict[bool, list[dict[str, Any]]] = {secure: [] for secure in tls_modes}
    for segment_mb in sorted({s.segment_mb for s in settings}):
        group = [s for s in settings if s.segment_mb == segment_mb]
        model = bench_job(_job_spec(numel, tensor_numel, seed=2)).model
        flat = FlatModel(model, segment_mb * MiB)
        with (
            tempfile.TemporaryDirectory(prefix="gossipd-bench-") as tmp,
            contextlib.ExitStack() as daemons,
        ):
            targets = []
            for secure in tls_modes:
                workdir = Path(tmp) / ("mtls" if secure else "plaintext")
                workdir.mkdir()
                config = _receiver_config(workdir, numel, tensor_numel, group[0], secure)
                address = daemons.enter_context(_daemon(config, workdir / "receiver"))
                targets.append((address, _site_tls(workdir, secure, "sender")))
            for (i, setting), bulk in itertools.product(enumerate(group), (True, False)):
                do_pull = pull and i == 0
                timed = asyncio.run(_push_and_pull(targets, flat, setting, reps, do_pull, bulk))
                for secure, times in zip(tls_modes, timed, strict=True):
                    notes = [n for n, on in (("mTLS", secure), ("frames", not bulk)) if on]
                    suffix = f" ({', '.join(notes)})" if notes else ""
                    label = f"{setting.label} ({len(flat.plan)} segments)"
                    rows[secure].append(row("gossipd push" + suffix, label, times["push"]))
                    if do_pull:
                        label = f"segment {segment_mb} MiB, chunk {setting.chunk_kb} KiB, 1 stream"
                        rows[secure].append(row("gossipd pull" + suffix, label, times["pull"]))
    return [r for secure in tls_modes for r in rows[secure]]


# ---------------------------------------------------------------------------
# Command line: `gossipd bench transport` runs this module's main, which lives with the
# other modes' flags in transport_cli (imported when called: it imports this module).


def build_parser() -> argparse.ArgumentParser:
    """The parser of `gossipd bench transport` (see :mod:`gossipd.bench.transport_cli`)."""
    from gossipd.bench.transport_cli import build_parser

    return build_parser()


def main(argv: list[str] | None = None) -> int:
    """`gossipd bench transport [flags]` (see :mod:`gossipd.bench.transport_cli`)."""
    from gossipd.bench.transport_cli import main

    return main(argv)


if __name__ == "__main__":
    sys.exit(main())
