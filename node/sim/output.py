"""What ``gossipd sim`` shows: a progress line while it runs, then the table and the plot.

Heavy imports (tqdm, matplotlib) wait until they are used, as in :mod:`.command`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from gossipd.node.sim import memory

if TYPE_CHECKING:
    from gossipd.node.sim.driver import Simulation
    from gossipd.node.sim.spec import SimResult, SimSpec

TABLE_ROWS = 25  # longer runs print evenly spaced rounds and the last one


class Progress:
    """A progress line on a terminal only: tqdm if installed, else a line redrawn with \\r."""

    def __init__(self, total: int, stream: IO[str] = sys.stderr) -> None:
        self.stream = stream
        self.total = total
        self.enabled = stream.isatty()
        self.started = time.perf_counter()
        self._bar: Any = None
        if self.enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self._bar = tqdm(total=total, unit="round", file=stream, leave=False)

    def __call__(self, sim: Simulation, k: int) -> None:
        if not self.enabled:
            return
        error = sim.result.errors[-1]
        wall = time.perf_counter() - self.started
        rate = sim.clock.scheduled / wall if wall > 0 else 0.0
        resident = f"{memory.resident_bytes() / 1e9:.2f} GB"
        if self._bar is not None:
            self._bar.n = k
            self._bar.set_postfix(
                error=f"{error:.2e}", t=f"{sim.now:.1f}s", events=f"{rate:,.0f}/s", mem=resident
            )
            return
        self.stream.write(
            f"\rround {k}/{self.total}  virtual {sim.now:9.2f} s  error {error:.3e}  "
            f"{rate:,.0f} events/s  {resident}  wall {wall:6.1f} s"
        )
        self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled:
            self.stream.write("\r" + " " * 78 + "\r")
            self.stream.flush()


def print_table(result: SimResult, spec: SimSpec, file: IO[str]) -> None:
    n = len(result.errors)
    step = max(1, -(-n // TABLE_ROWS))
    shown = sorted({*range(0, n, step), n - 1})
    cols = ["round", "virtual s", "error (max)", "error (rms)"]
    if result.predicted_errors:
        cols.append("predicted")
    if result.accuracy is not None:
        cols.append("accuracy")
    print(
        f"gossipd sim: {result.protocol}, {result.nodes} nodes, {result.segments} segments, "
        f"scenario {result.scenario}, {result.payload} payload, seed {result.seed}",
        file=file,
    )
    print("  ".join(f"{c:>12}" for c in cols), file=file)
    for k in shown:
        row = [f"{k:>12d}", f"{result.times_s[k]:>12.2f}", f"{result.errors[k]:>12.3e}"]
        row.append(f"{result.rms_errors[k]:>12.3e}")
        if result.predicted_errors:
            row.append(f"{result.predicted_errors[k]:>12.3e}")
        if result.accuracy is not None:
            row.append(f"{result.accuracy[k]:>12.3f}")
        print("  ".join(row), file=file)
    print(
        f"{result.messages} payloads ({result.retries} retries, {result.refused} refused), "
        f"{result.settles} settles, "
        f"{result.bytes / 1e6:.3f} MB, {result.bytes_per_node_per_round:.0f} B per node per "
        f"round; {result.steps} steps; virtual {result.virtual_time_s:.2f} s in "
        f"{result.wall_s:.2f} s wall ({result.events / max(result.wall_s, 1e-9):,.0f} events/s)",
        file=file,
    )
    print(
        f"peak memory {result.peak_memory_bytes / 1e6:,.0f} MB, "
        f"{result.memory_per_node_bytes / 1e3:,.1f} KB per node over the "
        f"{result.start_memory_bytes / 1e6:,.0f} MB resident before the nodes were built",
        file=file,
    )
    if result.mass_lost or result.mass_duplicated:
        print(
            f"mass lost with failed nodes {result.mass_lost:.6g}, duplicated "
            f"{result.mass_duplicated:.6g} (summed over segments)",
            file=file,
        )
    if result.invariant_mass_error is not None:
        print(
            f"invariants: worst relative drift of sum w {result.invariant_mass_error:.2e}, "
            f"of sum w*x {result.invariant_value_error:.2e}",
            file=file,
        )


def plot_result(result: SimResult, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if result.accuracy is not None else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.2), squeeze=False)
    ax = axes[0][0]
    floor = 1e-16
    ax.semilogy(result.times_s, [max(e, floor) for e in result.errors], "k.-", label="measured")
    if result.predicted_errors:
        ax.semilogy(
            result.times_s,
            [max(e, floor) for e in result.predicted_errors],
            "r--",
            label="predicted: error₀·σ₁(P_k − J)",
        )
    what = "x̄ the initial mean" if result.accuracy is None else "x̄ the current mean"
    ax.set(title=f"consensus error max‖xᵢ − x̄‖/‖x̄‖, {what}", xlabel="virtual time (s)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    if result.accuracy is not None:
        acc = axes[0][1]
        acc.plot(result.times_s, result.accuracy, "b.-")
        acc.set(title="mean test accuracy", xlabel="virtual time (s)", ylim=(0, 1))
        acc.grid(alpha=0.3)
    fig.suptitle(
        f"gossipd sim · {result.protocol} · {result.nodes} nodes · {result.scenario}", fontsize=11
    )
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
