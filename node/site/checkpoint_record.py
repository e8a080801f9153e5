"""``checkpoint.json``: who wrote a site's ``checkpoint.pt``, readable without torch.

A data_dir resumed by a config of another node, mesh, protocol or job would fail deep
inside the restore (a core refusing another protocol's state) or, worse, resume a model
that belongs elsewhere. Reading ``checkpoint.pt`` takes torch, which takes seconds to
load; this small file, written next to it each time it is written, lets the start-up
checks (:mod:`gossipd.node.site.preflight`) refuse such a start before torch loads. Its
model fingerprint and step are for tools and people: the fingerprint is only known once
the job is built, where ``checkpoint.load`` checks it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from gossipd.node.errors import ConfigError
from gossipd.node.shared.config import NodeConfig
from gossipd.node.shared.statefiles import write_json

RECORD_FILENAME = "checkpoint.json"
CHECKPOINT_FILENAME = "checkpoint.pt"  # gossipd.node.trainer.checkpoint.FILENAME, without torch
# The config key of each SiteIdentity field whose name is not that key, for the messages.
CONFIG_KEYS = {"protocol": "gossip.protocol", "job": "job.name"}


@dataclass(frozen=True)
class SiteIdentity:
    """What a checkpoint may only be resumed under: the config keys it was written with."""

    node_id: str
    mesh_id: str
    protocol: str  # gossip.protocol
    job: str  # job.name

    @classmethod
    def of(cls, config: NodeConfig) -> SiteIdentity:
        return cls(config.node_id, config.mesh_id, config.gossip.protocol, config.job.name)

    def first_mismatch(self, written: SiteIdentity) -> tuple[str, str, str] | None:
        """``(config key, value written, value now)`` of the first field that differs."""
        for field in fields(SiteIdentity):
            then, now = getattr(written, field.name), getattr(self, field.name)
            if then != now:
                return CONFIG_KEYS.get(field.name, field.name), then, now
        return None


def mismatch_message(data_dir: Path, key: str, written: str, now: str) -> str:
    """One line: which key, both values, and the two fixes (resume, or start anew)."""
    return (
        f"data_dir {data_dir} holds a checkpoint written with {key} = {written!r}, but this "
        f"config has {key} = {now!r}; set {key} = {written!r} to resume it, or point data_dir "
        f"at a fresh directory (or move {CHECKPOINT_FILENAME} and {RECORD_FILENAME} out of it) to "
        "start anew"
    )


@dataclass(frozen=True)
class CheckpointRecord:
    """The content of ``checkpoint.json``."""

    identity: SiteIdentity
    fingerprint: str
    step: int

    def write(self, data_dir: Path) -> None:
        """Atomically; raises OSError, the previous file intact."""
        write_json(
            data_dir / RECORD_FILENAME,
            {**asdict(self.identity), "fingerprint": self.fingerprint, "step": self.step},
        )


def read_record(data_dir: Path) -> CheckpointRecord | None:
    """The record of ``data_dir``'s ``checkpoint.pt``; None when either file is missing (a
    record without its checkpoint is stale: nothing would be resumed). A record that cannot
    be read is a ConfigError naming the file."""
    path = data_dir / RECORD_FILENAME
    if not path.exists() or not (data_dir / CHECKPOINT_FILENAME).exists():
        return None
    try:
        data = json.loads(path.read_text())
        identity = SiteIdentity(**{f.name: str(data[f.name]) for f in fields(SiteIdentity)})
        return CheckpointRecord(identity, str(data["fingerprint"]), int(data["step"]))
    except OSError as err:
        why = err.strerror or str(err)
    except (ValueError, TypeError, KeyError) as err:  # not JSON, or not the fields above
        why = f"not a record gossipd wrote ({type(err).__name__}: {err})"
    raise ConfigError(
        f"{path}: cannot read it: {why}; move it out of data_dir (the next checkpoint writes "
        "it again, and the restore still checks checkpoint.pt itself)"
    )
