"""The picture `gossipd demo` leaves behind: loss, accuracy and consensus over time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _history(node_dir: Path) -> list[dict[str, float]]:
    path = node_dir / "history.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_mesh(result: dict[str, Any], node_dirs: list[Path], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc, ax_cons) = plt.subplots(1, 3, figsize=(15, 4.2))
    for node_dir in node_dirs:
        rows = _history(node_dir)
        if not rows:
            continue
        t = [r["unix_s"] - result["start_unix_s"] for r in rows]
        ax_loss.plot(t, [r["loss"] for r in rows], label=node_dir.name)
        if "test_accuracy" in rows[0]:
            ax_acc.plot(t, [r["test_accuracy"] for r in rows], label=node_dir.name)
    timeline = result["timeline"]
    ax_cons.semilogy(
        [p["t"] for p in timeline], [max(p["consensus_distance"], 1e-12) for p in timeline], "k.-"
    )
    ax_loss.set(title="training loss", xlabel="time (s)", yscale="log")
    ax_acc.set(title="test accuracy", xlabel="time (s)", ylim=(0, 1))
    ax_cons.set(title="consensus distance max‖xᵢ−x̄‖/‖x̄‖", xlabel="time (s)")
    for ax in (ax_loss, ax_acc):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    ax_cons.grid(alpha=0.3, which="both")
    fig.suptitle(
        f"gossipd {result['protocol']} · {result['job']} · {len(node_dirs)} nodes", fontsize=11
    )
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
