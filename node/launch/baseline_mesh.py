"""`gossipd mesh up --protocol NAME` for a baseline (``allreduce``): N sites on loopback.

A baseline serves no Status RPC and no models: a site is up once its ``node.json``
is written, it exits on its own when rank 0's ``max_steps`` or ``duration_s`` ends
training, and the run's summary is read from the ``summary.json`` each site writes
first. Its sites hold one model (each is a rank of one process group), which their
``model_checksum`` values confirm: the consensus distance is 0 when they all agree.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any, TextIO

from gossipd.node.baselines import BASELINES
from gossipd.node.errors import GossipdError
from gossipd.node.launch.forked import fork_node
from gossipd.node.launch.localmesh import STARTUP_TIMEOUT_S, LocalMesh
from gossipd.node.launch.meshspec import MeshSpec
from gossipd.node.launch.processes import Spawner

POLL_S = 0.2


def _summary(mesh: LocalMesh, index: int) -> dict[str, Any]:
    path = mesh.node_dir(index) / "summary.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _log_tail(mesh: LocalMesh, index: int) -> str:
    path = mesh.node_dir(index) / "node.log"
    return path.read_text()[-2000:] if path.exists() else ""


async def run_baseline_mesh(
    spec: MeshSpec, root: Path, progress: TextIO, spawn: Spawner = fork_node
) -> dict[str, Any]:
    """Start the sites, wait until each has exited, summarise as ``run_mesh`` does."""
    baseline = BASELINES[spec.protocol]
    length = f"{spec.duration_s:g} s of training" if spec.duration_s else f"{spec.max_steps} steps"
    progress.write(
        f"gossipd: starting {spec.nodes} sites of {baseline.name} ({baseline.description}) "
        f"on loopback (job {spec.job}, {length}); files in {root}\n"
    )
    with LocalMesh(spec, root, spawn) as mesh:
        t0 = time.monotonic()
        start_unix_s = time.time()
        for i in range(spec.nodes):
            mesh.start(i)
        exit_codes, ready_s = await _wait_for_exits(mesh, progress, t0)
        wall_s = time.monotonic() - t0
    return {
        **_result(mesh, [exit_codes[i] for i in range(spec.nodes)]),
        "wall_s": wall_s,
        "start_unix_s": start_unix_s,
        "ready_s": ready_s,
    }


async def _wait_for_exits(
    mesh: LocalMesh, progress: TextIO, t0: float
) -> tuple[dict[int, int], float | None]:
    """Every site's exit code once all have exited, and when all had started (None: never
    seen); says each exit, with the log's tail of a site that failed."""
    spec = mesh.spec
    exit_codes: dict[int, int] = {}
    ready_s: float | None = None
    deadline = t0 + STARTUP_TIMEOUT_S + spec.duration_s if spec.duration_s else None
    while mesh.procs:
        for i, proc in list(mesh.procs.items()):
            if proc.poll() is not None:
                exit_codes[i] = code = mesh.procs.pop(i).returncode
                progress.write(f"[{time.monotonic() - t0:6.1f}s] node-{i} exited ({code})\n")
                if exit_codes[i] != 0:
                    progress.write(_log_tail(mesh, i) + "\n")
        if ready_s is None and all(
            (mesh.node_dir(i) / "node.json").exists() for i in range(spec.nodes)
        ):
            ready_s = time.monotonic() - t0
            progress.write(f"[{ready_s:6.1f}s] all {spec.nodes} sites started\n")
        if deadline is not None and time.monotonic() > deadline:
            raise GossipdError(f"sites did not finish training in time; see {mesh.root}")
        await asyncio.sleep(POLL_S)
    return exit_codes, ready_s


def _result(mesh: LocalMesh, codes: list[int]) -> dict[str, Any]:
    """What ``run_mesh`` returns, from the summaries the sites wrote (timings aside)."""
    spec = mesh.spec
    nodes = []
    checksums = set()
    for i in range(spec.nodes):
        summary = _summary(mesh, i)
        checksums.add(summary.get("model_checksum"))
        entry = {
            "node_id": summary.get("node_id", f"node-{i}"),
            "steps": summary.get("steps", 0),
            "round": None,
            "loss": summary.get("loss", float("nan")),
            "wait_fraction": summary.get("wait_fraction"),
            "wait_s": summary.get("wait_s"),
            "scheduling": None,
            "model_checksum": summary.get("model_checksum"),
        }
        entry.update({k: v for k, v in summary.items() if k.startswith("test_")})
        nodes.append(entry)
    identical = len(checksums) == 1 and None not in checksums
    return {
        "mesh_id": mesh.mesh_id,
        "job": spec.job,
        "protocol": spec.protocol,
        "coordinator": None,
        "nodes": nodes,
        # Every site starts from rank 0's model; at the end the checksums say.
        "consensus_distance_start": 0.0,
        "consensus_distance_end": 0.0 if identical else None,
        "models_identical": identical,
        "sum_weight_start": None,
        "sum_weight_end": None,
        "exit_codes": codes,
        "ok": identical and all(c == 0 for c in codes),
        "workdir": str(mesh.root),
        "timeline": [],
        "samples_skipped": 0,
    }
