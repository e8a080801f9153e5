"""`gossipd bench transport --trainer`: how many training steps gossip costs a site.

On a machine whose cores all train, every CPU-second the daemon spends on pushes
(serialising, TLS, grpc, checksums, merges, snapshots) is taken from a trainer.
This mode measures that where it matters, in steps: two real `gossipd node`
processes on loopback (mutual TLS, as `gossipd mesh up` runs them) train the
same job for the same wall time twice, first with sumweight's push probability 0
(no pushes) and then 0.5 (a push to the peer every other step, as fast as they
settle). The ratio of steps done, summed over the nodes, is the share of
training that gossip left. Two jobs show both ends: ``digits`` (the built-in
MLP, well under a millisecond a step, so gossip's fixed per-push costs dominate)
and ``wide_digits`` (a 4.35M-parameter MLP of 17 MB with 256-sample batches, a
step of about a tenth of a second, against which the per-byte costs count).

The mesh is :class:`~gossipd.node.launch.localmesh.LocalMesh`, the one `gossipd mesh up`
drives, without the launcher's progress sampling: that pulls every node's model
every two seconds, which would itself take CPU from the trainers measured here.
Periodic evaluations and checkpoints are off for the same reason. Pushes and
bytes are read from each node's Prometheus endpoint once training ended and
before the nodes stop, so the weight a leaving node hands off is not counted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, TextIO

from prometheus_client.parser import text_string_to_metric_families
from torch import nn

from gossipd.node.errors import GossipdError, JobError
from gossipd.node.jobs.models import init_seeded as _init_seeded
from gossipd.node.jobs.registry import DigitsJob, JobSpec, build_job
from gossipd.node.launch.localmesh import STARTUP_TIMEOUT_S, LocalMesh, MeshSpec

WIDE_JOB = "gossipd.bench.trainer_overhead:wide_digits"
JOBS = {"digits": "digits", "wide_digits": WIDE_JOB}  # short names --trainer-jobs takes
DEFAULT_JOBS = ("digits", "wide_digits")
WIDE_HIDDEN = 2048
WIDE_BATCH = 256
NODES = 2
PUSH_PROBABILITIES = (0.0, 0.5)  # off, then on
POLL_S = 0.5  # how often the end of training is looked for (a file read, no RPC)
MB = 1e6


def _wide_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(64, WIDE_HIDDEN),
        nn.ReLU(),
        nn.Linear(WIDE_HIDDEN, WIDE_HIDDEN),
        nn.ReLU(),
        nn.Linear(WIDE_HIDDEN, 10),
    )


def wide_digits(spec: JobSpec) -> DigitsJob:
    """The digits job with a 64→2048→2048→10 MLP and 256-sample batches (plugin factory).

    A step as long as a real model's on this class of machine, with the digits
    job's data, shards, seeding and evaluation unchanged: only the model and the
    default batch differ, so it stays a digits job to the rest of gossipd.
    """
    if "model" in spec.options:
        raise JobError(
            f"job {WIDE_JOB!r} has its own model; drop the option model="
            f"{spec.options['model']!r} (or use job 'digits' for its mlp and cnn)"
        )
    spec = dataclasses.replace(spec, batch_size=spec.batch_size or WIDE_BATCH)
    job = DigitsJob(spec)
    job.model = _init_seeded(_wide_mlp, spec.seed)
    job._start_training(spec, len(job.sample_ids), momentum=0.9)
    return job


def job_name(short: str) -> str:
    """A --trainer-jobs entry as a job name: a short name above, or any job gossipd runs."""
    return JOBS.get(short, short)


def parameter_count(name: str) -> int:
    """Parameters of job ``name``; building it here first also says at once if it is wrong."""
    return sum(p.numel() for p in build_job(JobSpec(name)).model.parameters())


# ---------------------------------------------------------------------------
# One run: two nodes, one push probability


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _scrape(port: int) -> dict[str, float]:
    """Pushes acknowledged and payload bytes sent, from a node's Prometheus endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    pushes = sent = 0.0
    buckets: list[tuple[float, float]] = []  # (upper bound, pushes settled within it)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "gossipd_push_seconds_bucket":
                buckets.append((float(labels["le"]), sample.value))
            elif sample.name == "gossipd_gossip_bytes_total" and labels.get("direction") == "sent":
                sent += sample.value
            elif sample.name == "gossipd_gossip_messages_total" and labels == {
                "direction": "sent",
                "kind": "push",
                "result": "ok",
            }:
                pushes += sample.value
    return {"pushes": pushes, "bytes_sent": sent, "push_s_median": _median(sorted(buckets))}


def _median(buckets: list[tuple[float, float]]) -> float | None:
    """The median of a Prometheus histogram, interpolated within its bucket (as
    ``histogram_quantile`` does); None without observations."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= total / 2:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * (total / 2 - below) / max(count - below, 1e-12)
        lower, below = upper, count
    return lower


async def _train(mesh: LocalMesh) -> dict[str, Any]:
    """Start every node, wait until each trained its duration and settled, read its counters."""
    spec = mesh.spec
    for i in range(spec.nodes):
        mesh.start(i)
    await mesh.wait_ready()
    deadline = time.monotonic() + spec.duration_s + STARTUP_TIMEOUT_S
    while not all(
        _read_json(mesh.node_dir(i) / "summary.json").get("training_done")
        for i in range(spec.nodes)
    ):
        mesh.check_alive()
        if time.monotonic() > deadline:
            raise GossipdError(
                f"the nodes did not finish {spec.duration_s:.0f} s of training in time; "
                f"see the node logs under {mesh.root}"
            )
        await asyncio.sleep(POLL_S)
    states = await mesh.wait_settled()
    counters = [
        _scrape(int(_read_json(mesh.node_dir(i) / "node.json")["metrics_port"]))
        for i in range(spec.nodes)
    ]
    summaries = [_read_json(mesh.node_dir(i) / "summary.json") for i in range(spec.nodes)]
    run: dict[str, Any] = {
        "push_probability": spec.push_probability,
        "steps": [s["step"] for s in states],
        "pushes": [int(c["pushes"]) for c in counters],
        "bytes_sent": [int(c["bytes_sent"]) for c in counters],
        "push_s_median": [c["push_s_median"] for c in counters],
        "mean_weights": [sum(s["sum_weights"]) / len(s["sum_weights"]) for s in states],
    }
    # Over all of each node's training time (the window's last value, gossip_cpu_share,
    # is one 2 s sample and swung with whichever push had just landed).
    shares = [s.get("gossip_cpu_share_mean") for s in summaries]
    if all(isinstance(share, float | int) for share in shares):
        run["gossip_cpu_share"] = shares
    return run


def run_once(
    job: str,
    push_probability: float,
    duration_s: float,
    cpu_share: float | None = None,
    pin_cores: bool = True,
) -> dict[str, Any]:
    """Two nodes train ``job`` for ``duration_s`` at this push probability; what they did.

    ``cpu_share``: their ``gossip.cpu_share`` (None: the default); ``pin_cores``: each
    node on a core of its own (see :data:`MeshSpec.pin_cores`)."""
    spec = MeshSpec(
        nodes=NODES,
        job=job,
        duration_s=duration_s,
        push_probability=push_probability,
        cpu_share=cpu_share,
        pin_cores=pin_cores,
        quiet=True,
        eval_every_steps=0,
        checkpoint_every_steps=0,
    )
    load_avg = os.getloadavg()[0]
    t0 = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="gossipd-bench-trainer-") as tmp,
        LocalMesh(spec, Path(tmp)) as mesh,
    ):
        run = asyncio.run(_train(mesh))
        codes = {f"node-{i}": mesh.stop(i) for i in sorted(mesh.procs)}
        failed = {node: code for node, code in codes.items() if code != 0}
        if failed:
            tails = "\n".join(
                f"{node}: {(mesh.root / node / 'node.log').read_text()[-1500:]}" for node in failed
            )
            raise GossipdError(f"nodes exited with {failed} after training:\n{tails}")
    run.update(load_avg_1m=load_avg, wall_s=time.monotonic() - t0)
    return run


# ---------------------------------------------------------------------------
# The mode: every job off then on, a row each


def bench_trainer_overhead(
    jobs: list[str],
    duration_s: float,
    progress: TextIO,
    cpu_share: float | None = None,
    pin_cores: bool = True,
) -> list[dict[str, Any]]:
    """For each job, a run without pushes and one with, one after the other; a row per job.

    Every job is built here first, so a wrong name fails before minutes of runs.
    """
    params_of = {short: parameter_count(job_name(short)) for short in jobs}
    rows = []
    for short, params in params_of.items():
        name = job_name(short)
        runs = []
        for p in PUSH_PROBABILITIES:
            print(
                f"trainer overhead: {short} ({params / 1e6:.2f}M parameters), {NODES} nodes, "
                f"push probability {p}, {duration_s:g} s of training...",
                file=progress,
                flush=True,
            )
            runs.append(run_once(name, p, duration_s, cpu_share, pin_cores))
        row = _row(short, params, duration_s, runs)
        rows.append({**row, "cpu_share": cpu_share, "pin_cores": pin_cores})
    return rows


def _row(job: str, params: int, duration_s: float, runs: list[dict[str, Any]]) -> dict[str, Any]:
    off, on = runs
    steps_off, steps_on = sum(off["steps"]), sum(on["steps"])
    row = {
        "job": job,
        "params": params,
        "model_bytes": params * 4,
        "nodes": NODES,
        "duration_s": duration_s,
        "steps_off": steps_off,
        "steps_on": steps_on,
        "ratio_on_off": steps_on / steps_off if steps_off else float("nan"),
        "step_ms_off": NODES * duration_s / steps_off * 1e3 if steps_off else float("nan"),
        "pushes_sent": sum(on["pushes"]),
        "mb_sent_per_node": sum(on["bytes_sent"]) / NODES / MB,
        "runs": runs,
    }
    medians = [m for m in on["push_s_median"] if m is not None]
    row["push_ms_median"] = sum(medians) / len(medians) * 1e3 if medians else None
    if "gossip_cpu_share" in on:
        row["gossip_cpu_share"] = sum(on["gossip_cpu_share"]) / NODES
    return row


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def print_overhead(rows: list[dict[str, Any]], file: TextIO) -> None:
    """The table: steps without and with pushes over the same time, and what was sent."""
    share = all("gossip_cpu_share" in r for r in rows)
    head = (
        f"{'job':<12} {'params':>7} {'ms/step off':>11} {'steps off':>9} {'steps on':>9} "
        f"{'on/off':>6} {'pushes':>7} {'push ms':>7} {'MB/node':>8} {'load':>9}"
        + (f" {'gossip CPU':>10}" if share else "")
    )
    print(head, file=file)
    print("-" * len(head), file=file)
    for r in rows:
        load = "/".join(f"{run['load_avg_1m']:.1f}" for run in r["runs"])
        line = (
            f"{r['job']:<12} {r['params'] / 1e6:>6.2f}M {r['step_ms_off']:>11.2f} "
            f"{r['steps_off']:>9} {r['steps_on']:>9} {r['ratio_on_off']:>6.2f} "
            f"{r['pushes_sent']:>7} {_ms(r['push_ms_median']):>7} "
            f"{r['mb_sent_per_node']:>8.1f} {load:>9}"
        )
        if share:
            line += f" {r['gossip_cpu_share']:>10.1%}"
        print(line, file=file)
    print(
        f"steps summed over {NODES} nodes, each training the same time; on: push probability "
        f"{PUSH_PROBABILITIES[1]}, off: {PUSH_PROBABILITIES[0]}; load: 1-minute load average "
        "as each run started (off/on); push ms: median time from a push's first attempt "
        "until it settled (gossipd_push_seconds, interpolated like histogram_quantile); "
        "gossip CPU: each node's gossip CPU over all its training time, as a share of its "
        "cores, the mean of the nodes",
        file=file,
    )
