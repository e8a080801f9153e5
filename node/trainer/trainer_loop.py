"""The trainer thread of a site: steps, merges at step boundaries, evaluates, checkpoints.

Kept apart from :mod:`gossipd.node.site.site` (which puts a daemon together) because it is
the one thread that touches parameters and, in a multi-rank site, issues the site's
collectives, in one order.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from gossipd.node.model.torchthreads import adopt_thread_count

if TYPE_CHECKING:
    import torch

    from gossipd.node.shared.config import NodeConfig
    from gossipd.node.trainer.ranks import Leader
    from gossipd.node.trainer.replica import Replica
    from gossipd.node.trainer.report import StepReport

log = logging.getLogger("gossipd.node.site.site")


class TrainingHost(Protocol):
    """What the trainer thread asks of its site: record a step, evaluate, checkpoint, write
    the summary, and hear that training died."""

    def record(self, report: StepReport, step_time_s: float, loss: float) -> None: ...
    def record_merges(self, report: StepReport) -> None: ...
    def evaluate(self, shared: Mapping[int, torch.Tensor] | None = None) -> None: ...
    def periodic_checkpoint(self) -> None: ...
    def write_summary(self, *, training_done: bool) -> None: ...
    def trainer_died(self) -> None: ...


class Steps(Protocol):
    """The job, as the trainer thread drives it."""

    def train_step(self) -> float: ...


class TrainingTime(Protocol):
    """Gossip's CPU budget, as the trainer thread feeds it its own time."""

    training: bool

    def add_training(self, cpu_s: float) -> None: ...


@dataclass(frozen=True)
class TrainingPlan:
    """When the trainer thread evaluates, checkpoints, paces itself and stops."""

    eval_every_steps: int
    checkpoint_every_steps: int
    max_steps: int
    duration_s: float
    max_steps_per_s: float

    @classmethod
    def from_config(cls, config: NodeConfig) -> TrainingPlan:
        job = config.job
        return cls(
            job.eval_every_steps,
            config.checkpoint.every_steps,
            job.max_steps,
            job.duration_s,
            job.max_steps_per_s,
        )


class EvaluationCadence:
    """When a site evaluates: every ``every`` steps (0: never). Once its protocol takes
    outer steps (``persyn`` with its outer optimizer), at the first outer step at or past
    each multiple, as the DiLoCo baseline does: between outer steps a site holds only its
    own inner steps' model, and the shared one, the model the mesh is training, exists
    there. Once the outer steps stop (none for twice the last gap between two of them, and
    for a whole ``every``), at each multiple again: a site whose bursts stay partial (an
    in-neighbour that never pushes, such as a sink) takes none, and was never evaluated
    again (measured: beside a sink, a site that took 2 outer steps in 6,000 was evaluated
    once, its peers 24 times), which left its ``gossipd_eval`` silent."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.evaluated_at = 0  # the step of the last evaluation on the cadence
        self.outer_seen = 0  # outer steps taken by the last step boundary
        self.outer_at = 0  # the step of the latest of them
        self.gap = 0  # steps between the latest two

    def due(self, step: int, outer_steps: int) -> bool:
        every = self.every
        took_outer = outer_steps > self.outer_seen
        if took_outer:
            self.gap = step - self.outer_at if self.outer_seen else 0
            self.outer_seen, self.outer_at = outer_steps, step
        if not every:
            return False
        if not outer_steps:
            due = step % every == 0
        elif step % every == 0 and not self.outer_running(step):
            due = True
        else:
            due = took_outer and step // every > self.evaluated_at // every
        if due:
            self.evaluated_at = step
        return due

    def outer_running(self, step: int) -> bool:
        """Whether outer steps are being taken at ``step``: one came within twice the last
        gap between two, or within a whole ``every``."""
        return self.outer_seen > 0 and step - self.outer_at <= max(self.every, 2 * self.gap)


class TrainingLoop(threading.Thread):
    """The trainer thread: steps, merges at step boundaries, evaluates, checkpoints."""

    def __init__(
        self,
        name: str,
        *,
        replica: Replica,
        job: Steps,
        ranks: Leader | None,
        budget: TrainingTime,
        plan: TrainingPlan,
        host: TrainingHost,
    ) -> None:
        super().__init__(name=f"trainer-{name}", daemon=True)
        self.replica = replica
        self.job = job
        self.ranks = ranks
        self.budget = budget
        self.plan = plan
        # Told on the trainer thread if training dies: the daemon must not idle on as a
        # silent, half-alive peer, so the site shuts down (and `gossipd node` exits 1).
        self.host = host
        self.halt = threading.Event()
        self.finished = threading.Event()
        # After ``halt`` the thread stops stepping but keeps merging and runs the
        # leave's hand-off and settlements (parameters are written only here) until this.
        self.release = threading.Event()
        # Set once start-up (join bootstrap, start_after_peers) is done: until then the
        # thread only drives the replica, so the bootstrap model is loaded here too.
        self.go = threading.Event()
        # Cleared by the `pause` control command: the thread stops stepping at the next step
        # boundary and only drives the replica (merges, settlements) until it is set again.
        self.resumed = threading.Event()
        self.resumed.set()
        self.stepped = False
        self.error: BaseException | None = None
        self.cadence = EvaluationCadence(plan.eval_every_steps)

    def run(self) -> None:
        adopt_thread_count()
        try:
            while not (self.go.is_set() or self.halt.is_set()):
                self._idle()
            self._train()
            self.budget.training = False
            if self.ranks is not None:
                self.host.evaluate()  # every rank records the model the site stops with
                self.ranks.stop(self.replica.steps)
            self.replica.idle_until(self.release, self.host.record_merges)
        except BaseException as err:
            log.exception("trainer thread failed")
            self.error = err
            if self.ranks is not None:
                self.ranks.broken = True  # its collectives cannot be trusted any more
            self.host.trainer_died()
            self.finished.set()

    def _train(self) -> None:
        """Step until halted; paused or finished, only drive the replica (merges)."""
        started = time.monotonic()
        budget, replica = self.budget, self.replica
        # The trainer thread's CPU since the end of the last step it accounted for:
        # the loop's own bookkeeping between steps is training too (at 2,000 steps a
        # second a few microseconds of it a step are a percent of the core).
        mark: tuple[float, float] | None = None
        while not self.halt.is_set():
            if self.finished.is_set() or not self.resumed.is_set():
                budget.training = False
                mark = None
                self._idle()
                continue
            self.stepped = budget.training = True
            if mark is None:
                mark = (time.thread_time(), replica.gossip_cpu_s)
            t0 = time.perf_counter()
            self._step(t0, started)
            # All but its merges and push snapshots is the trainer's own work.
            now = (time.thread_time(), replica.gossip_cpu_s)
            budget.add_training(now[0] - mark[0] - (now[1] - mark[1]))
            mark = now
            if self.plan.max_steps_per_s:
                self._pace(t0 + 1.0 / self.plan.max_steps_per_s)

    def _step(self, t0: float, started: float) -> None:
        """One step and what falls due after it: evaluation, checkpoint, the end."""
        replica, plan, host = self.replica, self.plan, self.host
        with replica.lock:
            if self.ranks is not None:
                self.ranks.before_step(replica.steps)
            loss = self.job.train_step()
            report = replica.step(loss)
        host.record(report, time.perf_counter() - t0, loss)
        step = replica.steps
        if self.cadence.due(step, replica.outer_steps):
            host.evaluate()
        if plan.checkpoint_every_steps and step % plan.checkpoint_every_steps == 0:
            host.periodic_checkpoint()
        elapsed_s = time.monotonic() - started
        if (plan.max_steps and step >= plan.max_steps) or (
            plan.duration_s and elapsed_s >= plan.duration_s
        ):
            self._evaluate_at_end(step)
            replica.finish_training()
            host.write_summary(training_done=True)
            self.finished.set()

    def _evaluate_at_end(self, step: int) -> None:
        """The last evaluation. While outer steps are being taken, of the model of the last
        one, as at every evaluation before: the site's own model here is up to a period of
        inner steps past it, drifted towards its own data (label-skewed `mnist1d` sites
        beside a sink scored 0.75-0.82 at their last outer steps and 0.56-0.59 at the end),
        where the DiLoCo baseline's last evaluation follows its last outer step."""
        shared = None
        if self.cadence.outer_running(step) and step != self.cadence.outer_at:
            shared = self.replica.shared_model
            log.info(
                "training ended at step %d: evaluating the shared model of the outer step "
                "at step %d, not this site's own inner steps since (its final burst "
                "averages those)",
                step,
                self.cadence.outer_at,
            )
        self.host.evaluate(shared)

    def _pace(self, until: float) -> None:
        """Wait out the rest of a paced step, merging what arrives meanwhile.

        A paced trainer leaves its core to others (a site sharing its machine, a test's
        daemons sharing two cores) and stays a full peer: pushes land and merge as they
        would at step boundaries.
        """
        while not self.halt.is_set() and (left := until - time.perf_counter()) > 0:
            self._idle(left)

    def _idle(self, wait_s: float = 0.05) -> None:
        self.host.record_merges(self.replica.idle(min(wait_s, 0.05)))
        if self.ranks is not None:
            self.ranks.tick(self.replica.steps)
