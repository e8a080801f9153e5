"""Atomic checkpoints: a crash at any instant leaves either the old file or the new one.

A checkpoint holds the flat segments, the protocol core's whole state as its
``state_dict`` gave it (opaque here: only a core of the same protocol reads it back),
what the core's ``status`` said of it at that moment (the sum-weights and the weight
exchanged with each peer, for the launcher, logs and audits), the step, and the
optimizer state. Weights reserved by pushes still in flight are saved as held (not
yet given away): on a crash between a push's merge at the receiver and its
acknowledgement here, that mass is counted twice, which is the bounded error
docs/design.md §5 accepts for faults.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch

from gossipd.node.errors import CheckpointError
from gossipd.node.protocols.base import PeerMass
from gossipd.node.trainer.replica import Replica

# 3: the core's state and what its status said (weights, exchanged); 2: the core's state
# only; 1: sum-weights only. 1 and 2 are still read (see _status_of_older_format).
FORMAT = 3
FILENAME = "checkpoint.pt"
_START_ANEW = (
    "to start anew, point data_dir at a fresh directory or move checkpoint.pt and "
    "checkpoint.json out of it"
)


@dataclass
class Checkpoint:
    node_id: str
    fingerprint: str
    step: int
    core: dict[str, Any]  # the core's state_dict(), for its load_state_dict() only
    segments: list[torch.Tensor]
    optimizer: dict[str, Any] | None = None
    # The core's status() when the state was taken: sum-weights per segment (empty for a
    # core that keeps none), and the weight exchanged with each peer.
    weights: list[float] = field(default_factory=list)
    exchanged: dict[str, PeerMass] = field(default_factory=dict)


def capture(replica: Replica, node_id: str, optimizer: torch.optim.Optimizer | None) -> Checkpoint:
    """A consistent copy of the trainer's state, taken under its lock; the core's state and
    its status are taken together, under the core's lock."""
    with replica.lock, replica.core_lock:
        status = replica.core.status()
        return Checkpoint(
            node_id=node_id,
            fingerprint=replica.fingerprint,
            step=replica.steps,
            core=replica.state_dict(),
            segments=[b.detach().cpu().clone() for b in replica.flat.buffers],
            optimizer=optimizer.state_dict() if optimizer is not None else None,
            weights=[float(w) for w in status.weights],
            exchanged=dict(status.exchanged),
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
        "weights": [float(w) for w in ckpt.weights],
        "exchanged": {peer: asdict(mass) for peer, mass in ckpt.exchanged.items()},
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
        # torch's unpickling errors run to several lines of advice for another case.
        why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"cannot read checkpoint {path}: {why}; put back a good copy, or {_START_ANEW}"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") not in (1, 2, FORMAT):
        raise CheckpointError(
            f"{path} is not a gossipd checkpoint of format 1 to {FORMAT}; {_START_ANEW}"
        )
    if payload["fingerprint"] != fingerprint:
        raise CheckpointError(
            f"checkpoint {path} is for model {payload['fingerprint']}, but this job builds "
            f"{fingerprint} (job.name or job.options changed since it was written); set them "
            f"back to resume it, or {_START_ANEW}"
        )
    if payload["format"] == FORMAT:
        core, weights = payload["core"], [float(w) for w in payload["weights"]]
        exchanged = {peer: PeerMass(**mass) for peer, mass in payload["exchanged"].items()}
    else:
        core, weights, exchanged = _status_of_older_format(payload)
    return Checkpoint(
        node_id=payload["node_id"],
        fingerprint=payload["fingerprint"],
        step=int(payload["step"]),
        core=core,
        segments=list(payload["segments"]),
        optimizer=payload["optimizer"],
        weights=weights,
        exchanged=exchanged,
    )


def _status_of_older_format(
    payload: dict[str, Any],
) -> tuple[dict[str, Any], list[float], dict[str, PeerMass]]:
    """The core's state and its sum-weights from a file of format 1 or 2, which recorded no
    status. Both layouts are frozen: format 1 saved the weights alone (resumed as a core
    state that holds only them), format 2 the state of the sum-weight ledger of its
    release, whose held weights were its ``weights`` entry (none for a core without
    sum-weights). Neither recorded the weight exchanged with each peer."""
    if payload["format"] == 1:
        weights = [float(w) for w in payload["weights"]]
        return {"weights": weights}, weights, {}
    core = payload["core"]
    return core, [float(w) for w in core.get("weights", ())], {}
