"""The simulator's pull side and coordinator answers, as the replica carries them out.

A :class:`~gossipd.node.protocols.base.Pull` fetches segments of a peer's model: a
request travels the latency there, the model comes back at the link's bandwidth, and
the core merges it whole. A pull with ``merge_at_step`` is due at that step's boundary,
as in the replica: one that arrives early is held until the trainer gets there, and a
trainer that gets there first waits for it (and starts it at once if its start time
has not come yet: the steps ended sooner than predicted). A core whose class sets
:attr:`~gossipd.node.protocols.base.GossipProtocol.serves_one_pull` answers a second
concurrent pull with a failure.

:class:`~gossipd.node.protocols.base.AskPeer` and
:class:`~gossipd.node.protocols.base.ReportTransfer` go to the mesh's coordinator, a
:class:`~gossipd.node.protocols.scheduler.Scheduler` in this process that answers at once.

:class:`PullSide` is a part of :class:`~gossipd.node.sim.driver.Simulation`, kept in
its own file because pulls and pushes change for different reasons; it owns no state
of its own and uses the driver's clock, links and nodes, declared below.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from gossipd.node.protocols.base import (
    Action,
    AskPeer,
    Merge,
    PeerGranted,
    Pull,
    PullArrived,
    PullFailed,
    PullMerged,
    Refused,
    ReportTransfer,
)
from gossipd.node.protocols.scheduler import Scheduler, SchedulerError
from gossipd.node.sim.payloads import Payload
from gossipd.node.sim.scenarios import Scenario
from gossipd.node.sim.spec import SimNode
from gossipd.node.sim.spectral import MixingTracker, Rows


class PullSide:
    """Pulls (held, waited for, hurried, served one at a time) and the coordinator's answers."""

    # What the driver provides (see Simulation.__init__).
    scenario: Scenario
    payload: Payload
    tracker: MixingTracker | None
    coordinator: Scheduler | None
    by_id: dict[str, SimNode]
    stopped: bool
    messages: int
    bytes_sent: int
    refused: int

    if TYPE_CHECKING:

        @property
        def now(self) -> float: ...
        def _at(self, at_s: float, fn: Callable[..., None], *args: Any) -> None: ...
        def _link(self, a: SimNode, b: SimNode) -> tuple[float, float]: ...
        def _step_time(self, node: SimNode) -> float: ...
        def _step(self, node: SimNode) -> None: ...
        def _end_step(self, node: SimNode) -> None: ...
        def _act(self, node: SimNode, actions: list[Action]) -> None: ...

    # -- pulls due at a step's boundary (as the replica: held early, waited for late) ------
    def _due_now(self, node: SimNode) -> bool:
        return any(step <= node.steps for step, _ in node.due.values())

    def _wait(self, node: SimNode, *, ended: bool) -> None:
        """The trainer stops at this boundary; a due pull still waiting for its start time
        starts now (the steps ended sooner than predicted)."""
        node.waiting = (self.now, ended)
        for entry in list(node.due.values()):
            step, pull = entry
            if step <= node.steps and pull is not None:
                entry[1] = None  # started: its own start time does nothing later
                self._pull(node, pull)

    def _pull_done(self, node: SimNode) -> None:
        """A due pull merged or failed: a waiting trainer goes on once none is due."""
        self._release_held(node)
        if node.waiting is None or self._due_now(node) or not node.alive:
            return
        since, ended = node.waiting
        node.waiting = None
        node.wait_s += self.now - since
        if ended:
            self._at(self.now + self._step_time(node), self._step, node)
        else:
            self._end_step(node)

    def _release_held(self, node: SimNode) -> None:
        ready = [h for h in node.held if h[0] <= node.steps]
        if ready:
            node.held = [h for h in node.held if h not in ready]
            for _, arrival, values, rows in ready:
                self._merge_pull(node, arrival, values, rows)

    def _plan_pull(self, node: SimNode, pull: Pull) -> None:
        """A core asked for a pull: due at a step's boundary if it says so, started at its time."""
        if pull.merge_at_step is not None:
            node.due[(pull.peer, pull.round)] = [pull.merge_at_step, pull]
        self._at(pull.at_s, self._pull_at, node, pull)

    # -- pulls ----------------------------------------------------------------------------
    def _pull_at(self, node: SimNode, pull: Pull) -> None:
        """A pull's start time came; one the trainer hurried has started already."""
        if pull.merge_at_step is not None:
            entry = node.due.get((pull.peer, pull.round))
            if entry is None or entry[1] is None:
                return
            entry[1] = None
        self._pull(node, pull)

    def _pull(self, node: SimNode, pull: Pull) -> None:
        """Fetch ``pull.segments`` of a peer's model: request there, model back, merge whole."""
        if self.stopped or not node.alive:
            return
        peer = self.by_id.get(pull.peer)
        latency = self._link(node, peer)[0] if peer is not None else 0.0
        if peer is None or not peer.alive:
            failed = PullFailed(pull.peer, pull.round, "peer is not alive")
            self._at(self.now + self.scenario.timeout_s, self._pull_failed, node, failed)
            return
        self._at(self.now + latency, self._serve_pull, node, peer, pull, self.now)

    def _serve_pull(self, node: SimNode, peer: SimNode, pull: Pull, started_s: float) -> None:
        if not peer.alive:
            failed = PullFailed(peer.id, pull.round, "peer died before serving the pull")
            self._at(self.now + self.scenario.timeout_s, self._pull_failed, node, failed)
            return
        latency, bandwidth = self._link(peer, node)
        one_at_a_time = pull.round > 0 and peer.core.serves_one_pull
        if one_at_a_time and peer.serving:
            busy = PullFailed(peer.id, pull.round, f"{peer.id} is serving a pull already")
            self._at(self.now + latency, self._pull_failed, node, busy)
            return
        values = self.payload.snapshot(peer.index, pull.segments)
        rows = self.tracker.snapshot(peer.index, pull.segments) if self.tracker else None
        weights = peer.core.status().weights
        nbytes = sum(self.payload.segment_nbytes[s] for s in pull.segments)
        self.messages += 1
        self.bytes_sent += nbytes
        arrived_s = self.now + latency + nbytes / bandwidth
        if one_at_a_time:
            peer.serving += 1
            self._at(arrived_s, self._served, peer)
        arrival = PullArrived(
            peer.id,
            pull.round,
            {s: weights[s] if weights else 0.0 for s in pull.segments},
            nbytes,
            arrived_s - started_s,
        )
        self._at(arrived_s, self._pulled, node, arrival, values, rows)

    def _served(self, peer: SimNode) -> None:
        peer.serving -= 1

    def _pulled(
        self, node: SimNode, arrival: PullArrived, values: Mapping[int, Any], rows: Rows | None
    ) -> None:
        if not node.alive:
            return
        entry = node.due.pop((arrival.peer, arrival.round), None)
        if entry is not None and entry[0] > node.steps:
            node.held.append((entry[0], arrival, values, rows))  # merges at its step's end
            return
        self._merge_pull(node, arrival, values, rows)
        self._pull_done(node)

    def _merge_pull(
        self, node: SimNode, arrival: PullArrived, values: Mapping[int, Any], rows: Rows | None
    ) -> None:
        try:
            plan = node.core.handle(arrival)
        except Refused as err:
            self.refused += 1  # as the replica: the core hears that the pull failed
            self._act(node, node.core.handle(PullFailed(arrival.peer, arrival.round, str(err))))
            return
        for m in plan:
            if isinstance(m, Merge):
                self.payload.blend(node.index, m.segment, values[m.segment], m.alpha)
                if rows is not None and self.tracker is not None:
                    self.tracker.blend(node.index, m.segment, rows[m.segment], m.alpha)
        self._act(node, node.core.handle(PullMerged(arrival)))

    def _pull_failed(self, node: SimNode, failed: PullFailed) -> None:
        node.due.pop((failed.peer, failed.round), None)
        if node.alive:
            self._act(node, node.core.handle(failed))
            self._pull_done(node)

    # -- the coordinator's answers -------------------------------------------------------
    def _ask(self, node: SimNode, ask: AskPeer) -> None:
        """The coordinator's answer, as the daemon's loop gives it: a peer and a start,
        none free, or an error (then the core schedules alone)."""
        granted = PeerGranted(ask.round, None, self.now, "the simulation has no coordinator")
        if self.coordinator is not None:
            try:
                grant = self.coordinator.start_time(node.id, ask.end_s, self.now)
            except SchedulerError as err:
                granted = PeerGranted(ask.round, None, self.now, str(err))
            else:
                granted = PeerGranted(
                    ask.round,
                    grant.peer if grant else None,
                    grant.start_s if grant else self.now,
                )
        self._at(self.now, self._granted, node, granted)

    def _granted(self, node: SimNode, granted: PeerGranted) -> None:
        if not self.stopped and node.alive:
            self._act(node, node.core.handle(granted))

    def _report(self, node: SimNode, report: ReportTransfer) -> None:
        if self.coordinator is not None:
            with contextlib.suppress(SchedulerError):  # a lease that ran out
                self.coordinator.report(node.id, report.peer, report.transfer_s)
