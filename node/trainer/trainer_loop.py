"""The trainer thread of a site: steps, merges at step boundaries, evaluates, checkpoints.

Kept apart from :mod:`gossipd.node.site.site` (which puts a daemon together) because it is
the one thread that touches parameters and, in a multi-rank site, issues the site's
collectives, in one order.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from gossipd.node.trainer.torchthreads import adopt_thread_count

if TYPE_CHECKING:
    from gossipd.node.site.site import Site

log = logging.getLogger("gossipd.node.site.site")


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

    def run(self) -> None:
        site, cfg = self.site, self.site.config.job
        adopt_thread_count()
        try:
            while not (self.go.is_set() or self.halt.is_set()):
                self._idle()
            started = time.monotonic()
            budget, replica = site.network.budget, site.replica
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
                with replica.lock:
                    if site.ranks is not None:
                        site.ranks.before_step(replica.steps)
                    loss = site.job.train_step()
                    report = replica.step(loss)
                site.record(report, time.perf_counter() - t0, loss)
                step = site.replica.steps
                if cfg.eval_every_steps and step % cfg.eval_every_steps == 0:
                    site.evaluate()
                every = site.config.checkpoint.every_steps
                if every and step % every == 0:
                    site.periodic_checkpoint()
                elapsed = time.monotonic() - started
                if (cfg.max_steps and step >= cfg.max_steps) or (
                    cfg.duration_s and elapsed >= cfg.duration_s
                ):
                    site.evaluate()
                    site.replica.finish_training()
                    site.write_summary(training_done=True)
                    self.finished.set()
                # All but its merges and push snapshots is the trainer's own work.
                now = (time.thread_time(), replica.gossip_cpu_s)
                budget.add_training(now[0] - mark[0] - (now[1] - mark[1]))
                mark = now
                if cfg.max_steps_per_s:
                    self._pace(t0 + 1.0 / cfg.max_steps_per_s)
            budget.training = False
            if site.ranks is not None:
                site.evaluate()  # every rank records the model the site stops with
                site.ranks.stop(site.replica.steps)
            site.replica.idle_until(self.release)
        except BaseException as err:
            log.exception("trainer thread failed")
            self.error = err
            if site.ranks is not None:
                site.ranks.broken = True  # its collectives cannot be trusted any more
            self.on_fatal()
            self.finished.set()

    def _pace(self, until: float) -> None:
        """Wait out the rest of a paced step, merging what arrives meanwhile.

        A paced trainer leaves its core to others (a site sharing its machine, a test's
        daemons sharing two cores) and stays a full peer: pushes land and merge as they
        would at step boundaries.
        """
        while not self.halt.is_set() and (left := until - time.perf_counter()) > 0:
            self._idle(left)

    def _idle(self, wait_s: float = 0.05) -> None:
        self.site.replica.idle(min(wait_s, 0.05))
        if self.site.ranks is not None:
            self.site.ranks.tick(self.site.replica.steps)
