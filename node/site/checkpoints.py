"""A site's checkpoints on disk: resume or write ``initial.pt`` at start, a periodic write
that warns instead of stopping training, the final one at shutdown. Each ``checkpoint.pt``
is followed by its ``checkpoint.json`` (:mod:`gossipd.node.site.checkpoint_record`), which
the start-up checks read before torch loads.

Kept apart from :mod:`gossipd.node.site.site` (which runs the daemon): this is what a
site keeps of its model between runs, and what a failed write costs (nothing but a
warning once per streak; the last good file stays in place).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gossipd.node.errors import CheckpointError
from gossipd.node.net.telemetry.metrics import NodeMetrics
from gossipd.node.shared.statefiles import FailureStreak
from gossipd.node.site.checkpoint_record import (
    RECORD_FILENAME,
    CheckpointRecord,
    SiteIdentity,
    mismatch_message,
)
from gossipd.node.trainer import checkpoint
from gossipd.node.trainer.replica import Replica

log = logging.getLogger("gossipd.node.site.site")


@dataclass(frozen=True)
class Written:
    """A checkpoint on disk: where, and the step it holds."""

    path: Path
    step: int


class SiteCheckpoints:
    """The checkpoints of one site under its ``data_dir``."""

    def __init__(
        self,
        data_dir: Path,
        identity: SiteIdentity,
        *,
        replica: Replica,
        optimizer: torch.optim.Optimizer,
        metrics: NodeMetrics,
        every_steps: int,
    ) -> None:
        """``identity``: the config keys a checkpoint is written under and may only be
        resumed under."""
        self.data_dir = data_dir
        self.identity = identity
        self.node_id = identity.node_id
        self.replica = replica
        self.optimizer = optimizer
        self.metrics = metrics
        self.resumed_from: int | None = None
        self.restored_weights: list[float] = []
        # The step of the newest checkpoint.pt on disk; written on the loop only (a
        # periodic write's step arrives there as a message).
        self.saved_step: int | None = None
        self.final_error: CheckpointError | None = None
        self.streak = FailureStreak(
            "periodic checkpoint",
            "training and gossip go on, the previous checkpoint is kept and the write is retried "
            f"every {every_steps} steps: free space (or fix the disk) under data_dir; logged "
            "once until a write succeeds",
        )

    def write(self, name: str = checkpoint.FILENAME) -> Written:
        """Write one checkpoint and count it, from any thread (it records nothing here: the
        loop notes the step, :meth:`saved`); raises CheckpointWriteError, the old file
        intact."""
        started = time.perf_counter()
        ckpt = checkpoint.capture(self.replica, self.node_id, self.optimizer)
        try:
            path = checkpoint.save(self.data_dir, ckpt, name)
        except checkpoint.CheckpointWriteError:
            self.metrics.checkpoint_failures.inc()
            raise
        if name == checkpoint.FILENAME:
            self._write_record(ckpt)
            self.metrics.record_checkpoint(time.perf_counter() - started, time.time())
        return Written(path, ckpt.step)

    def saved(self, step: int) -> None:
        """On the loop: the newest ``checkpoint.pt`` on disk holds ``step``."""
        self.saved_step = step

    def save(self, name: str = checkpoint.FILENAME) -> Path:
        """On the loop: :meth:`write`, and note a ``checkpoint.pt``'s step."""
        written = self.write(name)
        if name == checkpoint.FILENAME:
            self.saved(written.step)
        return written.path

    def _write_record(self, ckpt: checkpoint.Checkpoint) -> None:
        """checkpoint.json after checkpoint.pt: its identity never changes within a run, so
        a crash between the two leaves at worst a stale step in it."""
        record = CheckpointRecord(self.identity, ckpt.fingerprint, ckpt.step)
        try:
            record.write(self.data_dir)
        except OSError as err:
            self.metrics.checkpoint_failures.inc()
            path = self.data_dir / RECORD_FILENAME
            raise checkpoint.CheckpointWriteError(path, err.strerror or str(err)) from None

    def periodic(self) -> Written | None:
        """On the trainer thread: a failed periodic write must not stop training, so it
        warns once per streak and is retried later (None); the loop is told of a
        written one."""
        try:
            written = self.write()
        except checkpoint.CheckpointWriteError as err:
            self.streak.failed(err)
            return None
        self.streak.succeeded(written.path)
        return written

    def restore(self) -> None:
        """Resume from checkpoint.pt, or write initial.pt; fails if data_dir is not writable."""
        self.check_writable()
        path = self.data_dir / checkpoint.FILENAME
        if not path.exists():
            try:
                self.save("initial.pt")
            except checkpoint.CheckpointWriteError as err:
                raise self._unwritable(f"cannot write {err.path.name}: {err.reason}") from None
            self.restored_weights = list(self.replica.summary.weights)
            return
        ckpt = checkpoint.load(path, fingerprint=self.replica.fingerprint)
        self._check_owner(ckpt)
        self.replica.restore(ckpt.segments, ckpt.core, ckpt.step)
        if ckpt.optimizer is not None:
            self.optimizer.load_state_dict(ckpt.optimizer)
        self.resumed_from = self.saved_step = ckpt.step
        self.restored_weights = list(ckpt.weights)
        self.metrics.checkpoint_last_success.set(path.stat().st_mtime)
        log.info("resumed %s from step %d, weights %s", self.node_id, ckpt.step, ckpt.weights)

    def _check_owner(self, ckpt: checkpoint.Checkpoint) -> None:
        """Another node's checkpoint, or another protocol's core state, is refused before
        anything is restored. The start-up checks already compared checkpoint.json; this
        covers a data_dir written before that file existed, or without it."""
        written = {"node_id": ckpt.node_id, "gossip.protocol": ckpt.core.get("protocol")}
        now = {"node_id": self.identity.node_id, "gossip.protocol": self.identity.protocol}
        for key, value in written.items():
            if value is not None and value != now[key]:  # format 1 names no protocol
                raise CheckpointError(mismatch_message(self.data_dir, key, value, now[key]))

    def check_writable(self) -> None:
        """Probe data_dir with a small write, so a resumed node fails at start, not later."""
        probe = self.data_dir / f".write-probe-{os.getpid()}"  # ranks share data_dir
        try:
            probe.write_bytes(b"gossipd")
            probe.unlink()
        except OSError as err:
            with contextlib.suppress(OSError):
                probe.unlink()
            raise self._unwritable(f"cannot write there: {err.strerror}") from None

    def _unwritable(self, what: str) -> CheckpointError:
        return CheckpointError(
            f"data_dir = {self.data_dir}: {what} ({checkpoint.describe_free(self.data_dir)}); "
            "free space or fix permissions there, or point data_dir elsewhere"
        )

    def final(self, trained: bool) -> None:
        """The checkpoint a site leaves at shutdown; a failure is kept in ``final_error``
        for the caller to report, not raised."""
        # A node that never trained and whose weights did not move (no hand-off, no
        # merge) has nothing new to save; skipping keeps a joiner that failed to
        # bootstrap from resuming, on restart, as if it had.
        if not trained and list(self.replica.summary.weights) == self.restored_weights:
            return
        try:
            self.save()
        except checkpoint.CheckpointWriteError as err:
            self.final_error = err
            return
        log.info(
            "wrote the final checkpoint (step %d, weights %s) to %s",
            self.replica.steps,
            [round(w, 6) for w in self.replica.summary.weights],
            self.data_dir / checkpoint.FILENAME,
        )
