"""`gossipd status`: one Status RPC, returned as plain data for humans and scripts."""

from __future__ import annotations

import math
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gossipd.node.errors import GossipdError
from gossipd.node.net.relay.routes import Routes
from gossipd.node.net.wire.calls import gossip_calls
from gossipd.node.net.wire.grpc_options import CHANNEL_OPTIONS
from gossipd.node.shared.relay_address import is_relayed
from gossipd.node.shared.tls import Credentials
from gossipd.proto import gossip_pb2 as pb


def status_dict(reply: pb.StatusReply) -> dict[str, Any]:
    return {
        "node_id": reply.node_id,
        "mesh_id": reply.mesh_id,
        "protocol": reply.protocol,
        "step": reply.step,
        "loss": reply.loss,
        "sum_weights": list(reply.sum_weights),
        "live_peers": list(reply.live_peers),
        "fingerprint": reply.fingerprint,
        "params_checksum": reply.params_checksum,
        "pushes_in_flight": reply.pushes_in_flight,
        "training_done": reply.training_done,
        "pushes_acked": reply.pushes_acked,
        "pushes_failed": reply.pushes_failed,
        "pushes_merged": reply.pushes_merged,
        "peers": [
            {"node_id": p.node_id, "address": p.address, "incarnation": p.incarnation}
            for p in reply.peers
        ],
        "suspected_peers": list(reply.suspected_peers),
        "rejected": dict(reply.rejected),
        "reserved_weights": list(reply.reserved_weights),
        "weight_cut": reply.weight_cut,
        "round": reply.round,
        "membership_epoch": reply.membership_epoch,
        "transport_security": reply.transport_security,
        "reach": reply.reach or "direct",
        "relay_bytes": reply.relay_bytes,
        "exchanged": {
            m.node_id: {
                "sent": m.sent,
                "received": m.received,
                "sent_before": m.sent_before,
                "received_before": m.received_before,
                "incarnation": m.incarnation,
            }
            for m in reply.exchanged
        },
        "mass_inconsistencies": reply.mass_inconsistencies,
        "wait_s": reply.wait_s,
        "wait_fraction": reply.wait_fraction,
        "scheduling": reply.scheduling,
        "eval": dict(reply.eval),
        "eval_step": reply.eval_step,
        "model_sketch": list(reply.model_sketch),
        "pulls": dict(reply.pulls),
        "ranks": reply.ranks,
        "crash": {
            "resumed": reply.crash.resumed,
            "done": reply.crash.done,
            "weight_lost": reply.crash.weight_lost,
            "merged_after": reply.crash.merged_after,
            "sent_after": reply.crash.sent_after,
            "peers_answered": reply.crash.peers_answered,
            "peers_asked": reply.crash.peers_asked,
            "checkpoint_step": reply.crash.checkpoint_step,
        },
    }


async def check_health(
    address: str, timeout_s: float = 5.0, *, tls: Credentials | None = None
) -> str:
    """The node's answer to the standard gRPC health check (``SERVING`` when it serves).

    Cheap enough for a container's HEALTHCHECK every few seconds: unlike Status
    with a checksum, it copies nothing.
    """
    tls = tls or Credentials(insecure=True)
    async with tls.channel(address, CHANNEL_OPTIONS) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as err:
            raise GossipdError(
                f"no health answer from {address}: {err.code().name}: {err.details()}"
            ) from None
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


async def query_status(
    address: str,
    timeout_s: float = 5.0,
    *,
    checksum: bool = False,
    sketch_size: int = 0,
    tls: Credentials | None = None,
    routes: Routes | None = None,
) -> dict[str, Any]:
    """One node's status; ``checksum`` also hashes its model, ``sketch_size`` sketches it
    (:mod:`gossipd.node.model.sketch`; each costs a model copy).

    ``tls``: a certificate of the node's mesh (any site's will do); None: plaintext.
    ``routes``: how a relayed address (``relay://...``) is reached; one made for this
    call if none is given.
    """
    tls = tls or Credentials(insecure=True)
    if routes is None and is_relayed(address):
        routes = Routes(tls)
        try:
            return await query_status(
                address,
                timeout_s,
                checksum=checksum,
                sketch_size=sketch_size,
                tls=tls,
                routes=routes,
            )
        finally:
            await routes.close()
    target = routes.target(address) if routes is not None else address
    async with tls.channel(target, CHANNEL_OPTIONS) as channel:
        try:
            reply = await gossip_calls(channel).Status(
                pb.StatusRequest(checksum=checksum, sketch_size=sketch_size), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as err:
            hint = (
                "is a gossipd node listening there? With TLS, pass --config SITE.toml (or "
                "--ca/--cert/--key) of a site of that mesh"
            )
            raise GossipdError(
                f"no status from {address}: {err.code().name}: {err.details()}; {hint}"
            ) from None
    return status_dict(reply)


def _number(value: float) -> str:
    return f"{value:.6g}"


def _weights(values: list[float]) -> str:
    """Per-segment values: one number when all are equal, else each of them."""
    if not values:
        return "–"
    if max(values) - min(values) < 1e-12:
        return f"{_number(values[0])} (all {len(values)} segments)"
    return " ".join(_number(v) for v in values)


def _exchange_rows(status: dict[str, Any]) -> list[tuple[str, str]]:
    """What this node's protocol exchanges, in its own terms: a pulling core (its ``pulls``
    counted by outcome) keeps no sum-weights and pushes nothing, so it shows its pulls,
    the trainer's waits for them and who schedules them instead of push counters."""
    pulls = status["pulls"]
    if not pulls:
        rows = [
            ("sum-weight", _weights(status["sum_weights"])),
            ("reserved", _weights(status["reserved_weights"])),
            (
                "pushes",
                f"{status['pushes_acked']} acknowledged, {status['pushes_failed']} failed, "
                f"{status['pushes_merged']} merged here, {status['pushes_in_flight']} in flight",
            ),
            ("mass issues", str(status["mass_inconsistencies"])),
        ]
        if status.get("weight_cut"):
            cut = f"{_number(status['weight_cut'])} (pushes over the cap: see the INFO log)"
            rows.append(("weight cut", cut))
        return rows
    skipped = pulls.get("skipped", 0)
    scheduled = (
        f"{pulls.get('coordinator', 0)} periods from the coordinator, "
        f"{pulls.get('alone', 0)} scheduled alone"
    )
    if pulls.get("fallback", 0):
        scheduled += f" ({pulls['fallback']} times the coordinator did not answer)"
    return [
        (
            "pulls",
            f"{pulls.get('merged', 0)} merged, {pulls.get('failed', 0)} failed "
            f"({pulls.get('repicked', 0)} re-picked another peer), "
            f"{skipped} period{'' if skipped == 1 else 's'} skipped (no peer free)",
        ),
        (
            "waits",
            f"{status['wait_s']:.1f} s for pulls at step boundaries "
            f"({status['wait_fraction']:.1%} of training time)",
        ),
        ("scheduling", f"{status['scheduling'] or '– (no period yet)'}; {scheduled}"),
    ]


def _ranks_row(status: dict[str, Any]) -> list[tuple[str, str]]:
    """A site of several processes says so: its step is each rank's, its data theirs."""
    ranks = status["ranks"]
    if ranks <= 1:
        return []
    return [("ranks", f"{ranks} processes train this site; rank 0 gossips for them")]


def _evaluation(status: dict[str, Any]) -> str:
    """The last evaluation's metrics (test accuracy among them) and the step it was at."""
    metrics = status["eval"]
    if not metrics:
        return "– (no evaluation yet)"
    values = ", ".join(f"{k} {_number(v)}" for k, v in sorted(metrics.items()))
    return f"{values} (step {status['eval_step']})"


def describe_restart(crash: dict[str, Any]) -> str | None:
    """What this incarnation's restart from a checkpoint cost the mesh, as the restart audit
    (:mod:`gossipd.node.net.status.restart_audit`) has it so far; None if it did not resume."""
    if not crash["resumed"]:
        return None
    resumed = f"restarted from its checkpoint of step {crash['checkpoint_step']}"
    if not crash["done"]:
        return (
            f"{resumed}: its cost is being read from its peers ({crash['peers_answered']} of "
            f"{crash['peers_asked']} so far)"
        )
    return (
        f"{resumed}: cost the mesh {crash['weight_lost']:.6g} of sum-weight per segment "
        f"(from {crash['peers_answered']} of {crash['peers_asked']} peers' accounts)"
    )


def render_status(status: dict[str, Any]) -> str:
    """`gossipd status` for a person: the node's state, then one row per known peer."""
    rejected = ", ".join(f"{k} {v}" for k, v in sorted(status["rejected"].items())) or "none"
    restart = describe_restart(status["crash"])
    rows = [
        ("node", f"{status['node_id']} (mesh {status['mesh_id']}, {status['protocol']})"),
        ("security", status["transport_security"] or "–"),
        ("reach", status["reach"]),
        ("step", f"{status['step']}" + (" (training done)" if status["training_done"] else "")),
        *_ranks_row(status),
        ("loss", "– (no step yet)" if math.isnan(status["loss"]) else _number(status["loss"])),
        ("test", _evaluation(status)),
        ("round", str(status["round"])),
        *_exchange_rows(status),
        ("refused", rejected),
        *([("restart", restart)] if restart is not None else []),
        ("fingerprint", status["fingerprint"]),
        ("checksum", status["params_checksum"] or "–"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    live, suspected = set(status["live_peers"]), set(status["suspected_peers"])
    header = ("peer", "address", "incarnation", "state", "weight sent", "weight received")
    table = [header]
    for peer in sorted(status["peers"], key=lambda p: p["node_id"]):
        node_id = peer["node_id"]
        state = "suspected" if node_id in suspected else "live" if node_id in live else "known"
        mass = status["exchanged"].get(node_id, {})
        table.append(
            (
                node_id,
                peer["address"],
                str(peer["incarnation"]),
                state,
                _number(mass.get("sent", 0.0)),
                _number(mass.get("received", 0.0)),
            )
        )
    lines.append("")
    if len(table) == 1:
        lines.append("peers: none yet")
        return "\n".join(lines)
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)
