"""Prometheus metrics of the coordinator, on a registry of its own (several fit in a process).

Label values come from fixed sets (reason, result) or from certificate-named members
(``pairings``): only sites the mesh CA issued a certificate to, at most
``max_members`` of them at once, so an outsider cannot grow the number of series.

Every metric is a row of :data:`COORDINATOR_METRICS`, made an attribute of
:class:`CoordinatorMetrics` by :func:`~gossipd.node.shared.metric_defs.register`.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry

from gossipd.node.shared.metric_defs import MetricDef, counter, gauge, register
from gossipd.node.shared.metrics_server import serve_registry

# One row per metric, in the order the reference page lists them.
COORDINATOR_METRICS: tuple[MetricDef, ...] = (
    gauge("members", "gossipd_coordinator_members", "Nodes in the coordinator's view"),
    gauge(
        "epoch",
        "gossipd_coordinator_epoch",
        "Epoch of the view: grows with every change, across restarts",
    ),
    gauge(
        "estimates",
        "gossipd_coordinator_estimates",
        "Pairs (i, j) with a learned transfer time c_ij",
    ),
    gauge(
        "busy_peers",
        "gossipd_coordinator_busy_peers",
        "Peers handed out for a pull whose transfer is not reported yet",
    ),
    gauge(
        "subscribers",
        "gossipd_coordinator_subscribers",
        "Open Membership streams (one per member at most)",
    ),
    counter(
        "grants",
        "gossipd_coordinator_grants_total",
        "StartTime answers by result (granted: a peer and a start; wait: none free)",
        ("result",),
    ),
    counter(
        "reports",
        "gossipd_coordinator_reports_total",
        "Transfers reported by result (ok: a measured time; failed: the pull failed)",
        ("result",),
    ),
    counter(
        "pairings",
        "gossipd_coordinator_pairings_total",
        "Pulls granted from peer to node",
        ("node", "peer"),
    ),
    counter(
        "rejected",
        "gossipd_coordinator_rejected_total",
        "Requests refused, by reason",
        ("reason",),
    ),
    counter(
        "dropped",
        "gossipd_coordinator_dropped_total",
        "Members dropped from the view after drop_after_s without a heartbeat",
    ),
    counter(
        "state_write_failures",
        "gossipd_coordinator_state_write_failures_total",
        "Writes of state.json that failed (the coordinator keeps serving from memory)",
    ),
)


class CoordinatorMetrics:
    """The coordinator's collectors, each the attribute its :data:`COORDINATOR_METRICS` row
    names, and the HTTP server that exports them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        register(self, COORDINATOR_METRICS, self.registry)
        self.port: int | None = None
        self._server = None

    def follow(
        self,
        members: Callable[[], int],
        epoch: Callable[[], int],
        estimates: Callable[[], int],
        busy: Callable[[], int],
        subscribers: Callable[[], int],
    ) -> None:
        """Read the gauges at each scrape from the live state."""
        self.members.set_function(members)
        self.epoch.set_function(epoch)
        self.estimates.set_function(estimates)
        self.busy_peers.set_function(busy)
        self.subscribers.set_function(subscribers)

    def serve(self, listen: str) -> int:
        host, _, port = listen.rpartition(":")
        self._server = serve_registry(self.registry, host, int(port))
        self.port = self._server.server_port
        return self.port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
