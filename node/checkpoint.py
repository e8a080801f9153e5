"""Atomic checkpoints: a crash at any instant leaves either the old file or the new one.

A checkpoint holds the flat segments, the sum-weights that go with them, the
step, and the optimizer state. Weights reserved by pushes still in flight are
saved as held (not yet given away): on a crash between a push's merge at the
receiver and its acknowledgement here, that mass is counted twice, which is the
bounded error DESIGN §5 accepts for faults.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gossipd.node.errors import CheckpointError
from gossipd.node.trainer import GossipTrainer

FORMAT = 1
FILENAME = "checkpoint.pt"


@dataclass
class Checkpoint:
    node_id: str
    fingerprint: str
    step: int
    weights: list[float]
    segments: list[torch.Tensor]
    optimizer: dict[str, Any] | None = None


def capture(
    trainer: GossipTrainer, node_id: str, optimizer: torch.optim.Optimizer | None
) -> Checkpoint:
    """A consistent copy of the trainer's state, taken under its lock."""
    with trainer.lock:
        return Checkpoint(
            node_id=node_id,
            fingerprint=trainer.fingerprint,
            step=trainer.steps,
            weights=list(trainer.core.weights),
            segments=[b.detach().cpu().clone() for b in trainer.flat.buffers],
            optimizer=optimizer.state_dict() if optimizer is not None else None,
        )


def save(directory: Path, ckpt: Checkpoint, filename: str = FILENAME) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / filename
    payload = {
        "format": FORMAT,
        "node_id": ckpt.node_id,
        "fingerprint": ckpt.fingerprint,
        "step": ckpt.step,
        "weights": list(ckpt.weights),
        "segments": [s.detach().cpu() for s in ckpt.segments],
        "optimizer": ckpt.optimizer,
    }
    fd, tmp = tempfile.mkstemp(prefix=f".{filename}.", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return target


def load(path: Path, *, fingerprint: str) -> Checkpoint:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointError(f"cannot read checkpoint {path}: {err}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a gossipd checkpoint of format {FORMAT}")
    if payload["fingerprint"] != fingerprint:
        raise CheckpointError(
            f"checkpoint {path} is for model {payload['fingerprint']}, this job builds "
            f"{fingerprint}; point data_dir elsewhere or delete the checkpoint"
        )
    return Checkpoint(
        node_id=payload["node_id"],
        fingerprint=payload["fingerprint"],
        step=int(payload["step"]),
        weights=[float(w) for w in payload["weights"]],
        segments=list(payload["segments"]),
        optimizer=payload["optimizer"],
    )
