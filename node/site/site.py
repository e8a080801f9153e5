"""One site's daemon put together: job, trainer thread, network node, checkpoints, shutdown.

Files under ``data_dir`` (all written atomically):
``checkpoint.pt`` (every N steps and at shutdown), ``checkpoint.json`` (written after
each ``checkpoint.pt``: its node_id, mesh_id, gossip protocol, job, model fingerprint and
step, which ``gossipd node`` compares with the config before torch loads),
``initial.pt`` (the model before the first step, for consensus studies),
``node.json`` (address, ports, pid, for tools), ``history.jsonl`` (one line per
evaluation) and ``summary.json`` (written when training ends and again at exit).

A data_dir that cannot be written stops the daemon only at start-up (one line,
exit code 2). Later, a failed write (disk full, read-only remount, I/O error)
is logged once per streak of failures and retried: training and gossip go on,
and the last good checkpoint stays in place.

The site's own state is written on its event loop; what runs on the trainer thread
(record, evaluate, checkpoint, summary) is :mod:`gossipd.node.site.training_host`, which
tells the loop what it must know through :mod:`gossipd.node.site.loop_mail`.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gossipd.node.errors import CheckpointError, ConfigError, GossipdError
from gossipd.node.jobs.registry import Job, build_job
from gossipd.node.net.gossip.leaving import warn_unfinished
from gossipd.node.net.limits.cpu_budget import CollectiveThreads
from gossipd.node.net.network import Network
from gossipd.node.net.peers.mqtt import MqttAgent
from gossipd.node.net.status.restart_audit import RestartAudit
from gossipd.node.net.telemetry.metrics import NodeMetrics
from gossipd.node.protocols.base import PeerMass
from gossipd.node.shared.config import NodeConfig
from gossipd.node.shared.statefiles import write_json
from gossipd.node.site.checkpoint_record import SiteIdentity
from gossipd.node.site.checkpoints import SiteCheckpoints
from gossipd.node.site.controls import SiteControls, start_mqtt
from gossipd.node.site.loop_mail import (
    CheckpointWritten,
    Evaluated,
    LoopMail,
    SiteMessage,
    TrainerDied,
)
from gossipd.node.site.progress_log import ProgressLog
from gossipd.node.site.training_host import SiteParts, SiteTrainingHost
from gossipd.node.trainer.ranks import (
    Leader,
    RankEnv,
    join_group,
    model_device,
    site_spec,
    sync_gradients,
)
from gossipd.node.trainer.replica import Replica
from gossipd.node.trainer.trainer_loop import TrainingLoop, TrainingPlan

log = logging.getLogger(__name__)

# How far past shutdown_timeout_s a shutdown may run before its threads' stacks are dumped.
STUCK_SHUTDOWN_AFTER_S = 30.0


class Site:
    def __init__(
        self, config: NodeConfig, job: Job | None = None, rank_env: RankEnv | None = None
    ) -> None:
        """``rank_env``: this process is rank 0 of a multi-rank site (torchrun or
        ``--ranks``): it joins the site's process group and drives the other ranks."""
        self.config = config
        self.job = job or build_job(site_spec(config, rank_env))
        self.replica = Replica.from_config(config, self.job.model)
        self.rank_env = rank_env
        self.ranks = _lead_ranks(config, rank_env, self.job, self.replica)
        self.metrics = NodeMetrics()
        self.metrics.site_ranks.set(1 if rank_env is None else rank_env.world)
        self.network = Network(config, self.replica, self.metrics)
        self.network.status.ranks = 1 if rank_env is None else rank_env.world
        if self.ranks is not None:
            self.network.budget.collectives = CollectiveThreads()
        self.data_dir = Path(config.data_dir)
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(
                f"data_dir = {self.data_dir}: cannot create the directory: {err.strerror}; "
                "point data_dir at a directory this user can write"
            ) from None
        self.checkpoints = SiteCheckpoints(
            self.data_dir,
            SiteIdentity.of(config),
            replica=self.replica,
            optimizer=self.job.optimizer,
            metrics=self.metrics,
            every_steps=config.checkpoint.every_steps,
        )
        # The trainer thread's messages to this loop (an evaluation, a checkpoint's step,
        # training died), delivered once run() attaches the running loop.
        self.mail = LoopMail(self._on_loop)
        self.host = SiteTrainingHost(
            SiteParts(
                config.node_id,
                self.data_dir,
                self.job,
                self.replica,
                self.ranks,
                1 if rank_env is None else rank_env.world,
                self.metrics,
                self.network.budget,
                self.checkpoints,
            ),
            self.mail,
        )
        self.loop_thread = TrainingLoop(
            config.node_id,
            replica=self.replica,
            job=self.job,
            ranks=self.ranks,
            budget=self.network.budget,
            plan=TrainingPlan.from_config(config),
            host=self.host,
        )
        self.mqtt: MqttAgent | None = None  # set on the loop by run()
        self._stop: asyncio.Event | None = None  # set on the loop by run()

    # -- on the loop ------------------------------------------------------------------
    def _on_loop(self, message: SiteMessage) -> None:
        """A message from the trainer thread, handled on the loop (:class:`LoopMail`)."""
        if isinstance(message, Evaluated):
            self.network.status.evaluation = (message.metrics, message.step)
        elif isinstance(message, CheckpointWritten):
            self.checkpoints.saved(message.step)
        elif isinstance(message, TrainerDied) and self._stop is not None:
            self._stop.set()

    @property
    def last_eval(self) -> dict[str, float]:
        """The trainer thread's last evaluation ({} before the first)."""
        return self.host.last_eval

    @property
    def saved_step(self) -> int | None:
        return self.checkpoints.saved_step

    @property
    def final_checkpoint_error(self) -> CheckpointError | None:
        return self.checkpoints.final_error

    def write_node_json(self) -> None:
        write_json(
            self.data_dir / "node.json",
            {
                "node_id": self.config.node_id,
                "address": self.network.address,
                "metrics_port": self.metrics.port,
                "pid": os.getpid(),
                "fingerprint": self.replica.fingerprint,
            },
        )

    # -- lifecycle ------------------------------------------------------------------
    async def bootstrap(self) -> None:
        """A joining node copies a live peer's model before its first step (its weight is 0)."""
        if not await self.network.wait_for_peers(1, self.config.join_timeout_s):
            raise GossipdError(
                f"join: no peer answered within {self.config.join_timeout_s} s; check seeds"
            )
        peer = self.network.membership.live()[0]
        await self.network.bootstrap_from(peer.node_id)
        log.info("bootstrapped the model from %s", peer.node_id)

    async def run(self, stop: asyncio.Event) -> None:
        """Start, train until ``stop`` is set (or training dies), then shut down.

        Start-up failures before the server runs leave nothing to clean up; after
        it runs, every way out goes through :meth:`shutdown`.
        """
        self.checkpoints.restore()
        accounts = self.replica.summary.exchanged  # the checkpoint's, before any exchange
        await self.network.start()
        if self.checkpoints.resumed_from is not None:
            self.network.tasks.spawn(self._audit_restart(accounts), "restart-audit")
        progress = self._progress()
        try:
            try:
                self.write_node_json()
            except OSError as err:
                log.warning("cannot write node.json in data_dir %s: %s", self.data_dir, err)
            self.mqtt = start_mqtt(
                self.config,
                address=self.network.address,
                incarnation=self.network.incarnation,
                peers=self.network.peering,
                controls=SiteControls(
                    self.loop_thread.resumed, self.replica, self.checkpoints, stop
                ),
                metrics=self.metrics,
                material=lambda: self.network.tls.material,
            )
            if self.mqtt is not None:  # an outbound-only site's relays change its address
                self.network.readvertised.append(self.mqtt.readvertise)
            self._stop = stop
            self.mail.attach(asyncio.get_running_loop())
            self.loop_thread.start()
            if not await _unless_stopped(self._before_training(), stop):
                log.info("stopped before training started")
                return
            self.loop_thread.go.set()
            await stop.wait()
        finally:
            if progress is not None:
                progress.cancel()
            await self.shutdown()

    async def _audit_restart(self, accounts: Mapping[str, PeerMass]) -> None:
        """Learn from the peers what resuming from the checkpoint cost the mesh."""
        assert self.checkpoints.resumed_from is not None
        audit = RestartAudit(
            node_id=self.config.node_id,
            incarnation=self.network.incarnation,
            checkpoint_step=self.checkpoints.resumed_from,
            segments=len(self.replica.summary.weights),
            accounts=accounts,
            peers=self.network.peering.known,
            tls=self.network.tls,
            metrics=self.metrics,
            publish=self.network.status.set_crash,
        )
        await audit.run()

    def _progress(self) -> asyncio.Task[None] | None:
        """The periodic INFO line an operator tails (none when progress_interval_s = 0)."""
        if not self.config.progress_interval_s:
            return None
        lines = ProgressLog(
            self.config.progress_interval_s,
            self.replica.published,
            self.network.live_peers,
            ranks=self.network.status.ranks,
        )
        return asyncio.create_task(lines.run(), name="progress-log")

    async def _before_training(self) -> None:
        if self.config.join and self.checkpoints.resumed_from is None:
            await self.bootstrap()
        wanted = self.config.membership.start_after_peers
        if wanted and not await self.network.wait_for_peers(
            wanted, self.config.membership.start_timeout_s
        ):
            raise GossipdError(
                f"membership.start_after_peers = {wanted}: only "
                f"{len(self.network.membership.live())} peers became live within "
                f"{self.config.membership.start_timeout_s} s; check seeds and firewalls"
            )

    async def shutdown(self) -> None:
        """Stop training, settle pushes, hand weight off, say goodbye, checkpoint: bounded.

        The network is closed whatever happens before, so no server or task
        outlives the loop. A final checkpoint that fails is kept in
        ``final_checkpoint_error`` for the caller to report, not raised.
        """
        deadline = time.monotonic() + self.config.shutdown_timeout_s
        log.info(
            "shutting down: settling pushes and handing weight off within "
            "shutdown_timeout_s = %g s",
            self.config.shutdown_timeout_s,
        )
        # A shutdown is bounded; one stuck far past its bound prints every thread's stack
        # to stderr (the daemon's log), which says where, instead of a silent hang.
        faulthandler.dump_traceback_later(
            self.config.shutdown_timeout_s + STUCK_SHUTDOWN_AFTER_S, exit=False
        )
        try:
            if self.mqtt is not None:  # first: nobody should be pointed here any more
                await self.mqtt.close()
            await self.network.close_coordinator()
            self.loop_thread.halt.set()
            driver = self.loop_thread
            # Never started, or died (it may not have returned yet): something must drive.
            if not driver.is_alive() or driver.error is not None:
                driver = threading.Thread(
                    target=self.replica.idle_until,
                    args=(driver.release, self.host.record_merges),
                    daemon=True,
                )
                driver.start()
            try:
                await asyncio.wait_for(
                    self.network.leave_mesh(), max(0.1, deadline - time.monotonic() - 1.0)
                )
            except (TimeoutError, GossipdError) as err:
                warn_unfinished(err, self.config.shutdown_timeout_s)
            finally:
                self.loop_thread.release.set()
                await asyncio.to_thread(driver.join, max(0.1, deadline - time.monotonic()))
            self.checkpoints.final(trained=self.loop_thread.stepped)
            self.host.write_summary(training_done=self.loop_thread.finished.is_set())
        finally:
            await self.network.close(grace_s=0.5)
            faulthandler.cancel_dump_traceback_later()


def _lead_ranks(
    config: NodeConfig, rank_env: RankEnv | None, job: Job, replica: Replica
) -> Leader | None:
    """Rank 0 of a multi-rank site joins the site's process group and leads its ranks."""
    if rank_env is None:
        return None
    device = model_device(job.model)
    join_group(config, rank_env, device)
    sync_gradients(job.optimizer, rank_env.world)
    return Leader(
        replica.flat,
        job.optimizer,
        device,
        heartbeat_s=min(1.0, config.ranks.collective_timeout_s / 4),
    )


async def _unless_stopped(work: Any, stop: asyncio.Event) -> bool:
    """Run ``work`` unless ``stop`` is set first (then cancel it): SIGTERM during a long
    start-up wait (bootstrap, start_after_peers) must not wait for it to time out."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, stopped):
            t.cancel()
        await asyncio.gather(task, stopped, return_exceptions=True)
    if task.cancelled():
        return False
    task.result()  # re-raises a start-up failure
    return True
