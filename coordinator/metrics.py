"""Prometheus metrics of the coordinator, on a registry of its own (several fit in a process).

Label values come from fixed sets (reason, result) or from certificate-named members
(``pairings``): only sites the mesh CA issued a certificate to, at most
``max_members`` of them at once, so an outsider cannot grow the number of series.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from gossipd.node.shared.metrics_http import serve_registry


class CoordinatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.members = Gauge(
            "gossipd_coordinator_members", "Nodes in the coordinator's view", registry=r
        )
        self.epoch = Gauge(
            "gossipd_coordinator_epoch",
            "Epoch of the view: grows with every change, across restarts",
            registry=r,
        )
        self.estimates = Gauge(
            "gossipd_coordinator_estimates",
            "Pairs (i, j) with a learned transfer time c_ij",
            registry=r,
        )
        self.busy_peers = Gauge(
            "gossipd_coordinator_busy_peers",
            "Peers handed out for a pull whose transfer is not reported yet",
            registry=r,
        )
        self.subscribers = Gauge(
            "gossipd_coordinator_subscribers",
            "Open Membership streams (one per member at most)",
            registry=r,
        )
        self.grants = Counter(
            "gossipd_coordinator_grants_total",
            "StartTime answers by result (granted: a peer and a start; wait: none free)",
            ["result"],
            registry=r,
        )
        self.reports = Counter(
            "gossipd_coordinator_reports_total",
            "Transfers reported by result (ok: a measured time; failed: the pull failed)",
            ["result"],
            registry=r,
        )
        self.pairings = Counter(
            "gossipd_coordinator_pairings_total",
            "Pulls granted from peer to node",
            ["node", "peer"],
            registry=r,
        )
        self.rejected = Counter(
            "gossipd_coordinator_rejected_total",
            "Requests refused, by reason",
            ["reason"],
            registry=r,
        )
        self.dropped = Counter(
            "gossipd_coordinator_dropped_total",
            "Members dropped from the view after drop_after_s without a heartbeat",
            registry=r,
        )
        self.state_write_failures = Counter(
            "gossipd_coordinator_state_write_failures_total",
            "Writes of state.json that failed (the coordinator keeps serving from memory)",
            registry=r,
        )
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
