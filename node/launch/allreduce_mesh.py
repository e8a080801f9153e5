"""`gossipd mesh up --protocol allreduce`: N sites of the synchronous baseline on loopback.

The baseline serves no Status RPC and no models: a site is up once its ``node.json``
is written, it exits on its own when rank 0's ``max_steps`` or ``duration_s`` ends
training, and the run's summary is read from the ``summary.json`` each site writes
first. Its models are identical by construction (DDP), which the sites'
``model_checksum`` values confirm: the consensus distance is 0 when they all agree.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any, TextIO

from gossipd.node.errors import GossipdError
from gossipd.node.launch.localmesh import STARTUP_TIMEOUT_S, LocalMesh, MeshSpec


def _summary(mesh: LocalMesh, index: int) -> dict[str, Any]:
    path = mesh.node_dir(index) / "summary.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _log_tail(mesh: LocalMesh, index: int) -> str:
    path = mesh.node_dir(index) / "node.log"
    return path.read_text()[-2000:] if path.exists() else ""


async def run_allreduce_mesh(spec: MeshSpec, root: Path, progress: TextIO) -> dict[str, Any]:
    """Start the sites, wait until each has exited, summarise as ``run_mesh`` does."""
    length = f"{spec.duration_s:g} s of training" if spec.duration_s else f"{spec.max_steps} steps"
    progress.write(
        f"gossipd: starting {spec.nodes} sites of the synchronous all-reduce baseline on "
        f"loopback (job {spec.job}, {length}); files in {root}\n"
    )
    with LocalMesh(spec, root) as mesh:
        t0 = time.monotonic()
        start_unix_s = time.time()
        for i in range(spec.nodes):
            mesh.start(i)
        exit_codes: dict[int, int] = {}
        ready_s: float | None = None
        deadline = t0 + STARTUP_TIMEOUT_S + spec.duration_s if spec.duration_s else None
        while mesh.procs:
            for i, proc in list(mesh.procs.items()):
                if proc.poll() is not None:
                    exit_codes[i] = mesh.procs.pop(i).returncode
                    progress.write(
                        f"[{time.monotonic() - t0:6.1f}s] node-{i} exited ({exit_codes[i]})\n"
                    )
                    if exit_codes[i] != 0:
                        progress.write(_log_tail(mesh, i) + "\n")
            if ready_s is None and all(
                (mesh.node_dir(i) / "node.json").exists() for i in range(spec.nodes)
            ):
                ready_s = time.monotonic() - t0
                progress.write(f"[{ready_s:6.1f}s] all {spec.nodes} sites started\n")
            if deadline is not None and time.monotonic() > deadline:
                raise GossipdError(f"sites did not finish training in time; see {root}")
            await asyncio.sleep(0.2)
        wall_s = time.monotonic() - t0
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
    codes = [exit_codes[i] for i in range(spec.nodes)]
    return {
        "mesh_id": mesh.mesh_id,
        "job": spec.job,
        "protocol": spec.protocol,
        "coordinator": None,
        "nodes": nodes,
        # DDP starts every site from rank 0's model; at the end the checksums say.
        "consensus_distance_start": 0.0,
        "consensus_distance_end": 0.0 if identical else None,
        "models_identical": identical,
        "sum_weight_start": None,
        "sum_weight_end": None,
        "wall_s": wall_s,
        "start_unix_s": start_unix_s,
        "ready_s": ready_s,
        "exit_codes": codes,
        "ok": identical and all(c == 0 for c in codes),
        "workdir": str(root),
        "timeline": [],
        "samples_skipped": 0,
    }
