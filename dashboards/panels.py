"""What the gossipd dashboard shows: its rows and panels, their PromQL and descriptions, as data.

The overlap protocol's rows (waits, coordinator) are in ``overlap_panels.py``; ``build.py``
lists the rows in order, turns them into Grafana's JSON; ``render.py`` reads that JSON back.
Keeping the queries here, apart from the SDK calls, puts every "what does this
panel mean" in one place a reader can review without knowing Grafana's model.

Node names come from ``gossipd_node_info`` by a join, not from scrape relabeling:
every query multiplies by ``gossipd_node_info`` (value 1) ``on (job, instance)``
and takes its ``node_id``. The name is then the one the node itself reports (the
one in its logs, ``gossipd status`` and its certificate), it follows the node
when its address changes, and the dashboard works with whatever scrape config or
service discovery an operator already has, with no label to keep in sync by hand.
The same join filters by the ``$mesh`` and ``$node`` variables. The cost is
longer PromQL, written once by :func:`per_node` and :func:`quantile`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

INFO = 'gossipd_node_info{mesh_id=~"$mesh", node_id=~"$node"}'
MESH_INFO = 'gossipd_node_info{mesh_id=~"$mesh"}'
RATE = "$__rate_interval"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = "{{node_id}}"


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    queries: list[Query]
    unit: str = "short"
    kind: str = "timeseries"  # or "table" (one instant query, one row per series)
    width: int = 8
    no_value: str | None = None
    log_scale: bool = False  # for series that differ by orders of magnitude


@dataclass(frozen=True)
class Row:
    title: str
    panels: list[Panel] = field(default_factory=list)


# A node's sum-weight, averaged over its segments and the rate window.
NODE_WEIGHT = f"avg by (job, instance) (avg_over_time(gossipd_sum_weight[{RATE}]))"


def per_node(expr: str, by: str = "") -> str:
    """``expr`` summed per node (and the ``by`` labels), named by the node's own node_id."""
    labels = f"node_id, {by}" if by else "node_id"
    return f"sum by ({labels}) (({expr}) * on (job, instance) group_left (node_id) {INFO})"


def quantile(q: float, histogram: str) -> str:
    """The ``q`` quantile of ``histogram`` per node, over the rate window."""
    return f"histogram_quantile({q}, {per_node(f'rate({histogram}_bucket[{RATE}])', 'le')})"


def quantiles(histogram: str, qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> list[Query]:
    return [Query(quantile(q, histogram), f"{{{{node_id}}}} p{round(q * 100)}") for q in qs]


MESH_OVERVIEW = Row(
    "Mesh overview",
    [
        Panel(
            "Nodes",
            "One row per scraped node, from gossipd_node_info. Nodes whose fingerprint (model "
            "layout) or protocol differ never merge each other's pushes: their dials fail as "
            "'mismatch' (Health row).",
            [Query(INFO, "")],
            kind="table",
            width=12,
        ),
        Panel(
            "Live and suspected peers",
            "Peers each node considers live (verified, pushed to) and suspected (failed recently, "
            "not pushed to; declared dead after membership.drop_after_s). In a full mesh of N "
            "nodes every node sees N-1 live.",
            [
                Query(per_node("gossipd_live_peers"), "{{node_id}} live"),
                Query(per_node("gossipd_suspected_peers"), "{{node_id}} suspected"),
            ],
            width=12,
        ),
        Panel(
            "Sum of weights per segment (mesh total)",
            "Σ over the nodes of the mesh (not filtered by $node) of each segment's sum-weight, "
            "as a bracket. Sum-weight gossip conserves it: at rest it equals the number of nodes "
            "that started with weight 1 (a joiner starts at 0). A share pushed but not yet "
            "acknowledged is still counted by its sender (gossipd_sum_weight_reserved) while "
            "its receiver may have merged it, so the true total lies between the lower line, "
            "Σ(weight − reserved), and the upper, Σ weight; at rest the two meet. Each node's "
            "values are averaged over the rate window (nodes publish at their own step "
            "boundaries and are scraped at slightly different moments). A lasting drift of "
            "both lines means weight was lost or duplicated.",
            [
                Query(
                    f"sum by (segment) (avg_over_time(gossipd_sum_weight[{RATE}]) "
                    f"* on (job, instance) group_left () {MESH_INFO})",
                    "segment {{segment}} Σ weight",
                ),
                Query(
                    f"sum by (segment) ((avg_over_time(gossipd_sum_weight[{RATE}]) "
                    f"- avg_over_time(gossipd_sum_weight_reserved[{RATE}])) "
                    f"* on (job, instance) group_left () {MESH_INFO})",
                    "segment {{segment}} Σ(weight − reserved)",
                ),
            ],
        ),
        Panel(
            "Round",
            "The protocol core's round on each node. Rounds advance with local steps "
            "(gossip.round_steps); nodes may drift a few rounds apart, nothing waits.",
            [Query(per_node("gossipd_round"))],
        ),
        Panel(
            "Distinct membership views",
            "How many different views of the live members the nodes of the mesh hold "
            "(gossipd_membership_epoch is a digest of the view). 1: every node agrees; more "
            "for a while after a join, leave or failure, until gossip converges.",
            [
                Query(
                    'count(count_values("epoch", gossipd_membership_epoch * on (job, instance) '
                    f"group_left () {MESH_INFO}))",
                    "views",
                )
            ],
        ),
        Panel(
            "Weight share per site (1 = its fair share)",
            "Each node's sum-weight (averaged over its segments) over the mean of the mesh's "
            "nodes: 1 when it holds its fair share. A node's weight is how much its model, and "
            "so its data, counts in every merge, so a node far above 1 for long makes the "
            "consensus its own; one near 0 barely counts. Sites that push less often than the "
            "others (slower steps, a CPU budget that holds pushes) gather weight. Sum-weight "
            "protocols only.",
            [
                Query(
                    f"{per_node(NODE_WEIGHT)} / scalar(avg({NODE_WEIGHT} "
                    f"* on (job, instance) group_left () {MESH_INFO}))",
                )
            ],
        ),
    ],
)

TRAINING = Row(
    "Training (per site)",
    [
        Panel(
            "Steps per second",
            "Local optimizer steps per second (gossipd_steps_total counts this process's "
            "steps, so a restart is an ordinary counter reset).",
            [Query(per_node(f"rate(gossipd_steps_total[{RATE}])"))],
            unit="ops",
        ),
        Panel(
            "Step (progress)",
            "gossipd_step: the node's step over its whole life, continuing from its "
            "checkpoint after a restart.",
            [Query(per_node("gossipd_step"))],
        ),
        Panel(
            "Samples per second",
            "Training samples per second (steps x batch size).",
            [Query(per_node(f"rate(gossipd_samples_total[{RATE}])"))],
            unit="ops",
        ),
        Panel(
            "Training loss",
            "Loss of each node's last step, on its own batch: noisy by nature.",
            [Query(per_node("gossipd_loss"))],
        ),
        Panel(
            "Test accuracy",
            "gossipd_eval{metric=test_accuracy}: the job's evaluation every job.eval_every_steps "
            "(classification jobs only; a regression job reports test_loss).",
            [Query(per_node('gossipd_eval{metric="test_accuracy"}'))],
            unit="percentunit",
        ),
        Panel(
            "Step time quantiles",
            "Wall time of one local step including the gossip bookkeeping, p50/p90/p99 over the "
            "rate window.",
            quantiles("gossipd_step_seconds"),
            unit="s",
        ),
    ],
)

GOSSIP = Row(
    "Gossip traffic",
    [
        Panel(
            "Bytes per second by direction and kind",
            "Payload bytes (all results) sent and received, by kind: push, pull, handoff (a "
            "leaving node's weight).",
            [
                Query(
                    per_node(f"rate(gossipd_gossip_bytes_total[{RATE}])", "direction, kind"),
                    "{{node_id}} {{direction}} {{kind}}",
                )
            ],
            unit="Bps",
        ),
        Panel(
            "Messages per second by direction and kind",
            "Messages (all results) by direction and kind; a refused inbound request counts as "
            "received, kind 'request', result 'rejected'.",
            [
                Query(
                    per_node(f"rate(gossipd_gossip_messages_total[{RATE}])", "direction, kind"),
                    "{{node_id}} {{direction}} {{kind}}",
                )
            ],
            unit="reqps",
        ),
        Panel(
            "Failed and retried sends",
            "Outbound messages that failed (weight folded back) or were retried, per second. "
            "A healthy mesh has none, so this panel shows an explicit 0 per node when nothing "
            "failed, rather than no data.",
            [
                Query(
                    per_node(
                        "rate(gossipd_gossip_messages_total"
                        f'{{direction="sent", result=~"failed|retry"}}[{RATE}])',
                        "result",
                    )
                    + f" or on (node_id) sum by (node_id) (0 * {INFO})",
                    "{{node_id}} {{result}}",
                )
            ],
            unit="reqps",
        ),
        Panel(
            "Push time quantiles",
            "One outbound push from its first attempt until it settled (acknowledged or folded "
            "back), retries included.",
            quantiles("gossipd_push_seconds"),
            unit="s",
        ),
        Panel(
            "Merges per second",
            "Segments merged into the local model per second.",
            [Query(per_node(f"rate(gossipd_merges_total[{RATE}])"))],
            unit="ops",
        ),
        Panel(
            "Pushes in flight",
            "Outbound pushes not yet settled (bounded by gossip.max_pushes_in_flight).",
            [Query(per_node("gossipd_pushes_in_flight"))],
        ),
    ],
)

HEALTH = Row(
    "Health and rejections",
    [
        Panel(
            "Rejected payloads by reason",
            "Inbound requests refused per second, by reason (every limit's and validation's "
            "refusals: InvalidFrame, PayloadTooLarge, MeshMismatch, UnknownPeer, Busy, ...).",
            [
                Query(
                    per_node(f"rate(gossipd_rejected_payloads_total[{RATE}])", "reason"),
                    "{{node_id}} {{reason}}",
                )
            ],
            unit="reqps",
            no_value="none since the node started",
        ),
        Panel(
            "Dial failures by reason",
            "Handshakes this node made that failed, per second: tls (certificate refused, wrong "
            "CA), unreachable, mismatch (other mesh, model or protocol: a config to fix), other.",
            [
                Query(
                    per_node(f"rate(gossipd_dial_failures_total[{RATE}])", "reason"),
                    "{{node_id}} {{reason}}",
                )
            ],
            unit="reqps",
            no_value="none since the node started",
        ),
        Panel(
            "Checkpoint age",
            "Seconds since each node's newest good checkpoint.pt (nodes that have written none "
            "yet are not shown). Alert when it exceeds a few checkpoint.every_steps intervals.",
            [Query(per_node("time() - (gossipd_checkpoint_last_success_timestamp_seconds > 0)"))],
            unit="s",
        ),
        Panel(
            "Weight a restart cost the mesh",
            "Sum-weight per segment that each node's last restart from its checkpoint cost the "
            "mesh: what its previous incarnation held that the checkpoint lacked, read from its "
            "peers' accounts after the restart (negative: weight added; 0 for a node that did "
            "not resume). The mesh's total stays off by this much; checkpoint more often "
            "(checkpoint.every_steps) to lose less.",
            [Query(per_node("gossipd_restart_weight_lost"))],
        ),
        Panel(
            "Checkpoint failures (since start)",
            "Checkpoint writes that failed (disk full, read-only, I/O error) since the process "
            "started; the previous checkpoint stays and training goes on.",
            [Query(per_node("gossipd_checkpoint_failures_total"))],
        ),
        Panel(
            "Checkpoint write time (p90)",
            "Wall time of one successful checkpoint write (capture, serialize, fsync, rename).",
            quantiles("gossipd_checkpoint_write_seconds", (0.9,)),
            unit="s",
        ),
        Panel(
            "Scrape targets up",
            "Prometheus's own up series for the jobs that export gossipd metrics: 0 means the "
            "node's metrics endpoint did not answer (the node is down or metrics.listen moved).",
            [Query('up{job=~"$job"}', "{{instance}}")],
        ),
    ],
)
