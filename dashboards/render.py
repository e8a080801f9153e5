"""Draw a few of the dashboard's panels from a running Prometheus into a PNG, with matplotlib.

``python dashboards/render.py --prometheus URL --start UNIX --end UNIX [--out docs/dashboard.png]``

Why not a Grafana screenshot: that needs a Grafana server and a headless browser
(the image renderer plugin). This runs the dashboard's own PromQL (read from
``dashboards/gossipd.json``, so the picture cannot drift from the panels) as range
queries and plots the answers; the figure says so, so nobody mistakes it for Grafana.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after use("Agg"): the backend must be chosen first

HERE = Path(__file__).resolve().parent
DASHBOARD = HERE / "gossipd.json"
DEFAULT_OUT = HERE.parent / "docs" / "dashboard.png"
PANELS = (
    "Steps per second",
    "Training loss",
    "Test accuracy",
    "Sum of weights per segment (mesh total)",
    "Bytes per second by direction and kind",
    "Push time vs step time (p50)",
)
# Unit ids from the dashboard, as axis labels (and a scale for bytes).
UNITS: dict[str, tuple[str, float]] = {
    "s": ("seconds", 1.0),
    "ops": ("per second", 1.0),
    "reqps": ("requests per second", 1.0),
    "Bps": ("KiB per second", 1 / 1024),
    "percentunit": ("fraction", 1.0),
    "short": ("", 1.0),
}


def substitute(expr: str, rate_interval: str) -> str:
    """``expr`` with the dashboard's variables set to 'every mesh, every node'."""
    values = {"__rate_interval": rate_interval, "mesh": ".*", "node": ".*", "job": ".*"}
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: values[m.group(1) or m.group(2)], expr)


def legend(template: str, labels: dict[str, str]) -> str:
    """Grafana's ``{{label}}`` legend format, filled in from one series' labels."""
    text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)
    return text.strip() or json.dumps(labels)


def range_query(url: str, expr: str, start: float, end: float, step_s: float) -> list[Any]:
    query = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step_s})
    with urllib.request.urlopen(f"{url}/api/v1/query_range?{query}", timeout=30) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise RuntimeError(f"Prometheus refused {expr!r}: {body}")
    return body["data"]["result"]


def panels_by_title(dashboard: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            found[p["title"]] = p
            walk(p.get("panels", []))

    walk(dashboard["panels"])
    return found


def render(
    url: str, start: float, end: float, out: Path, step_s: float, rate_interval: str, note: str
) -> None:
    panels = panels_by_title(json.loads(DASHBOARD.read_text()))
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5), constrained_layout=True)
    for ax, title in zip(axes.flat, PANELS, strict=True):
        panel = panels[title]
        unit, scale = UNITS.get(panel["fieldConfig"]["defaults"].get("unit", "short"), ("", 1.0))
        lines = 0
        for target in panel["targets"]:
            expr = substitute(target["expr"], rate_interval)
            for series in range_query(url, expr, start, end, step_s):
                ts = [float(t) - start for t, _ in series["values"]]
                ys = [float(v) * scale for _, v in series["values"]]
                ax.plot(
                    ts, ys, linewidth=1.2, label=legend(target["legendFormat"], series["metric"])
                )
                lines += 1
        custom = panel["fieldConfig"]["defaults"].get("custom", {})
        if lines and custom.get("scaleDistribution", {}).get("type") == "log":
            ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("seconds since start", fontsize=8)
        ax.set_ylabel(unit, fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if lines:
            ax.legend(fontsize=6, ncol=2 if lines > 4 else 1, loc="best")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(start))
    fig.suptitle(
        "gossipd dashboard panels, rendered with matplotlib from the dashboard's Prometheus "
        f"queries (not a Grafana screenshot)\n{note}, {stamp}",
        fontsize=11,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090", help="base URL")
    parser.add_argument("--start", type=float, help="Unix time (default: --end minus 5 min)")
    parser.add_argument("--end", type=float, help="Unix time (default: now)")
    parser.add_argument("--step-s", type=float, default=2.0, help="range query resolution")
    parser.add_argument(
        "--rate-interval", default="10s", help="stands for $__rate_interval (4 scrapes or more)"
    )
    parser.add_argument("--note", default="local mesh", help="what ran, for the figure title")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    end = args.end if args.end is not None else time.time()
    start = args.start if args.start is not None else end - 300
    render(args.prometheus, start, end, args.out, args.step_s, args.rate_interval, args.note)
    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
