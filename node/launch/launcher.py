"""`gossipd mesh up` and `gossipd demo`: start a local mesh, watch it, summarise the run.

The run keeps what it watches honest on a loaded machine: a poll that fails while
every node lives is asked again or skipped (one lost sample is no reason to throw
a finished run away), a final pull that still fails is replaced by the checkpoints
the nodes write at exit, and the run fails only when a node died or its result is
unknown, saying which.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from gossipd.node.baselines import BASELINES
from gossipd.node.errors import GossipdError
from gossipd.node.launch.forked import fork_node
from gossipd.node.launch.localmesh import (
    STARTUP_TIMEOUT_S,
    LocalMesh,
    as_vector,
    consensus_distance,
)
from gossipd.node.launch.meshspec import MeshSpec
from gossipd.node.launch.processes import Spawner
from gossipd.node.site.rank_launcher import MAX_RANKS
from gossipd.node.trainer.ranks import read_records

if TYPE_CHECKING:
    import torch

    from gossipd.node.launch.progress import MeshProgress
    from gossipd.node.trainer import checkpoint

SAMPLE_PATIENCE_S = 10.0  # a progress sample is skipped, not waited for, past this
DONE_POLL_S = 0.2  # how often a wait between samples looks for the end of training


def _summary(mesh: LocalMesh, index: int) -> dict[str, Any]:
    path = mesh.node_dir(index) / "summary.json"
    return json.loads(path.read_text()) if path.exists() else {}


async def _run(spec: MeshSpec, root: Path, progress: TextIO, spawn: Spawner) -> dict[str, Any]:
    from gossipd.node.launch.progress import MeshProgress

    display = MeshProgress(progress, spec, root)
    display.starting()  # before the CA and the processes: a person sees at once what runs
    with display, LocalMesh(spec, root, spawn) as mesh:
        t0 = display.t0 = time.monotonic()
        start_unix_s = time.time()
        initial = await _start(mesh, display)
        distance_start = consensus_distance([as_vector(c.segments) for c in initial])
        timeline: list[dict[str, float]] = [{"t": 0.0, "consensus_distance": distance_start}]
        display.ready(distance_start)
        skipped = await _watch(mesh, display, timeline)
        display.training_done()
        states, end_models = await _settle(mesh, progress)
        end_t = time.monotonic() - t0
        exit_codes = mesh.stop_all()
        distance_end = consensus_distance(end_models or mesh.final_models())
        timeline.append({"t": end_t, "consensus_distance": distance_end})
        nodes = [_node_entry(mesh, i, state) for i, state in enumerate(states)]
    result = {
        "mesh_id": mesh.mesh_id,
        "job": spec.job,
        "protocol": spec.protocol,
        "coordinator": mesh.coordinator_address,
        "nodes": nodes,
        "consensus_distance_start": distance_start,
        "consensus_distance_end": distance_end,
        "sum_weight_start": _mean_weight_sum(c.weights for c in initial),
        "sum_weight_end": _mean_weight_sum(s["sum_weights"] for s in states),
        "wall_s": time.monotonic() - t0,
        "start_unix_s": start_unix_s,
        "ready_s": display.ready_s,
        "exit_codes": exit_codes,
        "ok": all(c == 0 for c in exit_codes),
        "workdir": str(root),
        "timeline": timeline,
        "samples_skipped": skipped,
    }
    if spec.plot_path is not None:
        from gossipd.node.launch.plot import plot_mesh

        plot_mesh(result, [mesh.node_dir(i) for i in range(spec.nodes)], spec.plot_path)
        result["plot"] = str(spec.plot_path)
    return result


async def _start(mesh: LocalMesh, display: MeshProgress) -> list[checkpoint.Checkpoint]:
    """Start the coordinator (if any) and every node, wait until all are in touch; each
    node's model and weights before its first step."""
    if mesh.spec.coordinator:
        mesh.start_coordinator()
        assert mesh.coordinator_address is not None  # set with spec.coordinator
        display.coordinator_started(mesh.coordinator_address, mesh.coordinator_log)
    for i in range(mesh.spec.nodes):
        mesh.start(i)
    watcher = asyncio.create_task(display.watch_start([mesh.node_dir(i) for i in mesh.procs]))
    try:
        # Building the job takes seconds of CPU: off the loop, so progress keeps coming.
        await asyncio.gather(asyncio.to_thread(mesh.load_plan), mesh.wait_ready())
    finally:
        watcher.cancel()
    return mesh.initial()


async def _watch(mesh: LocalMesh, display: MeshProgress, timeline: list[dict[str, float]]) -> int:
    """Sample the consensus distance into ``timeline`` until every node finished training;
    the samples skipped because a pull failed while every node lived."""
    spec = mesh.spec
    skipped = 0
    while True:
        mesh.check_alive()
        states = await mesh.statuses()
        if all(s["training_done"] for s in states):
            return skipped
        try:
            dist = consensus_distance(await mesh.pull_all(SAMPLE_PATIENCE_S))
        except GossipdError:
            mesh.check_alive()  # a node that died fails the run; a lost sample does not
            skipped += 1
            dist = None
        t = display.elapsed_s()
        if dist is not None:
            timeline.append({"t": t, "consensus_distance": dist})
            display.sample(t, states, dist)
        if spec.duration_s and t > spec.duration_s + STARTUP_TIMEOUT_S:
            raise GossipdError("nodes did not finish training in time; see node logs")
        await _sleep_unless_done(mesh, spec.sample_interval_s)


async def _settle(
    mesh: LocalMesh, progress: TextIO
) -> tuple[list[dict[str, Any]], list[torch.Tensor] | None]:
    """Every node's status once none has a push in flight, and the models they end with
    (None when the last pull failed: read from the final checkpoints once stopped)."""
    states = await mesh.wait_settled()
    try:
        return states, await mesh.pull_all()
    except GossipdError as err:
        mesh.check_alive()
        progress.write(f"final pull failed ({err}); reading the nodes' final checkpoints\n")
        return states, None


def _node_entry(mesh: LocalMesh, index: int, state: dict[str, Any]) -> dict[str, Any]:
    """One node's row of the result: its last status, with what its summary adds."""
    summary = _summary(mesh, index)
    entry = {
        "node_id": state["node_id"],
        "steps": state["step"],
        "round": state["round"],
        "loss": state["loss"],
        # As training ended (the share falls while a node only serves afterwards).
        "wait_fraction": summary.get("wait_fraction", state["wait_fraction"]),
        "wait_s": summary.get("wait_s", state["wait_s"]),
        "scheduling": state["scheduling"],
        # Its mean segment sum-weight as it settled (None: a protocol without weights), and
        # a pulling protocol's pulls by outcome: what the demo's summary explains a site by.
        "sum_weight": _mean(state["sum_weights"]),
        "pulls": state["pulls"],
    }
    entry.update({k: v for k, v in summary.items() if k.startswith("test_")})
    if mesh.spec.ranks > 1:
        entry["ranks"] = [
            {k: r[k] for k in ("rank", "step", "test_accuracy", "model_checksum") if k in r}
            for r in read_records(mesh.node_dir(index))
        ]
    return entry


async def _sleep_unless_done(mesh: LocalMesh, seconds: float) -> None:
    """Until the next progress sample, cut short once every node has written that it
    finished training: the run then settles at once instead of up to a sample later."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        await asyncio.sleep(min(DONE_POLL_S, left))
        if all(_summary(mesh, i).get("training_done") for i in sorted(mesh.procs)):
            return


def check_spec(spec: MeshSpec) -> None:
    """What can be found wrong before any node starts: too few nodes, a missing package,
    a bad job option, more sites (times ranks) than the job's data has shards."""
    from gossipd.node.jobs.packages import check_job_package
    from gossipd.node.launch.joboptions import check_job_options

    if spec.nodes < 2:
        raise GossipdError(f"--nodes {spec.nodes}: a mesh needs at least 2 nodes")
    if not 1 <= spec.ranks <= MAX_RANKS:
        raise GossipdError(f"--ranks {spec.ranks}: give 1..{MAX_RANKS} processes per site")
    if spec.ranks > 1 and spec.protocol in BASELINES:
        raise GossipdError(
            f"--ranks with --protocol {spec.protocol}: the baseline runs one process per "
            "site; drop --ranks"
        )
    check_job_package(spec.job)
    check_job_options(spec.job, spec.job_options, spec.nodes * spec.ranks)


def run_mesh(
    spec: MeshSpec, progress: TextIO | None = None, spawn: Spawner = fork_node
) -> dict[str, Any]:
    """``mesh up``: check ``spec``, run it, return the result ``--json`` prints; ``spawn``
    starts each node (the executable; tests pass a faster one)."""
    check_spec(spec)
    progress = progress or (sys.stderr if spec.quiet else sys.stdout)
    if spec.workdir is not None:
        spec.workdir.mkdir(parents=True, exist_ok=True)
        return run_mesh_in(spec, spec.workdir, progress, spawn)
    root = Path(tempfile.mkdtemp(prefix="gossipd-mesh-"))
    try:
        return run_mesh_in(spec, root, progress, spawn)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_mesh_in(
    spec: MeshSpec, root: Path, progress: TextIO, spawn: Spawner = fork_node
) -> dict[str, Any]:
    """One run of a spec :func:`check_spec` passed, its files under ``root``, which the
    caller owns and removes (the demo keeps its two runs side by side under one directory)."""
    if spec.protocol in BASELINES:
        from gossipd.node.launch.baseline_mesh import run_baseline_mesh

        return asyncio.run(run_baseline_mesh(spec, root, progress, spawn))
    return asyncio.run(_run(spec, root, progress, spawn))


def print_table(result: dict[str, Any], file: TextIO) -> None:
    """One row per node (steps, loss, test metrics; a pulling protocol's pulls, waits and
    scheduler too), then what the mesh did as a whole."""
    keys = sorted({k for n in result["nodes"] for k in n if k.startswith("test_")})
    pulling = any(n.get("pulls") for n in result["nodes"])
    header = f"{'node':<10}{'steps':>8}{'loss':>10}" + "".join(f"{k:>16}" for k in keys)
    if pulling:
        header += f"{'pulls':>8}{'failed':>8}{'waiting':>9}  scheduling"
    print(header, file=file)
    for n in result["nodes"]:
        row = f"{n['node_id']:<10}{n['steps']:>8}{n['loss']:>10.4f}"
        row += "".join(f"{n.get(k, float('nan')):>16.4f}" for k in keys)
        if pulling:
            pulls = n.get("pulls") or {}
            row += f"{pulls.get('merged', 0):>8}{pulls.get('failed', 0):>8}"
            row += f"{n['wait_fraction'] or 0.0:>9.1%}  {n['scheduling'] or '–'}"
        print(row, file=file)
    if result["coordinator"]:
        print(f"a local coordinator ran on {result['coordinator']}", file=file)
    start, end = result["sum_weight_start"], result["sum_weight_end"]
    weights = (
        f"sum of weights {start:.6f} -> {end:.6f}"
        if start is not None and end is not None
        else "no sum-weights (protocol without them)"
    )
    distance_end = result["consensus_distance_end"]
    ended = "unknown (model checksums differ)" if distance_end is None else f"{distance_end:.3e}"
    print(
        f"consensus distance {result['consensus_distance_start']:.3e} -> {ended}; "
        f"{weights}; {result['wall_s']:.1f} s",
        file=file,
    )
    if "plot" in result:
        print(f"plot: {result['plot']}", file=file)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _mean_weight_sum(per_node: Iterable[Sequence[float]]) -> float | None:
    """Σ over nodes of each node's mean segment weight; None for a protocol without weights."""
    weights = [list(w) for w in per_node]
    if not all(weights):
        return None
    return sum(sum(w) / len(w) for w in weights)
