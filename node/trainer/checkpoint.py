"""Atomic checkpoints: a crash at any instant leaves either the old file or the new one.

A checkpoint holds the flat segments, the protocol core's whole state (sum-weights,
round, de-duplication windows, what was in flight), the step, and the optimizer
state. Weights reserved by pushes still in flight are
saved as held (not yet given away): on a crash between a push's merge at the
receiver and its acknowledgement here, that mass is counted twice, which is the
bounded error docs/design.md §5 accepts for faults.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from gossipd.node.errors import CheckpointError
from gossipd.node.trainer.replica import Replica

FORMAT = 2  # 1: sum-weights only, no core state (still read)
FILENAME = "checkpoint.pt"


@dataclass
class Checkpoint:
    node_id: str
    fingerprint: str
    step: int
    core: dict[str, Any]
    segments: list[torch.Tensor]
    optimizer: dict[str, Any] | None = None

    @property
    def weights(self) -> list[float]:
        """Per segment; empty for a core that keeps no sum-weights."""
        return list(self.core.get("weights", ()))


def capture(replica: Replica, node_id: str, optimizer: torch.optim.Optimizer | None) -> Checkpoint:
    """A consistent copy of the trainer's state, taken under its lock."""
    with replica.lock:
        return Checkpoint(
            node_id=node_id,
            fingerprint=replica.fingerprint,
            step=replica.steps,
            core=replica.state_dict(),
            segments=[b.detach().cpu().clone() for b in replica.flat.buffers],
            optimizer=optimizer.state_dict() if optimizer is not None else None,
        )


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed (disk full, read-only, I/O error); the previous file is intact.

    Keeps the path and the kernel's reason apart so callers can phrase the fix
    for their moment (start-up, periodic, shutdown); the message adds the free
    space, which is what an operator checks first.
    """

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"cannot write checkpoint {path}: {reason} ({describe_free(path.parent)})")


def describe_free(directory: Path) -> str:
    """``"12.0 KiB free on DIR"``, for messages about a write that failed there."""
    try:
        free = format_bytes(shutil.disk_usage(directory).free)
    except OSError:
        free = "unknown space"
    return f"{free} free on {directory}"


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class _WriteRecorder:
    """A file wrapper that remembers the OSError of a failed write.

    torch.save reports a short write as ``RuntimeError: ... unexpected pos``; the
    kernel's reason (No space left on device, File too large, Input/output
    error) is only seen by the file's ``write``.
    """

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.file.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.file.flush()


def save(directory: Path, ckpt: Checkpoint, filename: str = FILENAME) -> Path:
    """Write atomically: a temp file in ``directory``, fsync, rename over ``filename``.

    Raises :class:`CheckpointWriteError` if any of it fails; the temp file is
    removed and the previous checkpoint is left as it was.
    """
    target = directory / filename
    payload = {
        "format": FORMAT,
        "node_id": ckpt.node_id,
        "fingerprint": ckpt.fingerprint,
        "step": ckpt.step,
        "core": ckpt.core,
        "segments": [s.detach().cpu() for s in ckpt.segments],
        "optimizer": ckpt.optimizer,
    }
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _write_atomically(directory, target, payload)
    except (OSError, RuntimeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise CheckpointWriteError(target, reason) from None
    return target


def _write_atomically(directory: Path, target: Path, payload: dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            sink = _WriteRecorder(f)
            try:
                torch.save(payload, sink)
            except RuntimeError:
                if sink.error is None:
                    raise
                raise sink.error from None
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load(path: Path, *, fingerprint: str) -> Checkpoint:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointError(f"cannot read checkpoint {path}: {err}") from None
    if not isinstance(payload, dict) or payload.get("format") not in (1, FORMAT):
        raise CheckpointError(f"{path} is not a gossipd checkpoint of format 1 or {FORMAT}")
    if payload["fingerprint"] != fingerprint:
        raise CheckpointError(
            f"checkpoint {path} is for model {payload['fingerprint']}, this job builds "
            f"{fingerprint}; point data_dir elsewhere or delete the checkpoint"
        )
    return Checkpoint(
        node_id=payload["node_id"],
        fingerprint=payload["fingerprint"],
        step=int(payload["step"]),
        core=payload["core"]
        if payload["format"] == FORMAT
        else {"weights": [float(w) for w in payload["weights"]]},
        segments=list(payload["segments"]),
        optimizer=payload["optimizer"],
    )
