"""Where the sum-weight mass of a simulated mesh is, so a test can demand it all be there.

Σw and Σw·x (per segment) over a mesh are constant while nothing fails
(docs/design.md §5). A simulation can also destroy some (a crash takes the node's
available weight and its payloads still on the wire; a merge cuts what does not fit
under the receiver's weight cap) or, in the ledger's one
known error, create some (a push folded back after its receiver merged it). The
book counts both, so live totals + lost − duplicated must equal the start to
rounding in every scenario; anything else is a bug in a core or in the driver.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from gossipd.node.sim.payloads import Payload
from gossipd.node.sim.spec import SimNode


class MassBook:
    def __init__(self, payload: Payload) -> None:
        self.payload = payload
        segments = payload.num_segments
        zeros = [np.zeros_like(payload.values(0, s), dtype=float) for s in range(segments)]
        self.lost = np.zeros(segments)
        self.duplicated = np.zeros(segments)
        self.lost_values = [z.copy() for z in zeros]
        self.duplicated_values = [z.copy() for z in zeros]
        self.start: tuple[np.ndarray, list[np.ndarray]] | None = None

    def _add(self, into: np.ndarray, values: list[np.ndarray], s: int, w: float, x: Any) -> None:
        into[s] += w
        values[s] += w * np.asarray(x, dtype=float)

    def available(self, node: SimNode) -> list[float]:
        status = node.core.status()
        return [w - r for w, r in zip(status.weights, status.reserved, strict=True)]

    def gone(self, node: SimNode) -> None:
        """A node's available weight and its payloads not merged yet vanish with it."""
        self.count(self.lost, self.lost_values, node)

    def cut(self, segment: int, weight: float, values: Any) -> None:
        """A merged payload's weight that did not fit under the receiver's weight cap."""
        self._add(self.lost, self.lost_values, segment, weight, values)

    def folded_back_after_merge(
        self, weights: Mapping[int, float], values: Mapping[int, Any]
    ) -> None:
        for s, w in weights.items():
            self._add(self.duplicated, self.duplicated_values, s, w, values[s])

    def totals(self, nodes: Iterable[SimNode]) -> tuple[np.ndarray, list[np.ndarray]]:
        """(Σ w, Σ w·x) per segment over what exists now, plus lost, minus duplicated.

        A live node counts its available weight; a push counts with its sender until
        the receiver merges it (from then on the receiver's weight holds it).
        """
        mass = self.lost - self.duplicated
        values = [a - b for a, b in zip(self.lost_values, self.duplicated_values, strict=True)]
        for node in nodes:
            if node.alive:
                self.count(mass, values, node)
        return mass, values

    def count(self, mass: np.ndarray, values: list[np.ndarray], node: SimNode) -> None:
        for s, w in enumerate(self.available(node)):
            self._add(mass, values, s, w, self.payload.values(node.index, s))
        for flight in node.flights.values():
            if not flight.merged:
                for s, w in flight.push.weights.items():
                    self._add(mass, values, s, w, flight.values[s])

    def drift(self, nodes: Iterable[SimNode]) -> tuple[float, float]:
        """Relative drift of (Σ w, Σ w·x) from :attr:`start`, worst segment."""
        if self.start is None:
            return math.nan, math.nan
        mass0, values0 = self.start
        mass, values = self.totals(nodes)
        d_mass = float(np.max(np.abs(mass - mass0) / np.abs(mass0)))
        d_values = max(
            float(np.linalg.norm(v - v0) / np.linalg.norm(v0))
            for v, v0 in zip(values, values0, strict=True)
        )
        return d_mass, d_values
