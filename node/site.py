"""One site's daemon put together: job, trainer thread, network node, checkpoints, shutdown.

Files under ``data_dir`` (all written atomically):
``checkpoint.pt`` (every N steps and at shutdown), ``initial.pt`` (the model
before the first step, for consensus studies), ``node.json`` (address, ports,
pid, for tools), ``history.jsonl`` (one line per evaluation) and
``summary.json`` (written when training ends and again at exit).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gossipd.node import checkpoint
from gossipd.node.config import NodeConfig
from gossipd.node.daemon import Node
from gossipd.node.errors import GossipdError
from gossipd.node.jobs import Job, JobSpec, build_job
from gossipd.node.metrics import NodeMetrics
from gossipd.node.trainer import GossipTrainer, StepReport

log = logging.getLogger(__name__)


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


class TrainingLoop(threading.Thread):
    """The trainer thread: steps, merges at step boundaries, evaluates, checkpoints."""

    def __init__(self, site: Site) -> None:
        super().__init__(name=f"trainer-{site.config.node_id}", daemon=True)
        self.site = site
        self.halt = threading.Event()
        # Called on the trainer thread if training dies: the daemon must not idle on as a
        # silent, half-alive peer, so the site shuts down (and `gossipd node` exits 1).
        self.on_fatal: Callable[[], None] = lambda: None
        self.finished = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        site, cfg = self.site, self.site.config.job
        started = time.monotonic()
        try:
            while not self.halt.is_set():
                if self.finished.is_set():
                    site.trainer.idle(0.05)
                    continue
                t0 = time.perf_counter()
                with site.trainer.lock:
                    loss = site.job.train_step()
                    report = site.trainer.step(loss)
                site.record(report, time.perf_counter() - t0, loss)
                step = site.trainer.steps
                if cfg.eval_every_steps and step % cfg.eval_every_steps == 0:
                    site.evaluate()
                every = site.config.checkpoint.every_steps
                if every and step % every == 0:
                    site.save_checkpoint()
                elapsed = time.monotonic() - started
                if (cfg.max_steps and step >= cfg.max_steps) or (
                    cfg.duration_s and elapsed >= cfg.duration_s
                ):
                    site.evaluate()
                    site.trainer.training_done = True
                    site.write_summary(training_done=True)
                    self.finished.set()
        except BaseException as err:
            log.exception("trainer thread failed")
            self.error = err
            self.on_fatal()
            self.finished.set()


class Site:
    def __init__(self, config: NodeConfig, job: Job | None = None) -> None:
        self.config = config
        self.job = job or build_job(
            JobSpec(
                name=config.job.name,
                seed=config.job.seed,
                shard_index=config.job.shard_index,
                num_shards=config.job.num_shards,
                learning_rate=config.job.learning_rate,
                batch_size=config.job.batch_size,
                options=dict(config.job.options),
            )
        )
        self.trainer = GossipTrainer(
            config.node_id,
            self.job.model,
            push_probability=config.gossip.push_probability,
            segment_bytes=config.gossip.segment_bytes,
            inbox_size=config.limits.inbox_size,
            seed=config.gossip.seed,
            initial_weight=0.0 if config.join else 1.0,
        )
        self.metrics = NodeMetrics()
        self.node = Node(config, self.trainer, self.metrics)
        self.data_dir = Path(config.data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.loop_thread = TrainingLoop(self)
        self.resumed_from: int | None = None
        self.last_eval: dict[str, float] = {}

    # -- trainer-thread helpers -------------------------------------------------------
    def record(self, report: StepReport, step_time_s: float, loss: float) -> None:
        self.metrics.record_step(report, step_time_s, loss)
        self.metrics.record_weights(self.trainer.summary.weights)
        for failure in report.failed:
            log.debug("push %d to %s failed: %s", failure.sequence, failure.peer, failure.error)

    def evaluate(self) -> None:
        with self.trainer.lock:
            result = {k: float(v) for k, v in self.job.evaluate().items()}
            step, loss = self.trainer.steps, self.trainer.last_loss
        self.last_eval = result
        for key, value in result.items():
            self.metrics.eval_metric.labels(key).set(value)
        line = {"unix_s": time.time(), "step": step, "loss": loss, **result}
        with open(self.data_dir / "history.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")

    def save_checkpoint(self, name: str = checkpoint.FILENAME) -> None:
        ckpt = checkpoint.capture(self.trainer, self.config.node_id, self.job.optimizer)
        checkpoint.save(self.data_dir, ckpt, name)

    def write_summary(self, *, training_done: bool) -> None:
        s = self.trainer.summary
        write_json(
            self.data_dir / "summary.json",
            {
                "node_id": self.config.node_id,
                "steps": s.steps,
                "loss": s.loss,
                "sum_weights": s.weights,
                "training_done": training_done,
                "resumed_from_step": self.resumed_from,
                **self.last_eval,
            },
        )

    # -- lifecycle ------------------------------------------------------------------
    def restore(self) -> None:
        path = self.data_dir / checkpoint.FILENAME
        if not path.exists():
            self.save_checkpoint("initial.pt")
            return
        ckpt = checkpoint.load(path, fingerprint=self.trainer.fingerprint)
        with self.trainer.lock:
            for index, values in enumerate(ckpt.segments):
                self.trainer.flat.load_segment(index, values)
            self.trainer.core.weights = list(ckpt.weights)
            self.trainer.steps = ckpt.step
            if ckpt.optimizer is not None:
                self.job.optimizer.load_state_dict(ckpt.optimizer)
        self.resumed_from = ckpt.step
        log.info(
            "resumed %s from step %d, weights %s", self.config.node_id, ckpt.step, ckpt.weights
        )

    async def bootstrap(self) -> None:
        """A joining node copies a live peer's model before its first step (its weight is 0)."""
        if not await self.node.wait_for_peers(1, self.config.join_timeout_s):
            raise GossipdError(
                f"join: no peer answered within {self.config.join_timeout_s} s; check seeds"
            )
        peer = self.node.membership.live()[0]
        model = await self.node.client(peer.address).pull(
            self.trainer.flat.plan, self.node.limits, self.config.gossip.push_timeout_s
        )
        with self.trainer.lock:
            for index, values in model.items():
                self.trainer.flat.load_segment(index, values)
        log.info("bootstrapped the model from %s", peer.node_id)

    async def run(self, stop: asyncio.Event) -> None:
        self.restore()
        await self.node.start()
        write_json(
            self.data_dir / "node.json",
            {
                "node_id": self.config.node_id,
                "address": self.node.address,
                "metrics_port": self.metrics.port,
                "pid": os.getpid(),
                "fingerprint": self.trainer.fingerprint,
            },
        )
        try:
            if self.config.join and self.resumed_from is None:
                await self.bootstrap()
            wanted = self.config.membership.start_after_peers
            if wanted and not await self.node.wait_for_peers(
                wanted, self.config.membership.start_timeout_s
            ):
                raise GossipdError(
                    f"membership.start_after_peers = {wanted}: only "
                    f"{len(self.node.membership.live())} peers became live within "
                    f"{self.config.membership.start_timeout_s} s; check seeds and firewalls"
                )
            loop = asyncio.get_running_loop()
            self.loop_thread.on_fatal = lambda: loop.call_soon_threadsafe(stop.set)
            self.loop_thread.start()
            await stop.wait()
        finally:
            await self.shutdown()

    async def shutdown(self) -> None:
        """Stop training, settle pushes, hand weight off, say goodbye, checkpoint: bounded."""
        deadline = time.monotonic() + self.config.shutdown_timeout_s
        self.loop_thread.halt.set()
        if self.loop_thread.is_alive():
            await asyncio.to_thread(self.loop_thread.join, max(0.1, deadline - time.monotonic()))
        try:
            await asyncio.wait_for(
                self.node.leave_mesh(), max(0.1, deadline - time.monotonic() - 1.0)
            )
        except (TimeoutError, GossipdError) as err:
            log.warning("leaving the mesh did not complete: %r", err)
        self.save_checkpoint()
        self.write_summary(training_done=self.loop_thread.finished.is_set())
        await self.node.close(grace_s=0.5)
