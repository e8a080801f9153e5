"""The parameter side of a node: the daemon's driver of its protocol core.

The replica owns the model's flat segments and the core, and carries out every
action the core returns (docs/design.md §2): ``Push`` and ``Pull`` go to the network
through its :class:`~gossipd.node.trainer.messages.LoopPort`; ``Merge``, ``Duplicate`` and
``FoldBack`` are applied to the parameters here, whole or not at all; ``StartTimer``
fires at the first step boundary (or idle moment) at or after its time. A pull
starts at its own ``at_s`` on the loop, mid-step if need be, and merges here.

The event loop never writes parameters and the trainer never awaits the network.
They meet only through typed messages (``node/trainer/messages.py``): the loop puts whole
inbound pushes in the bounded inbox and every other event in the bounded event
queue; the trainer applies both at each step boundary, under :attr:`Replica.lock`.
Each :meth:`Replica.step` returns a :class:`~gossipd.node.trainer.report.StepReport`.
What it applies of the loop's messages is :class:`~gossipd.node.trainer.arrivals.Arrivals`;
what the loop calls from its own threads, :class:`~gossipd.node.trainer.loop_requests.LoopRequests`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from gossipd.node.model.payload_bound import PayloadBound
from gossipd.node.model.segments import FlatModel
from gossipd.node.protocols import DEFAULT_PROTOCOL, CoreSettings, build
from gossipd.node.protocols.base import (
    GossipProtocol,
    StepEnded,
    TrainingEnded,
    shared_seed,
)
from gossipd.node.shared.config import NodeConfig
from gossipd.node.trainer.arrivals import Arrivals
from gossipd.node.trainer.dispatch import Dispatcher
from gossipd.node.trainer.duepulls import DuePulls
from gossipd.node.trainer.fairlock import FairLock
from gossipd.node.trainer.loop_requests import LoopRequests
from gossipd.node.trainer.merging import Merger
from gossipd.node.trainer.messages import (
    Detached,
    EventQueue,
    Inbox,
    LoopPort,
)
from gossipd.node.trainer.report import BalanceLog, SinkLog, StepReport, Summary

# Events a replica may have waiting: outcomes of its pushes and pulls (bounded by the
# core's in-flight limits), restarts, requests from the leaving loop, and refusals
# (dropped beyond this; counted where they were refused).
EVENT_QUEUE_SIZE = 4096

log = logging.getLogger(__name__)


class Replica(Arrivals, LoopRequests):
    """A site's copy of the model and its protocol core; call :meth:`step` after each step.

    It never names a protocol; :func:`gossipd.node.protocols.build` does.
    """

    def __init__(
        self,
        node_id: str,
        model: torch.nn.Module,
        *,
        segment_bytes: int,
        protocol: str = DEFAULT_PROTOCOL,
        settings: Mapping[str, Any] | None = None,
        inbox_size: int = 16,
        clock: Callable[[], float] = time.monotonic,
        bound: PayloadBound | None = None,
        max_wait_s: float = 60.0,
    ) -> None:
        """``bound``: what a payload may do to the model (the config's defaults if None);
        ``max_wait_s``: the longest the trainer waits at a step boundary for a pull due
        there (the pull's own deadlines end it sooner; this only guards against a driver bug)."""
        self.flat = FlatModel(model, segment_bytes)
        self.bound = bound or PayloadBound()
        self.core: GossipProtocol = build(
            protocol,
            CoreSettings(node_id, len(self.flat.plan), **(settings or {})),
        )
        self.merger = Merger(self.core, self.flat, self.bound)
        self.inbox = Inbox(inbox_size)
        self.events = EventQueue(EVENT_QUEUE_SIZE)
        self.clock = clock
        self.steps = 0
        self.last_loss = float("nan")
        self.training_done = False
        # Pulls to merge at a given step's boundary: those still out (the trainer waits
        # for them there), and those that landed early (held until then).
        self.due_pulls = DuePulls(clock, max_wait_s)
        # What the core sends out, and what of it is in flight.
        self.dispatch = Dispatcher(self.core, self.flat, self.due_pulls, Detached(self.events))
        # Held by whoever reads or writes parameters: the trainer while stepping,
        # the loop while snapshotting for PullModel or checkpoints.
        self.lock = FairLock()
        # Held by whoever touches the core and what is in flight: the trainer at its
        # step boundaries (inside ``lock``), and a timer that fires mid-step (alone:
        # it must not wait for the step, and it writes no parameter).
        self.core_lock = threading.RLock()
        self.pushes_acked = 0
        self.pushes_failed = 0
        self.pushes_merged = 0
        self.merge_cpu_s = 0.0
        self.summary = Summary.of(self)
        self.sink_log = SinkLog()
        self.balance_log = BalanceLog()

    @classmethod
    def from_config(cls, config: NodeConfig, model: torch.nn.Module) -> Replica:
        """The replica a site's config asks for (a joiner starts at weight 0)."""
        gossip = config.gossip
        return cls(
            config.node_id,
            model,
            segment_bytes=gossip.segment_bytes,
            protocol=gossip.protocol,
            settings={
                "seed": gossip.seed,
                "mesh_seed": shared_seed(config.mesh_id),
                "initial_weight": 0.0 if config.join else 1.0,
                "max_in_flight": gossip.max_pushes_in_flight,
                "max_weight": config.limits.max_sum_weight,
                "sink_bound": config.limits.sink_score_bound,
                "sink_allowance": config.limits.sink_allowance,
                "peer_credit": config.limits.peer_credit,
                "weight_balance": gossip.weight_balance,
                "coordinator": config.coordinator is not None,
                "options": gossip.options,  # the protocol's own [gossip.<protocol>] table
            },
            inbox_size=config.limits.inbox_size,
            bound=PayloadBound.from_limits(config.limits),
            max_wait_s=2 * gossip.push_timeout_s,
        )

    @property
    def wait_s(self) -> float:
        """Time the trainer spent waiting at step boundaries for pulls due there."""
        return self.due_pulls.wait_s

    @property
    def started_s(self) -> float | None:
        """The first step's end (the wall time of :meth:`wait_fraction` counts from it)."""
        return self.due_pulls.started_s

    def wait_fraction(self) -> float:
        """The share of wall time since the first step ended that the trainer spent
        waiting for pulls due at its step boundaries."""
        return self.due_pulls.wait_fraction()

    @property
    def fingerprint(self) -> str:
        return self.flat.fingerprint

    @property
    def serves_one_pull(self) -> bool:
        """Whether this replica's core serves one protocol pull at a time."""
        return self.core.serves_one_pull

    @property
    def port(self) -> LoopPort:
        """The network that carries this replica's pushes and pulls."""
        return self.dispatch.port

    def attach(self, port: LoopPort) -> None:
        """The network that carries this replica's pushes and pulls from now on."""
        self.dispatch.port = port

    def publish(self) -> None:
        """Refresh the summary that status and metrics read (after a restore, say)."""
        with self.lock, self.core_lock:
            self.summary = Summary.of(self)

    def published(self) -> Summary:
        """The summary last published: what status, metrics and progress lines read, never
        waiting on a step."""
        return self.summary

    def state_dict(self) -> dict[str, Any]:
        """The core's state, for a checkpoint (take it under :attr:`lock`)."""
        with self.core_lock:
            return self.core.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        with self.lock, self.core_lock:
            self.core.load_state_dict(state)
            self.summary = Summary.of(self)

    # -- called from the trainer thread ----------------------------------------------
    def step(self, loss: float | None = None) -> StepReport:
        """Close one local step: merge what arrived, settle push outcomes, maybe push.

        A pull the core wants merged at this boundary (``Pull.merge_at_step``) that
        has not landed yet is waited for here, outside the locks (so this node still
        serves pulls meanwhile), before the core hears that the step ended, and again
        after if the core asks for one due at once.
        """
        with self.lock, self.core_lock:
            self.steps += 1
            if loss is not None:
                self.last_loss = float(loss)
            self.due_pulls.first_step_ended()
            report = StepReport(self.steps)
            self.drain(report)
            told = not self._due_now()  # the core hears of the step once nothing is due
            if told:
                self._end_step(report)
                if not self._due_now():
                    self._publish()
                    return report
        self._wait_for_due(report)  # for what was due, or what the core asked due at once
        with self.lock, self.core_lock:
            if not told:
                self._end_step(report)
            if told or not self._due_now():
                self._publish()
                return report
        self._wait_for_due(report)
        with self.lock, self.core_lock:
            self._publish()
        return report

    def _end_step(self, report: StepReport) -> None:
        for push in self._handle(StepEnded(self.steps, self.clock())):
            report.started_push_to = push.peer

    def _publish(self) -> None:
        self.summary = Summary.of(self)
        self.sink_log.update(self.summary.sinks)
        self.balance_log.update(self.summary.balance_factors)

    def _due_now(self) -> bool:
        return self.due_pulls.due_now(self.steps)

    def _wait_for_due(self, report: StepReport) -> None:
        """Wait, holding no lock, until every pull due by this step merged or failed."""
        with self.due_pulls.waiting() as give_up_at:
            while True:
                # The steps ended sooner than predicted: start now what is due here, on
                # each pass, for a pull re-picked meanwhile (the first failed) is due too.
                with self.core_lock:
                    due = self.due_pulls.due_by(self.steps)
                for out in due:
                    self.port.hurry_pull(out)
                left = give_up_at - self.clock()
                if left <= 0:
                    with self.core_lock:
                        self.due_pulls.give_up(self.steps)
                    log.warning(
                        "step %d: a pull due here did not land within %.0f s; training on "
                        "without it (it merges when it lands)",
                        self.steps,
                        self.due_pulls.max_wait_s,
                    )
                    return
                with self.lock.suspended():  # a caller may hold it around the whole step
                    event = self.events.get(min(left, 1.0))
                with self.lock, self.core_lock:
                    if event is not None:
                        self._apply(event, report)
                    self._apply_events(report)
                    self._release_held(report)
                    if not self._due_now():
                        return

    def finish_training(self) -> None:
        """No more steps: a protocol may still owe the mesh a final exchange."""
        with self.lock, self.core_lock:
            self.training_done = True
            self._handle(TrainingEnded(self.steps, self.clock()))
            self.summary = Summary.of(self)

    def idle(self, wait_s: float) -> StepReport:
        """After training ends, keep merging what peers push so they can still settle.

        The wait for a push holds no lock: a pull's snapshot or a status taken meanwhile
        would otherwise wait out the whole ``wait_s`` (every pull of an idle node did).
        """
        self.inbox.wait(wait_s)
        with self.lock, self.core_lock:
            report = StepReport(self.steps)
            self.drain(report)
            self._publish()
            return report

    def settled(self) -> bool:
        """Nothing of this replica's is in flight, waiting in its queues, or due to fire.

        A pull that landed and waits for the step it merges at is settled while training
        goes on (it waits for the trainer, not the network); once training ended it
        merges at the next boundary and must have.
        """
        with self.lock, self.core_lock:
            return not (
                self.dispatch.in_flight()
                or (self.due_pulls.held and self.training_done)
                or self.inbox.pending()
                or self.events.pending()
            )

    def idle_until(
        self, stop: threading.Event, record: Callable[[StepReport], None] | None = None
    ) -> None:
        """Drive the replica (merges, outcomes, requests) without stepping until ``stop``;
        ``record`` gets each wait's report (its merges, for the metrics)."""
        while not stop.is_set():
            report = self.idle(0.05)
            if record is not None:
                record(report)

    @property
    def outer_steps(self) -> int:
        """Outer steps the protocol's outer optimizer has taken (0: it takes none)."""
        return self.dispatch.outer_steps

    @property
    def shared_model(self) -> dict[int, torch.Tensor]:
        """The model of the last outer step, segment by segment ({} before the first)."""
        outer = self.dispatch.outer
        return dict(outer.shared) if outer is not None else {}

    @property
    def gossip_cpu_s(self) -> float:
        """CPU this replica's thread spent merging pushes and snapshotting its own (its
        share of gossip's cost; the network side's is the rest of the process's)."""
        return self.merge_cpu_s + self.dispatch.snapshot_cpu_s

    def restore(
        self, segments: Sequence[torch.Tensor], core: Mapping[str, Any], steps: int
    ) -> None:
        """Resume from a checkpoint's model, core state and step count.

        Called once at start-up, before the network serves and before the trainer
        thread exists, so nothing else reads or writes the parameters meanwhile.
        """
        with self.lock, self.core_lock:
            for index, values in enumerate(segments):
                self.flat.load_segment(index, values)
            self.core.load_state_dict(core)
            self.steps = steps
            self.summary = Summary.of(self)
