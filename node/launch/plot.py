"""The picture `gossipd demo` leaves behind: loss, accuracy and consensus over time.

:func:`mesh_figure` draws it from a mesh result (``node.mesh``'s result dict: its
``timeline``, ``start_unix_s``, ``protocol``, ``job``, optionally ``ready_s``) and
each node's ``history.jsonl`` rows (one per evaluation, the last one written when
the node stopped training); :func:`plot_mesh` reads those rows and writes the PNG.
Time on every panel is seconds since training started (``ready_s`` after the
launcher started the nodes: all of them up and in touch), or since the start
when a result has no ``ready_s``. The demo's picture holds two runs of the same
sites, each on its own clock: alone (dashed) and with gossip (solid).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

STOP_LABEL = "training stopped"
LOCAL_ONLY_LABEL = "local only"


def save_figure(fig: Figure, path: Path, dpi: int = 100) -> Path:
    """Lay out, write (making the folder) and close a benchmark's figure: pyplot keeps
    every open figure alive, and a bench run draws one per invocation."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


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


Histories = dict[str, list[dict[str, float]]]  # node name -> its history.jsonl rows


def _draw_run(
    axes: list[Any], result: dict[str, Any], histories: Histories, tag: str, dashed: bool
) -> tuple[dict[str, float], list[float]]:
    """One run's lines on the three panels, ``tag`` after each label; node i has colour
    Ci in every run, so a site's dashed and solid lines pair up.

    Returns each node's final test accuracy and the times its training stopped.
    """
    ax_loss, ax_acc, ax_cons = axes
    style = "--" if dashed else "-"
    offset = result.get("ready_s") or 0.0
    start = result["start_unix_s"] + offset
    finals: dict[str, float] = {}
    stops: list[float] = []
    for index, (name, rows) in enumerate(histories.items()):
        if not rows:
            continue
        t = [r["unix_s"] - start for r in rows]
        stops.append(t[-1])  # a node evaluates once more when it stops training
        colour = f"C{index}"
        loss = [max(r["loss"], 1e-12) for r in rows]
        ax_loss.plot(t, loss, style, color=colour, label=f"{name}{tag}")
        if "test_accuracy" in rows[-1]:
            acc = [r["test_accuracy"] for r in rows]
            finals[name] = acc[-1]
            label = f"{name}{tag} (final {acc[-1]:.3f})"
            ax_acc.plot(t, acc, style, color=colour, label=label)
    timeline = result["timeline"]
    ax_cons.plot(
        [max(0.0, p["t"] - offset) for p in timeline],  # t = 0: the initial models
        [max(p["consensus_distance"], 1e-12) for p in timeline],
        ".--" if dashed else ".-",
        color="0.55" if dashed else "k",
        label=f"max over nodes{tag}",
    )
    return finals, stops


def _span(finals: dict[str, float]) -> str:
    values = finals.values()
    return f"{min(values):.3f}–{max(values):.3f}" if finals else "none"


def mesh_figure(
    result: dict[str, Any],
    histories: Histories,
    local_only: tuple[dict[str, Any], Histories] | None = None,
) -> Figure:
    """The three panels as a matplotlib Figure (not saved; :func:`plot_mesh` saves it).

    ``local_only``: the result and histories of the same sites trained without gossip
    (the demo's first run), drawn dashed under this run's solid lines, each run's time
    counted from its own start of training.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 5.0 if local_only else 4.4))
    axes = list(fig.subplots(1, 3))
    ax_loss, ax_acc, ax_cons = axes
    finals, stops = _draw_run(axes, result, histories, " gossip" if local_only else "", False)
    alone: dict[str, float] = {}
    if local_only is not None:
        alone, local_stops = _draw_run(axes, *local_only, f" {LOCAL_ONLY_LABEL}", True)
        stops += local_stops
    for ax in (ax_loss, ax_acc, ax_cons):
        if stops:
            ax.axvline(
                max(stops),
                color="tab:red",
                linestyle=":" if local_only else "--",
                label=f"{STOP_LABEL} ({max(stops):.0f} s)",
            )
        offset = result.get("ready_s")
        ax.set_xlabel("time since training started (s)" if offset else "time since start (s)")
        ax.grid(alpha=0.3, which="both")
    ax_loss.set(title="training loss (log scale)", yscale="log")
    ax_acc.set(title="test accuracy", ylim=accuracy_limits([*finals.values(), *alone.values()]))
    ax_cons.set(
        title="consensus distance max‖xᵢ−x̄‖/‖x̄‖ (log scale)", yscale="log", ylabel="distance"
    )
    for ax in (ax_loss, ax_acc, ax_cons):
        ax.legend(fontsize=7 if local_only else 8, loc="best", ncol=2 if local_only else 1)
    nodes = len(result.get("nodes") or histories)
    options = "".join(f" {k}={v}" for k, v in (result.get("job_options") or {}).items())
    stopped = f" · training stopped at {max(stops):.0f} s" if stops else ""
    if local_only is None:
        accuracy = f" · final test accuracy {_span(finals)}" if finals else ""
        title = f"gossipd · protocol {result['protocol']} · {nodes} nodes · job {result['job']}"
        fig.suptitle(f"{title}{options}{accuracy}{stopped}", fontsize=11)
    else:
        fig.suptitle(
            f"gossipd · {nodes} sites · job {result['job']}{options}{stopped}\n"
            f"dashed: each site {LOCAL_ONLY_LABEL} (no gossip), final test accuracy "
            f"{_span(alone)} · solid: with gossip ({result['protocol']}), {_span(finals)}",
            fontsize=11,
        )
    fig.tight_layout()
    return fig


def figure_runs(
    histories: Histories, local_only: tuple[dict[str, Any], Histories] | None = None
) -> dict[str, dict[str, float]]:
    """What the picture shows, per run: each node's final test accuracy (stored in the PNG)."""
    runs = {"gossip": _finals(histories)}
    if local_only is not None:
        runs[LOCAL_ONLY_LABEL] = _finals(local_only[1])
    return runs


def _finals(histories: Histories) -> dict[str, float]:
    return {
        name: rows[-1]["test_accuracy"]
        for name, rows in histories.items()
        if rows and "test_accuracy" in rows[-1]
    }


def plot_mesh(
    result: dict[str, Any],
    node_dirs: list[Path],
    path: Path,
    local_only: tuple[dict[str, Any], list[Path]] | None = None,
) -> Path:
    """Write :func:`mesh_figure` of a mesh run (and of its local-only twin) as a PNG at ``path``.

    The PNG's ``Description`` text holds :func:`figure_runs` as JSON, so a script (or
    a test) can tell which runs a picture holds without reading pixels.
    """
    histories = {Path(d).name: read_history(Path(d)) for d in node_dirs}
    twin = None
    if local_only is not None:
        twin = (local_only[0], {Path(d).name: read_history(Path(d)) for d in local_only[1]})
    fig = mesh_figure(result, histories, twin)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    runs = json.dumps(figure_runs(histories, twin))
    fig.savefig(path, dpi=110, metadata={"Description": runs})
    return path
