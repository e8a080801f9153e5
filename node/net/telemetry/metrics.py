"""Prometheus metrics of one node, on a registry of its own so several nodes fit in a process.

Every metric is a row of :data:`NODE_METRICS` (:mod:`.metric_table`): add one there, and
its attribute here, and :class:`NodeMetrics` has it; the reference page
(docs/reference/metrics.md) is generated from the same rows.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gossipd.node.net.telemetry.metric_table import NODE_METRICS
from gossipd.node.shared.metric_defs import register
from gossipd.node.shared.metrics_server import serve_registry
from gossipd.node.trainer.report import MergeRecord, PullRecord, StepReport, Summary

__all__ = ["NODE_METRICS", "NodeMetrics"]

_COLLECTOR_TYPES = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}


class NodeMetrics:
    """A node's collectors, each the attribute its :data:`NODE_METRICS` row names
    (``metrics.steps``, ``metrics.bytes``, ...), and the HTTP server that exports them.

    The attributes are declared here, one per row, so that a caller's typo or a row
    renamed is a type error rather than an AttributeError at a scrape; the constructor
    checks that declarations and rows agree."""

    info: Gauge
    steps: Counter
    step: Gauge
    samples: Counter
    loss: Gauge
    step_seconds: Histogram
    bytes: Counter
    bulk_bytes: Counter
    bulk_connections: Gauge
    messages: Counter
    push_seconds: Histogram
    pushes_in_flight: Gauge
    gossip_cpu_share: Gauge
    gossip_cpu_budget: Gauge
    pushes_held: Counter
    push_held_seconds: Counter
    rejected: Counter
    merges: Counter
    merges_clipped: Counter
    inbound_push_streams: Gauge
    inbound_pull_streams: Gauge
    peers_in_open_backoff: Gauge
    mass_inconsistencies: Counter
    sum_weight: Gauge
    weight_sinks: Gauge
    push_balance_factor: Gauge
    sum_weight_cap: Gauge
    sum_weight_cut: Gauge
    sum_weight_reserved: Gauge
    live_peers: Gauge
    suspected_peers: Gauge
    membership_epoch: Gauge
    round: Gauge
    wait_seconds: Gauge
    wait_fraction: Gauge
    site_ranks: Gauge
    rank_broadcasts: Counter
    dial_failures: Counter
    eval_metric: Gauge
    outer_steps: Counter
    checkpoint_failures: Counter
    checkpoint_last_success: Gauge
    restart_weight_lost: Gauge
    restart_audit_peers: Gauge
    checkpoint_seconds: Histogram
    mqtt_connected: Gauge
    mqtt_rejected: Counter
    mqtt_control_refused: Counter
    reach_relayed: Gauge
    relays_attached: Gauge
    relay_sites: Gauge
    relay_sessions: Gauge
    relay_bytes: Counter
    relay_refused: Counter
    relay_dials: Counter

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        _check_declared()
        register(self, NODE_METRICS, self.registry)
        self.site_ranks.set(1)
        self.port: int | None = None
        self._server = None

    def serve(self, host: str, port: int) -> int:
        server = serve_registry(self.registry, host, port)
        self._server = server
        self.port = server.server_port
        return self.port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def record_step(
        self, report: StepReport, step_time_s: float, loss: float | None, samples: int = 0
    ) -> None:
        self.steps.inc()
        self.samples.inc(samples)
        self.step_seconds.observe(step_time_s)
        if loss is not None:
            self.loss.set(loss)
        self.record_merges(report)

    def record_merges(self, report: StepReport) -> None:
        """Merges of a step boundary, or of a wait between steps (a paced trainer's, one
        that has not started or has finished training: peers still push to it), pushed
        or pulled (a pulling protocol merges only what it pulls)."""
        records: list[MergeRecord | PullRecord] = [*report.merged, *report.pulled]
        for m in records:
            self.merges.inc(len(m.merged_segments))
            self.merges_clipped.inc(len(m.clipped_segments))

    @property
    def merged_segments(self) -> int:
        """``gossipd_merges_total`` as a number, for summary.json."""
        return int(self.registry.get_sample_value("gossipd_merges_total") or 0)

    @property
    def clipped_segments(self) -> int:
        """``gossipd_merges_clipped_total`` as a number, for summary.json (a benchmark reads
        what share of honest merges the clip touched without scraping)."""
        return int(self.registry.get_sample_value("gossipd_merges_clipped_total") or 0)

    def record_checkpoint(self, write_s: float, unix_s: float) -> None:
        self.checkpoint_seconds.observe(write_s)
        self.checkpoint_last_success.set(unix_s)

    def follow(self, summary: Callable[[], Summary]) -> None:
        """Read the replica's published summary at each scrape, not at step boundaries:
        a node that stopped training still merges, settles and hands off weight."""
        self.step.set_function(lambda: summary().steps)
        self.round.set_function(lambda: summary().round)
        self.wait_seconds.set_function(lambda: summary().wait_s)
        self.wait_fraction.set_function(lambda: summary().wait_fraction)
        self.membership_epoch.set_function(lambda: summary().epoch)
        self.pushes_in_flight.set_function(lambda: summary().in_flight)
        self.weight_sinks.set_function(lambda: len(summary().sinks))
        self.sum_weight_cap.set_function(lambda: summary().weight_cap)
        self.sum_weight_cut.set_function(lambda: summary().weight_cut)
        per_segment: tuple[tuple[Gauge, Callable[[Summary], tuple[float, ...]]], ...] = (
            (self.sum_weight, lambda s: s.weights),
            (self.push_balance_factor, lambda s: s.balance_factors),
            (self.sum_weight_reserved, lambda s: s.reserved),
        )
        for gauge, values in per_segment:
            for i in range(len(values(summary()))):
                gauge.labels(str(i)).set_function(_segment_of(summary, values, i))


def _segment_of(
    summary: Callable[[], Summary], values: Callable[[Summary], tuple[float, ...]], index: int
) -> Callable[[], float]:
    """Segment ``index`` of one of the summary's per-segment tuples, read at each scrape."""
    return lambda: values(summary())[index]


def _check_declared() -> None:
    """Each row of :data:`NODE_METRICS` is declared on :class:`NodeMetrics` as its collector."""
    declared = NodeMetrics.__annotations__
    wrong = [
        d.attr for d in NODE_METRICS if declared.get(d.attr) != _COLLECTOR_TYPES[d.kind].__name__
    ]
    assert not wrong, f"declare {wrong} on NodeMetrics as the collectors their rows build"
