"""The picture `gossipd demo` leaves behind: loss, accuracy and consensus over time.

:func:`mesh_figure` draws it from a mesh result (``node.mesh``'s result dict: its
``timeline``, ``start_unix_s``, ``protocol``, ``job``, optionally ``ready_s``) and
each node's ``history.jsonl`` rows (one per evaluation, the last one written when
the node stopped training); :func:`plot_mesh` reads those rows and writes the PNG.
Time on every panel is seconds since training started (``ready_s`` after the
launcher started the nodes: all of them up and in touch), or since the start
when a result has no ``ready_s``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

STOP_LABEL = "training stopped"


def read_history(node_dir: Path) -> list[dict[str, float]]:
    """A node's ``history.jsonl`` rows; none when it never evaluated."""
    path = Path(node_dir) / "history.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def accuracy_limits(final_accuracies: list[float]) -> tuple[float, float]:
    """From a bit below the lowest final accuracy to 1, so close lines stay apart.

    The margin below is the lowest accuracy's distance to 1 (at least 0.02):
    four nodes at 0.97 get an axis from 0.94 to 1, a node at 0.6 one from 0.2.
    """
    if not final_accuracies:
        return 0.0, 1.0
    low = min(final_accuracies)
    margin = max(0.02, 1.0 - low)
    return max(0.0, low - margin), 1.0 + margin * 0.05


def mesh_figure(result: dict[str, Any], histories: dict[str, list[dict[str, float]]]) -> Figure:
    """The three panels as a matplotlib Figure (not saved; :func:`plot_mesh` saves it)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4.4))
    ax_loss, ax_acc, ax_cons = fig.subplots(1, 3)
    offset = result.get("ready_s") or 0.0
    start = result["start_unix_s"] + offset
    finals: list[float] = []
    stops: list[float] = []
    for name, rows in histories.items():
        if not rows:
            continue
        t = [r["unix_s"] - start for r in rows]
        stops.append(t[-1])  # a node evaluates once more when it stops training
        ax_loss.plot(t, [max(r["loss"], 1e-12) for r in rows], label=name)
        if "test_accuracy" in rows[-1]:
            acc = [r["test_accuracy"] for r in rows]
            finals.append(acc[-1])
            ax_acc.plot(t, acc, label=f"{name} (final {acc[-1]:.3f})")
    timeline = result["timeline"]
    ax_cons.plot(
        [max(0.0, p["t"] - offset) for p in timeline],  # t = 0: the initial models
        [max(p["consensus_distance"], 1e-12) for p in timeline],
        "k.-",
        label="max over nodes",
    )
    for ax in (ax_loss, ax_acc, ax_cons):
        if stops:
            ax.axvline(
                max(stops),
                color="tab:red",
                linestyle="--",
                label=f"{STOP_LABEL} ({max(stops):.0f} s)",
            )
        ax.set_xlabel("time since training started (s)" if offset else "time since start (s)")
        ax.grid(alpha=0.3, which="both")
    ax_loss.set(title="training loss (log scale)", yscale="log")
    ax_acc.set(title="test accuracy", ylim=accuracy_limits(finals))
    ax_cons.set(
        title="consensus distance max‖xᵢ−x̄‖/‖x̄‖ (log scale)", yscale="log", ylabel="distance"
    )
    for ax in (ax_loss, ax_acc, ax_cons):
        ax.legend(fontsize=8, loc="best")
    nodes = len(result.get("nodes") or histories)
    accuracy = f" · final test accuracy {min(finals):.3f}–{max(finals):.3f}" if finals else ""
    stopped = f" · training stopped at {max(stops):.0f} s" if stops else ""
    fig.suptitle(
        f"gossipd · protocol {result['protocol']} · {nodes} nodes · job {result['job']}"
        f"{accuracy}{stopped}",
        fontsize=11,
    )
    fig.tight_layout()
    return fig


def plot_mesh(result: dict[str, Any], node_dirs: list[Path], path: Path) -> Path:
    """Write :func:`mesh_figure` of a mesh run as a PNG at ``path``."""
    fig = mesh_figure(result, {Path(d).name: read_history(Path(d)) for d in node_dirs})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
