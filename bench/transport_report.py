"""What `gossipd bench transport` prints and writes: its tables, plot and JSON summary.

The measurements live in :mod:`gossipd.bench.transport` (goodput),
:mod:`gossipd.bench.push_cost` (the fixed cost of one push) and
:mod:`gossipd.bench.trainer_overhead` (steps gossip takes from a trainer); this
module only turns their rows into what a person reads and what a script parses.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any, TextIO

import torch


def row(method: str, settings: str, times: list[float], nbytes: int = 0) -> dict[str, Any]:
    """One goodput row: a method, its settings, the timed repetitions and bytes moved."""
    return {"method": method, "settings": settings, "times_s": times, "nbytes": nbytes}


def finish(rows: list[dict[str, Any]], nbytes: int) -> None:
    """Derive each row's GB/s (best, median) and its ratio to the raw TCP row, in place."""
    raw = next((r for r in rows if r["method"] == "raw TCP"), None)
    raw_best = max(nbytes / t for t in raw["times_s"]) / 1e9 if raw else float("nan")
    for r in rows:
        r["nbytes"] = r["nbytes"] or nbytes
        rates = [r["nbytes"] / t / 1e9 for t in r["times_s"]]
        r["gbps_best"] = max(rates)
        r["gbps_median"] = statistics.median(rates)
        r["ratio_vs_raw_tcp"] = r["gbps_best"] / raw_best


def print_table(rows: list[dict[str, Any]], file: TextIO = sys.stdout) -> None:
    width = max(len(r["settings"]) for r in rows)
    mw = max(16, *(len(r["method"]) for r in rows))
    head = f"{'method':<{mw}} {'settings':<{width}} {'GB/s best':>9} {'median':>7} {'vs TCP':>6}"
    print(head, file=file)
    print("-" * len(head), file=file)
    for r in rows:
        print(
            f"{r['method']:<{mw}} {r['settings']:<{width}} {r['gbps_best']:>9.2f} "
            f"{r['gbps_median']:>7.2f} {r['ratio_vs_raw_tcp']:>6.2f}",
            file=file,
        )


def best_push(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return max((r for r in rows if r["method"] == "gossipd push"), key=lambda r: r["gbps_best"])


def print_verdicts(rows: list[dict[str, Any]], file: TextIO) -> None:
    """The lines under the table: the best push against raw TCP, each mTLS push against plain."""
    best = best_push(rows)
    print(
        f"best gossipd push: {best['ratio_vs_raw_tcp']:.2f} x raw TCP ({best['settings']})",
        file=file,
    )
    for r in rows:
        if r["method"] == "gossipd push (mTLS)":
            plain = next(
                p for p in rows if p["method"] == "gossipd push" and p["settings"] == r["settings"]
            )
            print(
                f"mTLS push: {r['gbps_best'] / plain['gbps_best']:.2f} x plaintext push "
                f"({r['settings']})",
                file=file,
            )
    for r in rows:
        name = r["method"]
        framed_name = name.replace(")", ", frames)") if "(" in name else f"{name} (frames)"
        framed = next(
            (f for f in rows if f["method"] == framed_name and f["settings"] == r["settings"]),
            None,
        )
        if framed is not None and "frames" not in name:
            print(
                f"{name} on the bulk lane: {r['gbps_best'] / framed['gbps_best']:.2f} x "
                f"in gRPC frames ({r['settings']})",
                file=file,
            )


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['method']}\n{r['settings']}" for r in rows]
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(rows) + 1.5))
    y = range(len(rows))
    ax.barh(y, [r["gbps_best"] for r in rows], color="tab:blue", label="best")
    ax.barh(y, [r["gbps_median"] for r in rows], color="tab:orange", height=0.4, label="median")
    raw = [r["gbps_best"] for r in rows if r["method"] == "raw TCP"]
    if raw:
        ax.axvline(raw[0] / 2, color="gray", linestyle="--", label="half of raw TCP")
    ax.set_yticks(list(y), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("goodput, GB/s (model bytes / wall time)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def machine() -> dict[str, Any]:
    """Where a run was measured: the date and the machine, for every JSON summary."""
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "load_avg_1m": os.getloadavg()[0],
            "python": platform.python_version(),
            "torch": torch.__version__,
            "grpcio": importlib.metadata.version("grpcio"),
        },
    }


def summary(
    rows: list[dict[str, Any]],
    push_cost: list[dict[str, Any]],
    nbytes: int,
    tensor_bytes: int,
    reps: int,
    notes: list[str],
) -> dict[str, Any]:
    """The goodput run's JSON line: the headline ratios, every row, the per-push cost rows."""
    best = best_push(rows)
    by_method: dict[str, float] = {}
    for r in rows:
        by_method[r["method"]] = max(by_method.get(r["method"], 0.0), r["gbps_best"])
    bare = by_method.get("grpc.aio bare")
    return {
        "ratio_vs_raw_tcp": best["ratio_vs_raw_tcp"],
        "ratio_vs_grpc_aio_bare": best["gbps_best"] / bare if bare else None,
        "best_push_settings": best["settings"],
        "gbps": {m.replace(" ", "_"): v for m, v in by_method.items()},
        "model_bytes": nbytes,
        "tensor_bytes": tensor_bytes,
        "reps": reps,
        "rows": rows,
        "push_cost": push_cost,
        "notes": notes,
        **machine(),
    }
