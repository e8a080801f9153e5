"""What `gossipd mesh up` and `gossipd demo` show while they run.

A line at once saying what starts and where, a line as each node listens, then
one sample per interval: a live table on a terminal (rich), plain lines under a
header otherwise (pipes, CI, ``--json``, which sends all of it to stderr).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

from rich.console import Console
from rich.live import Live
from rich.table import Table

from gossipd.node.protocols import keeps_weights

# A node's start-up (import torch, build the job, listen) costs about this much
# CPU on the 2-core VM the README's numbers come from; nodes start in parallel.
# Only for the estimate in the first lines: a loaded machine takes longer.
NODE_START_CPU_S = 12.0
WAITING_NOTE_S = 5.0  # plain output: a line at least this often while nodes start
STEP_COLUMNS_MAX = 8  # more nodes than this: steps as min / median / max


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _all(nodes: int) -> str:
    return "both" if nodes == 2 else f"all {nodes}"


def _startup_estimate_s(nodes: int) -> float:
    return NODE_START_CPU_S * max(1.0, nodes / _cores())


class MeshProgress:
    """Progress of one local mesh run on ``stream``; use as a context manager."""

    def __init__(self, stream: TextIO, spec: Any, root: Path) -> None:
        self.stream = stream
        self.spec = spec
        self.root = root
        self.t0 = time.monotonic()
        self.start_unix_s = time.time() - 1.0  # file times are coarse on some file systems
        self.console = Console(file=stream, highlight=False, soft_wrap=True)
        self.live: Live | None = None
        if self.console.is_terminal and not self.console.is_dumb_terminal:
            self.live = Live(console=self.console, refresh_per_second=4)
        self.distance_start: float | None = None
        self.ready_s: float | None = None
        self.listening: set[str] = set()
        self.last: tuple[float, list[dict[str, Any]]] | None = None
        # A protocol without sum-weights averages with pulled models: its nodes' statuses
        # count pulls by outcome, and the tables show those and the waits, not pushes.
        self.pulling = not keeps_weights(spec.protocol)

    def __enter__(self) -> MeshProgress:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.live is not None and self.live.is_started:
            self.live.stop()

    def elapsed_s(self) -> float:
        return time.monotonic() - self.t0

    def _line(self, text: str) -> None:
        self.console.print(text, markup=False)

    def starting(self) -> None:
        """The first words of a run, before any node process exists."""
        spec = self.spec
        length = (
            f"{spec.duration_s:g} s of training" if spec.duration_s else f"{spec.max_steps} steps"
        )
        ranks = f" of {spec.ranks} ranks each" if spec.ranks > 1 else ""
        self._line(
            f"gossipd: starting {spec.nodes} nodes{ranks} on loopback (job {spec.job}, protocol "
            f"{spec.protocol}, {length})"
        )
        for line in self._what_runs():
            self._line(f"gossipd: {line}")
        security = "plaintext gRPC (--insecure)" if spec.insecure else "mutual TLS, throwaway CA"
        kept = "kept" if spec.workdir is not None else "removed at the end"
        self._line(f"gossipd: {security}; configs, logs and node state in {self.root} ({kept})")
        cores = _cores()
        self._line(
            f"gossipd: training starts once {_all(spec.nodes)} have loaded torch and found each "
            f"other (about {_startup_estimate_s(spec.nodes):.0f} s on {cores} idle "
            f"core{'s' if cores > 1 else ''}); progress every {spec.sample_interval_s:g} s"
        )
        if self.live is not None:
            self.live.start()
            self.live.update(self._startup_table())

    def _what_runs(self) -> list[str]:
        """Beside the nodes: how the protocol exchanges models, who schedules its pulls,
        what a site of several ranks is."""
        spec, lines = self.spec, []
        if self.pulling:
            who = (
                "a local coordinator schedules the pulls (a node that cannot reach it "
                "schedules alone)"
                if spec.coordinator
                else "each schedules its pulls itself (decentralized; --coordinator local "
                "starts a coordinator)"
            )
            lines.append(f"{spec.protocol}: each node averages with models it pulls; {who}")
        elif spec.coordinator:
            lines.append(
                f"a local coordinator runs too, but {spec.protocol} pushes and never asks it "
                "(only a protocol that pulls does)"
            )
        if spec.ranks > 1:
            lines.append(
                f"each node is a site of {spec.ranks} processes: every rank trains on its "
                "slice of the site's shard, the ranks all-reduce gradients, rank 0 gossips"
            )
        return lines

    def coordinator_started(self, address: str, log_path: Path) -> None:
        """The local coordinator's process exists: where it listens and logs."""
        self._line(f"[{self.elapsed_s():6.1f}s] coordinator started on {address} (log: {log_path})")

    async def watch_start(self, node_dirs: list[Path]) -> None:
        """Say when each node listens (its ``node.json`` appears); cancelled once all are ready.

        Plain output also says every ``WAITING_NOTE_S`` that it is still waiting.
        """
        noted = self.elapsed_s()
        while True:
            if self.live is None and self.elapsed_s() - noted >= WAITING_NOTE_S:
                noted = self.elapsed_s()
                self._line(
                    f"[{noted:6.1f}s] waiting: {len(self.listening)}/{len(node_dirs)} nodes "
                    "listening"
                )
            for node_dir in node_dirs:
                if node_dir.name not in self.listening and self._listens(node_dir):
                    self.listening.add(node_dir.name)
                    if self.live is None:
                        noted = self.elapsed_s()
                        self._line(
                            f"[{noted:6.1f}s] {node_dir.name} listening "
                            f"({len(self.listening)}/{len(node_dirs)})"
                        )
            if self.live is not None:
                self.live.update(self._startup_table())  # its caption counts the seconds
            await asyncio.sleep(0.5)

    def _listens(self, node_dir: Path) -> bool:
        """A node writes ``node.json`` once its server listens (an older one may be left over)."""
        try:
            return (node_dir / "node.json").stat().st_mtime >= self.start_unix_s
        except OSError:
            return False

    def ready(self, distance_start: float) -> None:
        """All nodes in touch: training starts; plain output prints its column header here."""
        self.ready_s = self.elapsed_s()
        self.distance_start = distance_start
        self._line(
            f"[{self.ready_s:6.1f}s] {_all(self.spec.nodes)} nodes up and in touch: training "
            f"starts; consensus distance at start {distance_start:.2e}"
        )
        if self.live is not None:
            return
        pulls = (
            ", pulls merged by all nodes, their mean share of time waiting for pulls"
            if self.pulling
            else ""
        )
        self._line(
            "columns: seconds since start, steps done by each node, their mean training loss, "
            f"consensus distance max‖xᵢ−x̄‖/‖x̄‖{pulls}"
        )
        nodes = (
            f"{'steps_min':>10}{'steps_med':>10}{'steps_max':>10}"
            if self.spec.nodes > STEP_COLUMNS_MAX
            else "".join(f"{f'node-{i}':>10}" for i in range(self.spec.nodes))
        )
        pulls = f"{'pulls':>8}{'waiting':>9}" if self.pulling else ""
        self._line(f"{'time_s':>8}{nodes}{'mean_loss':>12}{'consensus':>12}{pulls}")

    def sample(self, t: float, states: list[dict[str, Any]], distance: float) -> None:
        if self.live is not None:
            self.live.update(self._table(t, states, distance))
            self.last = (t, states)
            return
        steps = sorted(s["step"] for s in states)
        cells = (
            [steps[0], steps[len(steps) // 2], steps[-1]]
            if len(states) > STEP_COLUMNS_MAX
            else [s["step"] for s in states]
        )
        losses = [s["loss"] for s in states if s["step"] > 0]  # no loss before a first step
        loss = sum(losses) / len(losses) if losses else float("nan")
        row = "".join(f"{c:>10}" for c in cells)
        if self.pulling:
            merged = sum(s["pulls"].get("merged", 0) for s in states)
            waiting = sum(s["wait_fraction"] for s in states) / len(states)
            row_end = f"{merged:>8}{waiting:>9.1%}"
        else:
            row_end = ""
        self._line(f"{t:>8.1f}{row}{loss:>12.4f}{distance:>12.2e}{row_end}")

    def training_done(self) -> None:
        if self.live is not None and self.live.is_started:
            self.live.stop()
        exchanges = "pulls" if self.pulling else "pushes"
        self._line(
            f"[{self.elapsed_s():6.1f}s] all nodes stopped training; settling {exchanges} in "
            "flight and pulling the final models"
        )

    def _startup_table(self) -> Table:
        table = Table(title=f"gossipd · starting {self.spec.nodes} nodes", title_justify="left")
        table.add_column("node")
        table.add_column("state")
        for i in range(self.spec.nodes):
            name = f"node-{i}"
            table.add_row(name, "listening" if name in self.listening else "starting…")
        table.caption = f"{self.elapsed_s():.0f} s since start"
        return table

    def _table(self, t: float, states: list[dict[str, Any]], distance: float) -> Table:
        spec = self.spec
        ranks = f" × {spec.ranks} ranks" if spec.ranks > 1 else ""
        table = Table(
            title=f"gossipd · {spec.protocol} · {spec.nodes} nodes{ranks} · {spec.job}",
            title_justify="left",
        )
        exchange = ("pulls", "waiting", "scheduling") if self.pulling else ("pushes",)
        for name in ("node", "step", "steps/s", "loss", "round", *exchange, "live peers"):
            table.add_column(name, justify="left" if name == "node" else "right")
        previous = {s["node_id"]: s["step"] for s in self.last[1]} if self.last else {}
        interval = max(1e-9, t - self.last[0]) if self.last else 0.0
        for s in states:
            rate = (s["step"] - previous.get(s["node_id"], s["step"])) / interval if interval else 0
            table.add_row(
                s["node_id"],
                str(s["step"]),
                f"{rate:.0f}",
                f"{s['loss']:.4f}" if s["step"] else "–",
                str(s.get("round", "")),
                *self._exchange_cells(s),
                f"{len(s['live_peers'])}/{len(states) - 1}",
            )
        trained = t - (self.ready_s or 0.0)
        goal = f" of {spec.duration_s:g} s" if spec.duration_s else ""
        table.caption = (
            f"training {trained:.0f} s{goal} · consensus distance {distance:.2e}"
            f" (start {self.distance_start or 0:.2e})"
        )
        return table

    def _exchange_cells(self, status: dict[str, Any]) -> tuple[str, ...]:
        """A node's exchanges in its protocol's terms: pushes its peers acknowledged, or its
        pulls merged (and failed), its share of time waiting for them and who schedules."""
        if not self.pulling:
            return (str(status["pushes_acked"]),)
        pulls = status["pulls"]
        failed = pulls.get("failed", 0)
        merged = f"{pulls.get('merged', 0)}" + (f" ({failed} failed)" if failed else "")
        return merged, f"{status['wait_fraction']:.1%}", status["scheduling"] or "–"
