"""Who pulls from whom, and when: the scheduled-overlap gossip scheduler (pure, no I/O).

From "scheduled overlap of computation and communication in gossip SGD"
(a paper in Japanese, Algorithm 2; see docs/protocols/overlap.md). Node i predicts when
its T local steps end and asks for a peer; the scheduler takes the front of a
queue of available peers, j, and answers with the latest moment a pull from j
can start and still land by then: ``max(now, end − c_ij)``, where c_ij is the
learned transfer time of the pair. j leaves the queue while the pull runs and
goes to its back when i reports the measured time, which updates c_ij and c_ji
with a threshold θ: a measurement more than θ (relative) away from the
estimate replaces it, one within ±θ is averaged in. Unknown pairs start at an
infinite estimate (pull at once: pessimistic), so the first report sets them.

The same class runs in the coordinator (one place knows every c_ij) and in every
node in decentralized mode (its own view, its own c_ij). It holds no clock:
times are passed in, on whatever clock the caller uses consistently.

Departures from the paper, each for a fault the paper does not consider:
- j is never i (the paper's queue holds every node, i included);
- i gets the free peer it pulled from least recently, not the front one: with
  equal periods the nodes ask in the same order every period, and taking the front
  then pairs them off the same way for ever (0↔1, 2↔3, …): the mesh splits into
  pairs that never mix (the simulator, 8 nodes: no consensus). With every peer
  free, i pulls from each of the others once in any N − 1 of its requests, so a
  peer waits at most (N − 1)(N − 2) requests of the others (the queue's own bound
  was N − 1); and i waits rather than take its last peer again while another is
  busy (nodes that report and ask at once would re-pull the peer they just freed);
- a peer handed out is held under a lease of ``lease_s``: a requester that
  crashes before it reports must not take j out of the queue for ever;
- requests and reports are validated (unknown ids, i == j, a report with no
  matching grant, negative or non-finite times) with a :class:`SchedulerError`
  that names the value, so a service can refuse them and go on.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gossipd.node.errors import GossipdError

DEFAULT_THRESHOLD = 0.2
DEFAULT_LEASE_S = 300.0
MAX_TIME_S = 86_400.0  # a transfer or a period longer than a day is a bug or a lie


class SchedulerError(GossipdError):
    """A request or report the scheduler refuses; the message says which value and why."""


@dataclass(frozen=True)
class Grant:
    """Pull from ``peer`` starting at ``start_s``, to land by ``end_s``."""

    node: str
    peer: str
    start_s: float
    end_s: float
    estimate_s: float


def update_estimate(estimate_s: float, measured_s: float, threshold: float) -> float:
    """The paper's UPDATE_TIME: replace an estimate the measurement is far from (more
    than ``threshold`` relative either way), average one it is close to."""
    if (1 - threshold) * estimate_s > measured_s or measured_s >= (1 + threshold) * estimate_s:
        return measured_s
    return (estimate_s + measured_s) / 2


class Scheduler:
    def __init__(
        self,
        nodes: Iterable[str] = (),
        *,
        threshold: float = DEFAULT_THRESHOLD,
        lease_s: float = DEFAULT_LEASE_S,
        initial_estimate_s: float = math.inf,
    ) -> None:
        if not 0.0 < threshold < 1.0:
            raise SchedulerError(f"threshold {threshold!r} must be between 0 and 1 (exclusive)")
        if not 0.0 < lease_s <= MAX_TIME_S:
            raise SchedulerError(f"lease_s {lease_s!r} must be in (0, {MAX_TIME_S:.0f}] seconds")
        if not (initial_estimate_s > 0.0):
            raise SchedulerError(f"initial_estimate_s {initial_estimate_s!r} must be > 0")
        self.threshold = threshold
        self.lease_s = lease_s
        self.initial_estimate_s = initial_estimate_s
        self._queue: deque[str] = deque()
        self._members: set[str] = set()
        self._leases: dict[tuple[str, str], float] = {}  # (i, j) -> lease expiry
        self._estimates: dict[tuple[str, str], float] = {}
        self._last_pull: dict[tuple[str, str], int] = {}  # (i, j) -> number of that grant
        self._grants = 0
        self._last_peer: dict[str, str] = {}
        for node in nodes:
            self.add(node)

    # -- membership ---------------------------------------------------------------

    @property
    def members(self) -> frozenset[str]:
        return frozenset(self._members)

    def add(self, node: str) -> None:
        """A node joins: it is available at the back of the queue."""
        if not node:
            raise SchedulerError("a node id must not be empty")
        if node not in self._members:
            self._members.add(node)
            self._queue.append(node)

    def remove(self, node: str) -> None:
        """A node leaves: out of the queue, its grants void; its estimates are kept for
        a return."""
        self._members.discard(node)
        if node in self._queue:
            self._queue.remove(node)
        for pair in [p for p in self._last_pull if node in p]:
            del self._last_pull[pair]
        self._last_peer = {i: j for i, j in self._last_peer.items() if node not in (i, j)}
        for pair in [p for p in self._leases if node in p]:
            del self._leases[pair]
            if pair[1] != node and pair[1] in self._members and pair[1] not in self._queue:
                self._queue.append(pair[1])

    def busy(self) -> frozenset[str]:
        """Peers handed out and not yet reported."""
        return frozenset(j for _, j in self._leases)

    # -- the two verbs --------------------------------------------------------------

    def start_time(self, node: str, end_s: float, now_s: float) -> Grant | None:
        """The front available peer j ≠ ``node`` and when to start pulling from it so that
        the pull lands by ``end_s``; None when no peer is free (ask again later)."""
        self._check_member(node, "node")
        _check_time(end_s, "end_s")
        _check_time(now_s, "now_s")
        if end_s - now_s > MAX_TIME_S:
            raise SchedulerError(
                f"end_s {end_s!r} is {end_s - now_s:.0f} s after now_s {now_s!r}: a period "
                f"longer than {MAX_TIME_S:.0f} s is not a prediction"
            )
        self._expire(now_s)
        if any(i == node for i, _ in self._leases):
            raise SchedulerError(f"{node} asked for a peer while its pull is not reported yet")
        candidates = [p for p in self._queue if p != node]
        if not candidates:
            return None
        # The free peer this node pulled from least recently (the queue's order breaks
        # ties, so it is the front one the first time round).
        peer = min(candidates, key=lambda p: self._last_pull.get((node, p), -1))
        if self._last_peer.get(node) == peer and self.busy() - {node, peer}:
            # Its last peer again, only because the others are still busy: wait for one
            # (a node that reports and asks at once would otherwise re-pull the peer it
            # just freed, period after period).
            return None
        self._grants += 1
        self._last_pull[(node, peer)] = self._grants
        self._last_peer[node] = peer
        self._queue.remove(peer)
        self._leases[(node, peer)] = now_s + self.lease_s
        estimate = self.estimate(node, peer)
        return Grant(node, peer, max(now_s, end_s - estimate), end_s, estimate)

    def report(self, node: str, peer: str, transfer_s: float) -> None:
        """``node``'s pull from ``peer`` took ``transfer_s``: peer is free again and the
        pair's estimate learns. A failed pull reports ``math.inf``: the peer is freed and
        the estimate is left alone."""
        self._check_member(node, "node")
        if node == peer:
            raise SchedulerError(f"{node} reported a transfer from itself")
        if (node, peer) not in self._leases:
            raise SchedulerError(
                f"{node} reported a pull from {peer} that it was not granted (or whose lease of "
                f"{self.lease_s:.0f} s ran out)"
            )
        if not (transfer_s == math.inf or 0.0 <= transfer_s <= MAX_TIME_S):
            raise SchedulerError(
                f"transfer time {transfer_s!r} s must be between 0 and {MAX_TIME_S:.0f} s "
                "(or inf for a failed pull)"
            )
        del self._leases[(node, peer)]
        if peer in self._members:
            self._queue.append(peer)
        if transfer_s != math.inf:
            for pair in ((node, peer), (peer, node)):
                self._estimates[pair] = update_estimate(
                    self.estimate(*pair), transfer_s, self.threshold
                )

    def observe(self, node: str, peer: str, transfer_s: float) -> None:
        """Learn a transfer time this scheduler did not grant (a node keeps its own c_ij
        while a coordinator schedules it, to schedule alone the moment it is gone)."""
        if node == peer or not (0.0 <= transfer_s <= MAX_TIME_S):
            return
        for pair in ((node, peer), (peer, node)):
            self._estimates[pair] = update_estimate(
                self.estimate(*pair), transfer_s, self.threshold
            )

    def estimate(self, node: str, peer: str) -> float:
        """c_ij: the learned transfer time of the pair, ``initial_estimate_s`` if unknown."""
        return self._estimates.get((node, peer), self.initial_estimate_s)

    # -- persistence ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What is worth keeping across a restart: the learned estimates. Leases and the
        queue are not: requesters re-ask after a restart."""
        return {"estimates": [[i, j, c] for (i, j), c in sorted(self._estimates.items())]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        estimates: dict[tuple[str, str], float] = {}
        for entry in state.get("estimates", []):
            try:
                i, j, c = entry
                c = float(c)
            except (TypeError, ValueError):
                raise SchedulerError(
                    f"estimate entry {entry!r} is not [node, peer, seconds]"
                ) from None
            if not (
                isinstance(i, str) and isinstance(j, str) and i != j and 0.0 <= c <= MAX_TIME_S
            ):
                raise SchedulerError(f"estimate entry {entry!r} is not a valid pair and time")
            estimates[(i, j)] = c
        self._estimates = estimates

    # -- internals ----------------------------------------------------------------------

    def _expire(self, now_s: float) -> None:
        for pair, expiry in list(self._leases.items()):
            if expiry <= now_s:
                del self._leases[pair]
                if pair[1] in self._members:
                    self._queue.append(pair[1])

    def _check_member(self, node: str, what: str) -> None:
        if node not in self._members:
            raise SchedulerError(f"{what} {node!r} is not a member of the scheduler's view")


def _check_time(value: float, name: str) -> None:
    if not (math.isfinite(value) and value >= 0.0):
        raise SchedulerError(f"{name} {value!r} must be a finite time >= 0")
