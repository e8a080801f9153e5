"""What a site does for its trainer thread (the :class:`TrainingHost` of
:mod:`gossipd.node.trainer.trainer_loop`): record each step's metrics, evaluate and append
to ``history.jsonl``, write periodic checkpoints and ``summary.json``, and hear that
training died.

Kept apart from :mod:`gossipd.node.site.site` (which runs the event loop) because all of
it runs on the trainer thread, and its state is the trainer thread's: the counts already
exported, the last evaluation, the streaks of failed writes. What the loop must learn of
it (an evaluation for the Status reply, a checkpoint's step, a death) goes as a typed
message through :class:`~gossipd.node.site.loop_mail.LoopMail`; nothing here writes the
loop's state.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from gossipd.node.jobs.registry import Job
from gossipd.node.jobs.spec import batch_size_of
from gossipd.node.net.limits.cpu_budget import CpuBudget
from gossipd.node.net.telemetry.metrics import NodeMetrics
from gossipd.node.shared.statefiles import FailureStreak, write_json
from gossipd.node.site.checkpoints import SiteCheckpoints
from gossipd.node.site.loop_mail import CheckpointWritten, Evaluated, LoopMail, TrainerDied
from gossipd.node.trainer.ranks import Leader, rank_record, write_record
from gossipd.node.trainer.replica import Replica
from gossipd.node.trainer.report import StepReport

log = logging.getLogger("gossipd.node.site.site")

ONCE = "free space (or fix the disk) under data_dir; logged once until a write succeeds"


@dataclass(frozen=True)
class SiteParts:
    """The parts of a site its trainer thread records into and reads: ``world`` is the
    number of ranks, each of which takes a batch a step."""

    node_id: str
    data_dir: Path
    job: Job
    replica: Replica
    ranks: Leader | None
    world: int
    metrics: NodeMetrics
    budget: CpuBudget
    checkpoints: SiteCheckpoints


class SiteTrainingHost:
    """A site as its trainer thread sees it; every method runs on that thread, but for
    :meth:`write_summary`, which the loop calls again at exit once the thread is done."""

    def __init__(self, parts: SiteParts, mail: LoopMail) -> None:
        self.parts = parts
        self.mail = mail
        self.last_eval: dict[str, float] = {}
        # The job and the ranks do not change: their samples a step, read once.
        self._samples_per_step = batch_size_of(parts.job) * parts.world
        self._broadcasts_counted = 0
        self._outer_counted = 0
        self.history_streak = FailureStreak(
            "appending to history.jsonl", f"training goes on without these lines: {ONCE}"
        )
        self.summary_streak = FailureStreak(
            "writing summary.json", "the daemon goes on; it is written again at exit"
        )

    def trainer_died(self) -> None:
        """Training died: the site shuts down, on its loop."""
        self.mail.send(TrainerDied())

    def record_merges(self, report: StepReport) -> None:
        self.parts.metrics.record_merges(report)

    def record(self, report: StepReport, step_time_s: float, loss: float) -> None:
        p = self.parts
        p.metrics.record_step(report, step_time_s, loss, self._samples_per_step)
        outer = p.replica.outer_steps
        p.metrics.outer_steps.inc(outer - self._outer_counted)
        self._outer_counted = outer
        if p.ranks is not None:
            p.metrics.rank_broadcasts.inc(p.ranks.broadcasts - self._broadcasts_counted)
            self._broadcasts_counted = p.ranks.broadcasts
        for failure in report.failed:
            log.debug("push %d to %s failed: %s", failure.sequence, failure.peer, failure.error)

    def evaluate(self, shared: Mapping[int, torch.Tensor] | None = None) -> None:
        """Test metrics of this site's model, or of ``shared`` segments in its place; every
        rank of a multi-rank site evaluates the same parameters and records its own
        result."""
        p = self.parts
        replica = p.replica
        with replica.lock, replica.flat.holding(shared or {}):
            if p.ranks is not None:
                p.ranks.evaluate(replica.steps)
            result = {k: float(v) for k, v in p.job.evaluate().items()}
            step, loss = replica.steps, replica.last_loss
            if p.ranks is not None:
                write_record(p.data_dir, 0, rank_record(0, step, replica.flat, result))
        self.last_eval = result
        self.mail.send(Evaluated(result, step))
        for key, value in result.items():
            p.metrics.eval_metric.labels(key).set(value)
        line = {"unix_s": time.time(), "step": step, "loss": loss, **result}
        path = p.data_dir / "history.jsonl"
        try:
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError as err:
            self.history_streak.failed(err)
        else:
            self.history_streak.succeeded(path)

    def periodic_checkpoint(self) -> None:
        written = self.parts.checkpoints.periodic()
        if written is not None:
            self.mail.send(CheckpointWritten(written.step))

    def write_summary(self, *, training_done: bool) -> None:
        p = self.parts
        s = p.replica.summary
        path = p.data_dir / "summary.json"
        try:
            write_json(
                path,
                {
                    "node_id": p.node_id,
                    "steps": s.steps,
                    "loss": s.loss,
                    "sum_weights": s.weights,
                    "wait_s": s.wait_s,
                    "wait_fraction": s.wait_fraction,
                    "gossip_cpu_share": round(p.budget.share_while_training, 4),
                    "gossip_cpu_share_mean": round(p.budget.mean_share_while_training(), 4),
                    "pushes_held": p.budget.held_pushes,
                    # persyn's outer optimizer: bursts it stepped on (the recording one
                    # included); a burst whose pushes did not all merge takes none
                    "outer_steps": p.replica.outer_steps,
                    # segments merged, and of them pulled in by the clip (limits.clip_factor)
                    "merged_segments": p.metrics.merged_segments,
                    "clipped_segments": p.metrics.clipped_segments,
                    "training_done": training_done,
                    "resumed_from_step": p.checkpoints.resumed_from,
                    **self.last_eval,
                },
            )
        except OSError as err:
            self.summary_streak.failed(err)
        else:
            self.summary_streak.succeeded(path)
