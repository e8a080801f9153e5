"""What the coordinator learned, kept across restarts: the scheduler's c_ij and the epoch.

Written atomically (a temporary file, fsync, rename, fsync of the folder), so a crash
at any moment leaves either the old file or the new one, never half of one. The view
itself is not kept: nodes re-register within a heartbeat of a restart, and a member
list from before the crash would name nodes that may be gone.

A state file that cannot be read (corrupt, another mesh's, a newer format) stops the
coordinator with an error naming the file, rather than starting fresh behind the
operator's back: moving the file away is a one-line fix, and relearning every c_ij
silently would hide a disk or deployment problem.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gossipd.node.errors import GossipdError

STATE_FILE = "state.json"
FORMAT = 1


class StateError(GossipdError):
    """A state file that cannot be read or written; the message names the file and the fix."""


@dataclass(frozen=True)
class SavedState:
    epoch: int
    scheduler: dict[str, Any]


def load_state(data_dir: Path, mesh_id: str) -> SavedState | None:
    """The saved state of ``mesh_id`` in ``data_dir``, or None when there is none yet."""
    path = data_dir / STATE_FILE
    fix = f"move {path} away to start afresh (the transfer times are relearned)"
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as err:
        raise StateError(f"cannot read coordinator state {path}: {err.strerror}") from None
    try:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        fmt, mesh, epoch, scheduler = (data[k] for k in ("format", "mesh_id", "epoch", "scheduler"))
    except (ValueError, KeyError) as err:
        raise StateError(f"coordinator state {path} is corrupt ({err}); {fix}") from None
    if fmt != FORMAT:
        raise StateError(f"coordinator state {path} has format {fmt!r}, not {FORMAT}; {fix}")
    if mesh != mesh_id:
        raise StateError(
            f"coordinator state {path} belongs to mesh {mesh!r}, this coordinator serves "
            f"{mesh_id!r}; give it its own data_dir, or {fix}"
        )
    if not (isinstance(epoch, int) and epoch >= 0 and isinstance(scheduler, dict)):
        raise StateError(f"coordinator state {path} has a bad epoch or scheduler entry; {fix}")
    return SavedState(epoch, scheduler)


def save_state(data_dir: Path, mesh_id: str, state: SavedState) -> None:
    """Replace ``data_dir/state.json`` with ``state`` atomically."""
    path = data_dir / STATE_FILE
    tmp = path.with_suffix(".json.tmp")
    data = {
        "format": FORMAT,
        "mesh_id": mesh_id,
        "epoch": state.epoch,
        "scheduler": state.scheduler,
    }
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(data_dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as err:
        raise StateError(
            f"cannot write coordinator state {path}: {err.strerror}; free space or fix the "
            "permissions of data_dir (the coordinator keeps serving, from memory)"
        ) from None
