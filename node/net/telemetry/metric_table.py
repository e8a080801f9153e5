"""The rows of a node's Prometheus metrics: one :class:`MetricDef` per metric, which
:class:`~gossipd.node.net.telemetry.metrics.NodeMetrics` builds as the row's attribute and
the reference page (docs/reference/metrics.md) lists.

Label values come from small fixed sets (direction, kind, result, reason, metric,
segment index), never from peers: a mesh of any size, or an outsider making up
node ids, cannot grow the number of series. ``gossipd_sum_weight`` has one series
per model segment, which the model fixes.
"""

from __future__ import annotations

from gossipd.node.shared.metric_defs import MetricDef, counter, gauge, histogram

# One row per metric, in the order the reference page lists them.
NODE_METRICS: tuple[MetricDef, ...] = (
    gauge(
        "info",
        "gossipd_node_info",
        "Constant 1, labelled with identity and protocol",
        ("node_id", "mesh_id", "fingerprint", "protocol"),
    ),
    counter(
        "steps",
        "gossipd_steps_total",
        "Local optimizer steps taken by this process (use rate(); see gossipd_step)",
    ),
    gauge(
        "step",
        "gossipd_step",
        "The node's step over its whole life: a restart continues from the checkpoint's",
    ),
    counter("samples", "gossipd_samples_total", "Training samples processed (steps x batch size)"),
    gauge("loss", "gossipd_loss", "Training loss of the last step"),
    histogram(
        "step_seconds",
        "gossipd_step_seconds",
        "Wall time of one local step including the gossip bookkeeping",
        (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    ),
    counter(
        "bytes",
        "gossipd_gossip_bytes_total",
        "Payload bytes by direction (sent, received), kind (push, pull, handoff, settle) "
        "and result",
        ("direction", "kind", "result"),
    ),
    counter(
        "bulk_bytes",
        "gossipd_bulk_bytes_total",
        "Payload bytes this node's bulk lane received (pushes to it) and sent (pulls from "
        "it); the rest of gossipd_gossip_bytes_total went in gRPC frames",
        ("direction",),
    ),
    gauge(
        "bulk_connections",
        "gossipd_bulk_connections",
        "Bulk-lane connections peers hold open to this node",
    ),
    counter(
        "messages",
        "gossipd_gossip_messages_total",
        "Messages by direction, kind (push, pull, handoff, settle; request: a refused inbound "
        "request of any RPC) and result (ok, failed, retry, rejected, leaving: answered by "
        "a leaving node without merging)",
        ("direction", "kind", "result"),
    ),
    histogram(
        "push_seconds",
        "gossipd_push_seconds",
        "One outbound push from its first attempt until it settled (acknowledged or folded "
        "back), retries included",
        (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
    ),
    gauge("pushes_in_flight", "gossipd_pushes_in_flight", "Outbound pushes not yet settled"),
    gauge(
        "gossip_cpu_share",
        "gossipd_gossip_cpu_share",
        "CPU this process spent on gossip (not training) over the last 2 s, as a share of "
        "its cores' time; pushes wait while it is over gossipd_gossip_cpu_budget and the "
        "trainer steps",
    ),
    gauge(
        "gossip_cpu_budget",
        "gossipd_gossip_cpu_budget",
        "Most of the node's CPU gossip may take while the trainer steps (gossip.cpu_share)",
    ),
    counter(
        "pushes_held",
        "gossipd_pushes_held_total",
        "Outbound pushes that waited for gossip's CPU budget before going (throttled)",
    ),
    counter(
        "push_held_seconds",
        "gossipd_push_held_seconds_total",
        "Seconds outbound pushes waited for gossip's CPU budget",
    ),
    counter(
        "rejected",
        "gossipd_rejected_payloads_total",
        "Inbound payloads refused, by reason",
        ("reason",),
    ),
    counter(
        "merges", "gossipd_merges_total", "Segments merged into the local model (pushed or pulled)"
    ),
    counter(
        "merges_clipped",
        "gossipd_merges_clipped_total",
        "Merged segments pulled toward this node's own first (limits.clip_factor, "
        "limits.merge_clip); honest traffic keeps it near 0",
    ),
    gauge(
        "inbound_push_streams",
        "gossipd_inbound_push_streams",
        "Inbound push streams open now (limits.max_inbound_pushes; one peer may hold "
        "limits.max_inbound_pushes_per_peer of them)",
    ),
    gauge(
        "inbound_pull_streams",
        "gossipd_inbound_pull_streams",
        "Pulls this node serves now (limits.max_inbound_pulls; one peer may hold "
        "limits.max_inbound_pulls_per_peer of them)",
    ),
    gauge(
        "peers_in_open_backoff",
        "gossipd_peers_in_open_backoff",
        "Peers whose new push streams this node refuses now (TooManyOpens) for opening them "
        "faster than limits.max_stream_opens_per_s; an honest site is never one",
    ),
    counter(
        "mass_inconsistencies",
        "gossipd_mass_inconsistencies_total",
        "Answers that contradict this node's record of its pushes (kind duplicate_never_sent:"
        " a DUPLICATE for a segment never sent before); the weight is kept, not committed",
        ("kind",),
    ),
    gauge("sum_weight", "gossipd_sum_weight", "Sum-weight per segment", ("segment",)),
    gauge(
        "weight_sinks",
        "gossipd_weight_sinks",
        "Peers suspected of sinking weight (took this node's weight, gave none back; "
        "limits.sink_score_bound): this node pushes nothing to them",
    ),
    gauge(
        "push_balance_factor",
        "gossipd_push_balance_factor",
        "Per segment, the factor on what this site's pushes carry (gossip.weight_balance): "
        "under 1 while it has held less weight than the mesh's per site",
        ("segment",),
    ),
    gauge(
        "sum_weight_cap",
        "gossipd_sum_weight_cap",
        "The most sum-weight a segment may hold after a merge (limits.max_sum_weight, or "
        "twice the number of founding members): a push is merged with the part of its "
        "weight that fits, one heavier than the cap alone is refused as WeightOverCap",
    ),
    gauge(
        "sum_weight_cut",
        "gossipd_sum_weight_cut",
        "Sum-weight of merged pushes that did not fit under gossipd_sum_weight_cap since "
        "start, summed over segments: acknowledged and gone (honest sites never reach the cap)",
    ),
    gauge(
        "sum_weight_reserved",
        "gossipd_sum_weight_reserved",
        "Sum-weight per segment promised to pushes not yet acknowledged; still counted in "
        "gossipd_sum_weight until the ack, and at the receiver once merged: the mesh's "
        "true total lies between sum(gossipd_sum_weight - this) and sum(gossipd_sum_weight)",
        ("segment",),
    ),
    gauge("live_peers", "gossipd_live_peers", "Peers currently considered live"),
    gauge(
        "suspected_peers",
        "gossipd_suspected_peers",
        "Verified peers that failed recently (not pushed to; declared dead after "
        "membership.drop_after_s)",
    ),
    gauge(
        "membership_epoch",
        "gossipd_membership_epoch",
        "Digest of this node's view of the live members: equal on nodes whose views agree",
    ),
    gauge("round", "gossipd_round", "The protocol core's current round"),
    gauge(
        "wait_seconds",
        "gossipd_trainer_wait_seconds",
        "Seconds the trainer waited at step boundaries for pulls due there, since start "
        "(a gauge that only grows: rate() it for the waiting share)",
    ),
    gauge(
        "wait_fraction",
        "gossipd_trainer_wait_fraction",
        "Share of wall time since the first step that the trainer spent waiting for pulls",
    ),
    gauge(
        "site_ranks",
        "gossipd_site_ranks",
        "Processes training in this site (rank 0 gossips; 1 for a one-process site)",
    ),
    counter(
        "rank_broadcasts",
        "gossipd_rank_broadcasts_total",
        "Times rank 0 sent its parameters to the site's other ranks (after a merge moved them)",
    ),
    counter(
        "dial_failures",
        "gossipd_dial_failures_total",
        "Handshakes this node made that failed, by reason (tls: certificate refused or "
        "wrong CA; unreachable; mismatch: other mesh, model or protocol; other)",
        ("reason",),
    ),
    gauge("eval_metric", "gossipd_eval", "Latest evaluation metrics of the job", ("metric",)),
    counter(
        "outer_steps",
        "gossipd_outer_steps_total",
        "persyn's outer optimizer: outer steps taken, one per burst whose pushes all merged "
        "here (the first burst's recording included); a site whose rate falls below its "
        "peers' has an in-neighbour whose pushes do not arrive",
    ),
    counter(
        "checkpoint_failures",
        "gossipd_checkpoint_failures_total",
        "Checkpoint writes that failed (disk full, read-only, I/O error); the previous "
        "checkpoint stays and training goes on",
    ),
    gauge(
        "checkpoint_last_success",
        "gossipd_checkpoint_last_success_timestamp_seconds",
        "Unix time of the newest checkpoint.pt on disk (0: none yet); alert on its age",
    ),
    gauge(
        "restart_weight_lost",
        "gossipd_restart_weight_lost",
        "Sum-weight per segment this incarnation's restart cost the mesh: what the previous "
        "incarnation held that its checkpoint lacked, from the peers' accounts (negative: "
        "weight added; 0 until the audit ends or when the site did not resume)",
    ),
    gauge(
        "restart_audit_peers",
        "gossipd_restart_audit_peers",
        "Peers whose accounts the restart audit read (answered) or needed (asked)",
        ("state",),
    ),
    histogram(
        "checkpoint_seconds",
        "gossipd_checkpoint_write_seconds",
        "Wall time of one successful checkpoint write (capture, serialize, fsync, rename)",
        (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
    ),
    gauge(
        "mqtt_connected",
        "gossipd_mqtt_connected",
        "1 while connected to the MQTT broker of [mqtt], else 0 (training never waits on it)",
    ),
    counter(
        "mqtt_rejected",
        "gossipd_mqtt_rejected_total",
        "MQTT messages ignored, by reason (oversize, bad_json, bad_field, wrong_mesh, "
        "unknown_command, topic_mismatch)",
        ("reason",),
    ),
    counter(
        "mqtt_control_refused",
        "gossipd_mqtt_control_refused_total",
        "MQTT control commands refused, not obeyed, by reason (no_ca, unsigned, bad_field, "
        "other_ca, cert_expired, not_operator, bad_signature, wrong_mesh, wrong_node, stale, "
        "replay)",
        ("reason",),
    ),
    gauge(
        "reach_relayed",
        "gossipd_reach_relayed",
        "0: this site is dialled directly; 1: it cannot be, and is reached through relays",
    ),
    gauge(
        "relays_attached",
        "gossipd_relays_attached",
        "Relays this outbound-only site is attached to now (0 on a direct site)",
    ),
    gauge(
        "relay_sites",
        "gossipd_relay_attached_sites",
        "Sites attached to this node as their relay",
    ),
    gauge(
        "relay_sessions",
        "gossipd_relay_sessions",
        "Connections this node relays now between a dialler and an attached site",
    ),
    counter(
        "relay_bytes",
        "gossipd_relay_bytes_total",
        "Bytes this node forwarded as a relay, by direction (to_site, to_dialer)",
        ("direction",),
    ),
    counter(
        "relay_refused",
        "gossipd_relay_refused_total",
        "Relay requests refused, by reason (absent: the site is not attached here or did not "
        "take; loop; busy: a cap is full; forged: a take with a token not given to that "
        "site; not_relaying: this node relays for nobody, or a site attached with a direct "
        "address)",
        ("reason",),
    ),
    counter(
        "relay_dials",
        "gossipd_relay_dials_total",
        "Connections this node opened to a relayed site through a relay, by result "
        "(connected, refused, failed)",
        ("result",),
    ),
)
