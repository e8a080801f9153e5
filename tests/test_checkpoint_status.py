"""Checkpoints take the core through its interface: ``state_dict`` to resume, ``status``
for what the launcher, logs and audits read (node/trainer/checkpoint.py).

The core state is opaque to the checkpoint: the sum-weights and the weight exchanged
with each peer it records are what the core's ``status()`` said when the state was
taken, and they come back from the file as they were. Older files (format 2: the core
state only) still load.
"""

from __future__ import annotations

from pathlib import Path

import torch

from gossipd.node.protocols.base import PeerMass, PushSettled, StepEnded, ViewChanged
from gossipd.node.protocols.credit import DEFAULT_CREDIT
from gossipd.node.trainer import checkpoint
from gossipd.node.trainer.replica import Replica

SEGMENT_BYTES = 16  # four float32 per segment: two segments


def replica(protocol: str = "sumweight", **options: float) -> Replica:
    model = torch.nn.Linear(2, 3, bias=True)  # 9 parameters: three segments of up to 4
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) + i)
    return Replica(
        "a", model, segment_bytes=SEGMENT_BYTES, protocol=protocol, settings={"options": options}
    )


def pushed_and_acknowledged(r: Replica) -> None:
    """One push to b, half of every segment's weight cut to b's credit (a third),
    acknowledged: weights and exchanged move."""
    r.core.handle(ViewChanged(frozenset({"a", "b"})))
    [push] = r.core.handle(StepEnded(1, 0.0))
    r.core.handle(PushSettled(push.peer, push.sequence, tuple(push.weights)))


def test_a_checkpoint_records_what_the_cores_status_says_and_a_file_gives_it_back(
    tmp_path: Path,
) -> None:
    r = replica(push_probability=1.0)
    pushed_and_acknowledged(r)
    status = r.core.status()
    ckpt = checkpoint.capture(r, "a", optimizer=None)
    given = DEFAULT_CREDIT
    assert ckpt.weights == list(status.weights) == [1 - given] * len(status.weights)
    assert (
        ckpt.exchanged
        == dict(status.exchanged)
        == {"b": PeerMass(sent=given * len(status.weights))}
    )  # summed over segments
    assert ckpt.core == r.core.state_dict()

    loaded = checkpoint.load(checkpoint.save(tmp_path, ckpt), fingerprint=r.fingerprint)
    assert (loaded.weights, loaded.exchanged, loaded.step) == (ckpt.weights, ckpt.exchanged, 0)
    fresh = replica(push_probability=1.0)
    fresh.restore(loaded.segments, loaded.core, loaded.step)
    assert fresh.core.status().weights == status.weights
    assert fresh.core.status().exchanged == status.exchanged


def test_a_core_without_sum_weights_checkpoints_none(tmp_path: Path) -> None:
    r = replica("overlap")
    ckpt = checkpoint.capture(r, "a", optimizer=None)
    assert ckpt.weights == [] and ckpt.exchanged == {}
    loaded = checkpoint.load(checkpoint.save(tmp_path, ckpt), fingerprint=r.fingerprint)
    assert loaded.weights == [] and loaded.core == r.core.state_dict()


def test_a_format_2_file_without_status_still_resumes_with_its_weights(tmp_path: Path) -> None:
    r = replica(push_probability=1.0)
    pushed_and_acknowledged(r)
    state = r.core.state_dict()
    torch.save(
        {
            "format": 2,
            "node_id": "a",
            "fingerprint": r.fingerprint,
            "step": 7,
            "core": state,
            "segments": [b.clone() for b in r.flat.buffers],
            "optimizer": None,
        },
        tmp_path / checkpoint.FILENAME,
    )
    loaded = checkpoint.load(tmp_path / checkpoint.FILENAME, fingerprint=r.fingerprint)
    assert loaded.step == 7 and loaded.core == state
    assert loaded.weights == list(r.core.status().weights)
    assert loaded.exchanged == {}  # format 2 did not record it apart from the core state
