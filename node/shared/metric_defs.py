"""Prometheus metrics as data: a :class:`MetricDef` per metric (its name, type, help text,
labels and buckets) and :func:`register`, the one loop that makes a table of them into
collectors on a registry.

The node's table is :data:`gossipd.node.net.telemetry.metrics.NODE_METRICS`, the coordinator's
:data:`gossipd.coordinator.metrics.COORDINATOR_METRICS`; the reference page
(docs/reference/metrics.md) and the dashboards read what they define.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

MetricKind = Literal["counter", "gauge", "histogram"]
_COLLECTORS: dict[MetricKind, type[MetricWrapperBase]] = {
    "counter": Counter,
    "gauge": Gauge,
    "histogram": Histogram,
}


@dataclass(frozen=True)
class MetricDef:
    """One metric: the attribute its holder exposes it as, and what Prometheus shows."""

    attr: str
    kind: MetricKind
    name: str  # as exported; a counter's ends in _total
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None  # a histogram's upper bounds

    def build(self, registry: CollectorRegistry) -> MetricWrapperBase:
        """The collector this defines, registered on ``registry``."""
        extra = {} if self.buckets is None else {"buckets": self.buckets}
        collector: MetricWrapperBase = _COLLECTORS[self.kind](
            self.name, self.help, list(self.labels), registry=registry, **extra
        )
        return collector


def counter(attr: str, name: str, help: str, labels: tuple[str, ...] = ()) -> MetricDef:
    return MetricDef(attr, "counter", name, help, labels)


def gauge(attr: str, name: str, help: str, labels: tuple[str, ...] = ()) -> MetricDef:
    return MetricDef(attr, "gauge", name, help, labels)


def histogram(attr: str, name: str, help: str, buckets: tuple[float, ...]) -> MetricDef:
    return MetricDef(attr, "histogram", name, help, buckets=buckets)


def register(holder: object, table: Iterable[MetricDef], registry: CollectorRegistry) -> None:
    """Build every metric of ``table`` on ``registry``, in order, as ``holder.<attr>``."""
    for definition in table:
        setattr(holder, definition.attr, definition.build(registry))
