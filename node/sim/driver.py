"""The simulator's driver: the very cores the daemon runs, on a virtual clock (docs/design.md §2).

Each node is a core built by :func:`gossipd.node.protocols.build`, a slot in a
:mod:`payload <gossipd.node.sim.payloads>` and a little bookkeeping. The driver
keeps the promises in :mod:`gossipd.node.protocols.base` the way the replica and
the outbound path do: a push is snapshotted when the core asks, retried with the
same sequence until the receiver answers or leaves every view, and settled
exactly once, its unacknowledged segments folded back from that snapshot.

Time is a :class:`~gossipd.node.sim.clock.Clock`: a heap of happenings, first in,
first out at equal times, so a run is the same every time.

What is modelled and what is not:

* a payload of b bytes sent at t arrives at t + latency + b/bandwidth (no link
  contention); acknowledgements take the latency back;
* a crashed sender's payloads still on the wire are dropped (a broken stream
  merges nothing); a push to a crashed node times out and is retried until the
  node leaves the view ``detect_s`` after the crash, then folds back;
* a lost payload or acknowledgement is noticed ``timeout_s`` after it would
  have arrived and retried (the simulator knows which attempts failed, so it
  never retries one that succeeded);
* a joiner copies a live node's model (the bootstrap pull) and starts at weight 0.

What a crash destroys and what a fold-back after a merge creates is booked in
a :class:`~gossipd.node.sim.accounting.MassBook`, so the totals must always add up.
Pushes are carried out in :mod:`gossipd.node.sim.pushes`, pulls and the coordinator's
answers in :mod:`gossipd.node.sim.pulls`.

:meth:`Simulation.run` drives every node by the virtual clock. A test that scripts the
steps itself uses the public step API instead (:meth:`Simulation.start`,
:meth:`~Simulation.end_step`, :meth:`~Simulation.end_training`,
:meth:`~Simulation.settle`), as the contract suite does.
"""

from __future__ import annotations

import contextlib
import gc
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from gossipd.node.errors import GossipdError
from gossipd.node.model.outer import OuterNesterov
from gossipd.node.protocols import build
from gossipd.node.protocols.base import (
    Action,
    AskPeer,
    HandOff,
    OuterStep,
    Pull,
    Push,
    ReportTransfer,
    Settle,
    StartTimer,
    StepEnded,
    TimerFired,
    TrainingEnded,
    ViewChanged,
)
from gossipd.node.protocols.scheduler import Scheduler
from gossipd.node.sim.accounting import MassBook
from gossipd.node.sim.clock import Clock
from gossipd.node.sim.memory import resident_bytes
from gossipd.node.sim.payloads import Payload, make_payload
from gossipd.node.sim.pulls import PullSide
from gossipd.node.sim.pushes import PushSide
from gossipd.node.sim.spec import SimNode, SimResult, SimSpec, core_settings
from gossipd.node.sim.spectral import MixingTracker

if TYPE_CHECKING:
    from gossipd.node.sim.compression import SimCodec


def _one_blas_thread() -> contextlib.AbstractContextManager[object]:
    """One OpenBLAS thread while simulating: the run is one Python thread anyway, and on a
    busy 2-core machine two BLAS threads made an SVD of 128×128 50 times slower (85 ms
    against 1.7 ms) and the N = 1,024 eigenvalue problem 20 times slower (3 s, 0.14 s)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # scikit-learn brings it; without it, BLAS keeps its default
        return contextlib.nullcontext()
    limits: contextlib.AbstractContextManager[object] = threadpool_limits(1)
    return limits


class SimError(GossipdError):
    """A core asked for something the simulator does not carry out."""


def make_codec(spec: SimSpec) -> SimCodec | None:
    """The simulated wire's codec; None for raw values (then torch is never imported)."""
    if spec.codec == "raw" and not spec.error_feedback:
        return None
    from gossipd.node.compression.codecs import Codec, is_sparse
    from gossipd.node.compression.sparse import fraction_error
    from gossipd.node.sim.compression import SimCodec

    try:
        codec = Codec.parse(spec.codec)
    except ValueError as err:
        raise GossipdError(f"--codec: {err}") from None
    if is_sparse(codec) and not spec.error_feedback:
        raise GossipdError(f"--codec {spec.codec} sends differences only: add --error-feedback")
    wrong = fraction_error(spec.topk_fraction)
    if wrong:
        raise GossipdError(f"--topk-fraction: {wrong}")
    return SimCodec(codec, spec.error_feedback, spec.feedback_peers, spec.seed, spec.topk_fraction)


class Simulation(PushSide, PullSide):
    """One run: build it from a :class:`SimSpec`, call :meth:`run` once (or script its
    steps with the public step API below, and never call :meth:`run`)."""

    def __init__(
        self, spec: SimSpec, on_probe: Callable[[Simulation, int], None] | None = None
    ) -> None:
        self._started = time.perf_counter()  # wall_s counts building the nodes too
        self.start_memory_bytes = resident_bytes()
        spec.scenario.check(spec.nodes)
        if spec.nodes < 1:
            raise GossipdError(f"--nodes must be at least 1, got {spec.nodes}")
        self.spec = spec
        self.scenario = sc = spec.scenario
        self.on_probe = on_probe
        self.clock = Clock()
        self.rng = random.Random(spec.seed)  # network draws: jitter, loss, bootstrap peers
        joins = sum(e.kind == "join" for e in sc.events)
        capacity = spec.nodes + joins
        self.payload: Payload = make_payload(spec, capacity)
        self.segments = self.payload.num_segments
        self.tracker = MixingTracker(spec.nodes, self.segments) if spec.tracks_mixing else None
        self.codec = make_codec(spec)
        self.outers: dict[int, OuterNesterov] = {}  # per node, made at its first OuterStep
        self._id_width = max(5, len(str(capacity - 1)))
        self.nodes: list[SimNode] = []
        self.by_id: dict[str, SimNode] = {}
        for _ in range(spec.nodes):
            self._new_node(initial_weight=1.0)
        self.members: frozenset[str] = frozenset(self.by_id)
        self.member_idx = np.arange(spec.nodes)
        self.stopped = False
        self.messages = self.settles = self.acks = self.retries = self.refused = 0
        self.bytes_sent = 0
        self.book = MassBook(self.payload)
        if spec.check_invariants:
            self.book.start = self.book.totals(self.nodes)
        self.result = SimResult.start(spec, self.segments)
        # The mesh's coordinator, for cores that ask one (AskPeer): it answers at once.
        self.coordinator = Scheduler() if spec.coordinator else None

    # -- scheduling --------------------------------------------------------------------
    @property
    def now(self) -> float:
        return self.clock.now

    def _at(self, at_s: float, fn: Callable[..., None], *args: Any) -> None:
        self.clock.at(at_s, fn, args)

    def _link(self, a: SimNode, b: SimNode) -> tuple[float, float]:
        return (
            self.scenario.latency_s[a.site][b.site],
            self.scenario.bandwidth_bytes_per_s[a.site][b.site],
        )

    def _step_time(self, node: SimNode) -> float:
        base = self.scenario.step_time_s[node.site]
        return (
            base * self.rng.lognormvariate(0.0, self.scenario.jitter)
            if self.scenario.jitter
            else base
        )

    # -- nodes and views ----------------------------------------------------------------
    def _new_node(self, initial_weight: float) -> SimNode:
        index = len(self.nodes)
        ids = self.spec.node_ids
        node_id = ids[index] if index < len(ids) else f"n{index:0{self._id_width}d}"
        core = build(
            self.spec.protocol, core_settings(self.spec, node_id, self.segments, initial_weight)
        )
        node = SimNode(index, node_id, core, index % self.scenario.sites)
        self.nodes.append(node)
        self.by_id[node_id] = node
        return node

    def _set_members(self, members: frozenset[str]) -> None:
        """One frozenset object for every core: cores rank it once, through a shared cache."""
        self.members = members
        self.member_idx = np.array(sorted(self.by_id[m].index for m in members), dtype=int)
        if self.coordinator is not None:
            for member in sorted(members):
                self.coordinator.add(member)
            for gone in self.coordinator.members - members:
                self.coordinator.remove(gone)
        event = ViewChanged(members)
        for node in self.nodes:
            if node.alive:
                self._act(node, node.core.handle(event))

    # -- running --------------------------------------------------------------------------
    def run(self) -> SimResult:
        """Run to the last round, drain what is in flight, and report.

        Python's cyclic garbage collector is off meanwhile: the cores' de-duplication
        windows make millions of small containers, and generation-2 passes over them
        tripled the time of 10,000 nodes (38.6 s against 12.3 s for 5 rounds of
        crossover), while a collection after 20 rounds of 2,000 nodes found 8 cyclic
        objects: the driver makes no garbage cycles worth collecting while it runs.
        BLAS runs on one thread (see :func:`_one_blas_thread`).
        """
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._set_members(self.members)
            for node in self.nodes:
                self._at(self._step_time(node), self._step, node)
            for entry in self.scenario.events:
                self._at(entry.at_s, self._fault, entry)
            with _one_blas_thread():
                self._probe(0)
                self.clock.run()  # probes stop the steps; what is in flight then drains
        finally:
            if collecting:
                gc.enable()
        self.result.finish(self, time.perf_counter() - self._started)
        return self.result

    def _probe(self, k: int) -> None:
        err_max, err_rms = self.payload.errors(self.member_idx)
        sigma = self.tracker.sigma() if self.tracker is not None else None
        self.result.record(self, err_max, err_rms, sigma)
        if self.on_probe is not None:
            self.on_probe(self, k)
        spec = self.spec
        reached = spec.target_error > 0 and err_max <= spec.target_error
        if reached and sigma is not None:
            reached = self.result.errors[0] * sigma <= spec.target_error
        if k >= spec.rounds or reached:
            self.stopped = True
            return
        round_s = spec.round_steps * min(self.scenario.step_time_s)
        self._at((k + 1) * round_s + 0.5 * min(self.scenario.step_time_s), self._probe, k + 1)

    def _step(self, node: SimNode) -> None:
        if self.stopped or not node.alive or node.leaving:
            return
        node.steps += 1
        self.payload.step(node.index)
        self._release_held(node)  # pulls held for this boundary merge before StepEnded
        if self._due_now(node):
            self._wait(node, ended=False)
        else:
            self._end_step(node)

    def _end_step(self, node: SimNode) -> None:
        """StepEnded, then the next step, unless the core asked for a pull due at once."""
        self._act(node, node.core.handle(StepEnded(node.steps, self.now)))
        if self._due_now(node):
            self._wait(node, ended=True)
        else:
            self._at(self.now + self._step_time(node), self._step, node)

    def _act(self, node: SimNode, actions: list[Action]) -> None:
        pushes = [a for a in actions if isinstance(a, Push)]
        if pushes:
            self._send(node, pushes)
        for action in actions:
            if isinstance(action, Push):
                continue
            if isinstance(action, StartTimer):
                self._at(action.at_s, self._timer, node, action.tag)
            elif isinstance(action, Pull):
                self._plan_pull(node, action)
            elif isinstance(action, AskPeer):
                self._ask(node, action)
            elif isinstance(action, ReportTransfer):
                self._report(node, action)
            elif isinstance(action, Settle):
                self._send_settle(node, action)
            elif isinstance(action, OuterStep):
                self._outer_step(node, action)
            else:
                raise SimError(
                    f"protocol {self.spec.protocol} answered with {action!r} outside a payload "
                    "or a settle; the simulator cannot carry it out"
                )

    def _outer_step(self, node: SimNode, action: OuterStep) -> None:
        """The core's outer optimizer over the node's whole payload, as the daemon does."""
        outer = self.outers.get(node.index)
        if outer is None:
            outer = self.outers[node.index] = OuterNesterov(action.learning_rate, action.momentum)
        for segment in range(self.segments):
            shared = outer.step(segment, self.payload.values(node.index, segment))
            self.payload.load(node.index, segment, shared)

    def _timer(self, node: SimNode, tag: str) -> None:
        if not self.stopped and node.alive:
            self._act(node, node.core.handle(TimerFired(tag, self.now)))

    # -- the public step API: a script says which node steps, and when all has settled ------
    def start(self) -> None:
        """Give every core the founding view, as :meth:`run` does first; no step is scheduled.

        Call it once, then any sequence of :meth:`end_step` and :meth:`end_training`, each
        followed by :meth:`settle` (or not, to let more happen at once)."""
        self._set_members(self.members)

    def end_step(self, index: int) -> None:
        """Node ``index`` ended a local step now: the pulls held for this boundary merge,
        then its core hears ``StepEnded`` and what it asks for is set going.

        The payload does not train (the models move by gossip alone) and the node's next
        step is not scheduled: the script says when it ends. A pull due at this boundary
        that has not landed merges when it lands."""
        node = self.nodes[index]
        node.steps += 1
        self._release_held(node)
        self._act(node, node.core.handle(StepEnded(node.steps, self.now)))

    def end_training(self, index: int) -> None:
        """Node ``index`` trains no more: its core hears ``TrainingEnded`` now."""
        node = self.nodes[index]
        self._act(node, node.core.handle(TrainingEnded(node.steps, self.now)))

    def settle(self) -> None:
        """Run the virtual clock until nothing is left to happen: every push delivered,
        acknowledged or retried and settled, every timer fired, every pull merged or failed."""
        self.clock.run()

    # -- faults ---------------------------------------------------------------------------
    def _fault(self, entry: Any) -> None:
        if self.stopped:
            return
        if entry.kind == "join":
            self._join()
            return
        node = self.nodes[entry.node]
        if not node.alive or node.leaving:
            return
        if entry.kind == "fail":
            self._crash(node)
        else:
            self._leave(node)

    def _crash(self, node: SimNode) -> None:
        """Its state is gone: book its available weight and unmerged payloads as lost."""
        self.book.gone(node)
        node.flights.clear()
        node.alive = False
        self._at(self.now + self.scenario.detect_s, self._declare_gone, node)

    def _declare_gone(self, node: SimNode) -> None:
        if node.id in self.members:
            self._set_members(self.members - {node.id})

    def _leave(self, node: SimNode) -> None:
        """Announce, hand every available weight off, go once every push has settled."""
        node.leaving = True
        self._set_members(self.members - {node.id})
        self._act(node, node.core.handle(HandOff()))
        if not node.flights:
            self._finish_leaving(node)

    def _finish_leaving(self, node: SimNode) -> None:
        if any(w > 0 for w in self.book.available(node)) and node.handoffs < 3 and self.members:
            node.handoffs += 1  # merged something while leaving, or a hand-off came back
            self._act(node, node.core.handle(HandOff()))
            if node.flights:
                return
        self.book.gone(node)  # nobody took what is left: it goes with the node
        node.alive = False

    def _join(self) -> None:
        node = self._new_node(initial_weight=0.0)
        live = [self.by_id[m] for m in sorted(self.members)]
        source = self.rng.choice(live) if live else None
        self.payload.add_node(node.index, source.index if source else None)
        delay = 0.0
        if source is not None:  # the bootstrap pull takes a transfer time before training
            latency, bandwidth = self._link(source, node)
            delay = 2 * latency + sum(self.payload.segment_nbytes) / bandwidth
        self._set_members(self.members | {node.id})
        self._at(self.now + delay + self._step_time(node), self._step, node)

    def invariant_errors(self) -> tuple[float, float]:
        """Relative drift of (Σ w, Σ w·x) from the start; needs ``check_invariants``."""
        return self.book.drift(self.nodes)
