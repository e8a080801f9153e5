"""`gossipd status --mesh`: the whole mesh from one site's address, read at one instant.

An operator asking "is my mesh healthy, who holds the weight, what did that crash
cost" had to scrape every site and sum ``gossipd_sum_weight`` by hand; read one site
after another, the sum is wrong by whatever moved between the reads (2.327 for a mesh
of 3 that held 3.000000). So this asks one site for its verified peers, then asks every
site at once, and says how far apart the answers were taken.

The sum is bracketed: a pushed share stays in its sender's weight until the receiver
acknowledges it (:mod:`gossipd.node.protocols.reservations`), so at any instant the
mesh's true Σw lies between the sites' weights less what they have in flight and their
weights as held. Models are compared through count sketches
(:mod:`gossipd.node.model.sketch`), so no model crosses the operator's link.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from gossipd.node.errors import GossipdError
from gossipd.node.net.relay.routes import Routes
from gossipd.node.net.status.query import describe_restart, query_status
from gossipd.node.shared.tls import Credentials

# Buckets of each site's count sketch: this module asks for them and never computes one,
# so it names the size here instead of importing the sketch's module, which loads torch.
DEFAULT_SKETCH_SIZE = 4_096
_COLUMNS: tuple[str, ...] = ("site", "weight", "share", "distance", "step", "behind", "loss")
_COLUMNS += ("test", "activity", "reach")


async def query_mesh(
    address: str,
    timeout_s: float = 5.0,
    *,
    tls: Credentials | None = None,
    sketch_size: int = DEFAULT_SKETCH_SIZE,
) -> dict[str, Any]:
    """Every site the node at ``address`` knows, asked at once, and the mesh's figures."""
    tls = tls or Credentials(insecure=True)
    routes = Routes(tls)  # sites behind NAT are asked through their relays
    try:
        return await _query_mesh(address, timeout_s, tls, sketch_size, routes)
    finally:
        await routes.close()


async def _query_mesh(
    address: str, timeout_s: float, tls: Credentials, sketch_size: int, routes: Routes
) -> dict[str, Any]:
    entry = await query_status(address, timeout_s, tls=tls, routes=routes)
    addresses = {entry["node_id"]: address}
    for peer in entry["peers"]:
        addresses.setdefault(peer["node_id"], peer["address"])

    async def ask(node_id: str, where: str) -> tuple[str, dict[str, Any] | str, float]:
        try:
            reply: dict[str, Any] | str = await query_status(
                where, timeout_s, sketch_size=sketch_size, tls=tls, routes=routes
            )
        except GossipdError as err:
            reply = str(err)
        return node_id, reply, time.monotonic()

    started = time.monotonic()
    answers = await asyncio.gather(*(ask(n, a) for n, a in sorted(addresses.items())))
    sites = {n: r for n, r, _ in answers if isinstance(r, dict)}
    unreachable = {
        n: {"address": addresses[n], "error": r} for n, r, _ in answers if isinstance(r, str)
    }
    times = [t for n, _, t in answers if n in sites]
    return {
        "asked": address,
        "read_within_s": (max(times) - started) if times else math.nan,
        **mesh_figures(sites),
        "unreachable": unreachable,
    }


def mesh_figures(sites: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The mesh's Σw with its in-flight bracket, and each site's row."""
    if not sites:
        return {"sum_weight": math.nan, "sum_weight_low": math.nan, "sites": []}
    held = [_mean(s["sum_weights"]) for s in sites.values()]
    in_flight = [_mean(s["reserved_weights"]) for s in sites.values()]
    total = sum(held)
    distances, spread = _distances([s["model_sketch"] for s in sites.values()])
    top_round = max(s["round"] for s in sites.values())
    rows = []
    for (node_id, s), w, r, d in zip(sites.items(), held, in_flight, distances, strict=True):
        rows.append(
            {
                "node_id": node_id,
                "weight": w,
                "in_flight": r,
                "share": w / total if total > 0 else math.nan,
                "distance": d,
                "step": s["step"],
                "round": s["round"],
                "rounds_behind": top_round - s["round"],
                "loss": s["loss"],
                "eval": s["eval"],
                "eval_step": s["eval_step"],
                "protocol": s["protocol"],
                "ranks": s["ranks"],
                "pushes_acked": s["pushes_acked"],
                "pushes_merged": s["pushes_merged"],
                "pulls": s["pulls"],
                "wait_fraction": s["wait_fraction"],
                "scheduling": s["scheduling"],
                "crash": s["crash"],
                "fingerprint": s["fingerprint"],
                "live_peers": len(s["live_peers"]),
                "suspected_peers": len(s["suspected_peers"]),
                "reach": s.get("reach", "direct"),
            }
        )
    return {
        "sum_weight": total,
        "sum_weight_low": total - sum(in_flight),
        "consensus_distance": spread,
        "sites": rows,
    }


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _distances(sketches: Sequence[Sequence[float]]) -> tuple[list[float], float]:
    """Each sketch's distance from the sites' mean over the mean's norm (the launcher's
    consensus distance), and the largest of them; NaN where a site sent no sketch."""
    usable = [s for s in sketches if s]
    if not usable or len({len(s) for s in usable}) != 1:
        return [math.nan] * len(sketches), math.nan
    mean = [sum(column) / len(usable) for column in zip(*usable, strict=True)]
    norm = math.sqrt(sum(v * v for v in mean)) or 1.0
    out = [
        math.sqrt(sum((a - b) ** 2 for a, b in zip(s, mean, strict=True))) / norm if s else math.nan
        for s in sketches
    ]
    return out, max((d for d in out if not math.isnan(d)), default=math.nan)


def _metric(row: Mapping[str, Any]) -> str:
    """The site's headline test metric: accuracy when the job has one, else its first."""
    metrics = row["eval"]
    if not metrics:
        return "–"
    key = next((k for k in metrics if "accuracy" in k), next(iter(sorted(metrics))))
    return f"{metrics[key]:.3f}"


def _activity(row: Mapping[str, Any]) -> str:
    """What the site's protocol does, in its own terms."""
    if row["pulls"]:
        pulls = row["pulls"]
        return (
            f"{pulls.get('merged', 0)} pulls merged, wait {row['wait_fraction']:.0%}, "
            f"{row['scheduling'] or 'decentralized'}"
        )
    return f"{row['pushes_acked']} pushes acked, {row['pushes_merged']} merged"


def render_mesh(mesh: Mapping[str, Any]) -> str:
    """`gossipd status --mesh` for a person: the mesh's sums, then one row per site."""
    rows = mesh["sites"]
    lines = []
    if rows:
        low, high = mesh["sum_weight_low"], mesh["sum_weight"]
        bracket = (
            f"{high:.6f}"
            if high - low < 5e-7
            else f"{low:.6f} to {high:.6f} (pushes in flight count on both ends until acknowledged)"
        )
        protocols = sorted({r["protocol"] for r in rows})
        lines += [
            f"mesh: {len(rows)} sites answered ({', '.join(protocols)}), read within "
            f"{mesh['read_within_s'] * 1000:.0f} ms of each other",
            f"sum-weight (per segment): {bracket}",
            f"consensus distance max‖xᵢ−x̄‖/‖x̄‖ (sketched): {mesh['consensus_distance']:.2e}",
        ]
        if len({r["fingerprint"] for r in rows}) > 1:
            lines.append("WARNING: sites report different model fingerprints: not one mesh's job")
    for node_id, gone in sorted(mesh["unreachable"].items()):
        lines.append(f"unreachable: {node_id} at {gone['address']}: {gone['error']}")
    if not rows:
        return "\n".join(lines or ["no site answered"])
    header = _COLUMNS
    table: list[tuple[str, ...]] = [header]
    for r in sorted(rows, key=lambda r: r["node_id"]):
        name = r["node_id"] + (f" ({r['ranks']} ranks)" if r["ranks"] > 1 else "")
        table.append(
            (
                name,
                f"{r['weight']:.4f}",
                f"{r['share']:.1%}",
                f"{r['distance']:.2e}",
                str(r["step"]),
                f"{r['rounds_behind']} rounds",
                "–" if math.isnan(r["loss"]) else f"{r['loss']:.4f}",
                _metric(r),
                _activity(r),
                r["reach"],
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines.append("")
    lines += [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table
    ]
    for r in sorted(rows, key=lambda r: r["node_id"]):
        restart = describe_restart(r["crash"])
        if restart is not None:
            lines.append(f"{r['node_id']} {restart}")
    return "\n".join(lines)
