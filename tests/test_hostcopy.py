"""Host copies of a model's segments: reusable buffers, never reused while anything holds them.

The pinned, side-stream path runs only on a GPU (skipped here with the reason); the
pool that decides when a buffer may be filled again is the same code on the CPU, and
is checked here with plain memory.
"""

from __future__ import annotations

import gc

import pytest
import torch

from gossipd.node.errors import JobError
from gossipd.node.jobs.registry import JobSpec, build_job
from gossipd.node.model.hostcopy import MAX_POOLED, HostCopies
from gossipd.node.model.segments import FlatModel
from gossipd.node.shared.config import parse_config
from gossipd.node.trainer.ranks import site_spec

needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (CI and this machine have none)"
)


def _buffers() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(1000, generator=gen), torch.randn(10, generator=gen)]


def test_a_snapshot_is_a_copy_that_training_does_not_change() -> None:
    buffers = _buffers()
    copies = HostCopies(buffers, pin=False)
    snap = copies.snapshot([0, 1])
    before = [t.clone() for t in snap.values()]
    for b in buffers:
        b.add_(1.0)
    assert all(torch.equal(a, b) for a, b in zip(snap.values(), before, strict=True))


def test_a_buffer_is_reused_only_when_nothing_holds_it() -> None:
    buffers = _buffers()
    copies = HostCopies(buffers, pin=False)
    first = copies.snapshot([0])
    second = copies.snapshot([0])  # the first is still held: a new buffer
    assert first[0].data_ptr() != second[0].data_ptr()
    assert copies.allocated == 2
    ptr = first[0].data_ptr()
    del first
    gc.collect()
    third = copies.snapshot([0])
    assert third[0].data_ptr() == ptr and copies.allocated == 2
    buffers[0].add_(1.0)
    assert torch.equal(copies.snapshot([0])[0], buffers[0])  # a reused buffer is refilled


@pytest.mark.parametrize("hold", ["view", "numpy"])
def test_a_view_or_array_of_a_buffer_keeps_it_from_reuse(hold: str) -> None:
    copies = HostCopies(_buffers(), pin=False)
    snap = copies.snapshot([0])
    ptr = snap[0].data_ptr()
    kept = snap[0][:100] if hold == "view" else snap[0].numpy()
    del snap
    gc.collect()
    again = copies.snapshot([0])
    assert again[0].data_ptr() != ptr  # the kept memory is not overwritten
    assert kept is not None


def test_the_pool_stays_bounded_however_many_snapshots_are_held() -> None:
    copies = HostCopies(_buffers(), pin=False)
    held = [copies.snapshot([0, 1]) for _ in range(3 * MAX_POOLED)]
    assert len(held) == 3 * MAX_POOLED
    assert all(len(pooled) <= MAX_POOLED for pooled in copies.pool.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without GPU")
def test_a_cuda_job_on_a_machine_without_gpu_is_refused_clearly() -> None:
    config = parse_config(
        {"mesh_id": "m", "node_id": "a", "tls": {"insecure": True}, "job": {"device": "cuda"}}
    )
    with pytest.raises(JobError, match="torch sees no GPU"):
        build_job(site_spec(config, None))


@needs_gpu
def test_a_gpu_model_is_snapshotted_into_pinned_reusable_buffers() -> None:
    job = build_job(JobSpec("digits", device="cuda:0"))
    flat = FlatModel(job.model, 4096)
    snap = flat.snapshot()
    assert all(t.device.type == "cpu" and t.is_pinned() for t in snap.values())
    assert all(torch.equal(t, b.cpu()) for t, b in zip(snap.values(), flat.buffers, strict=True))
    job.train_step()  # the training stream moves on; the snapshot does not
    assert any(
        not torch.equal(t, b.cpu()) for t, b in zip(snap.values(), flat.buffers, strict=True)
    )
    ptrs = {i: t.data_ptr() for i, t in snap.items()}
    del snap
    gc.collect()
    assert {i: t.data_ptr() for i, t in flat.snapshot().items()} == ptrs


@needs_gpu
def test_digits_trains_on_the_gpu() -> None:
    job = build_job(JobSpec("digits", device="cuda:0"))
    for _ in range(300):
        job.train_step()
    assert job.evaluate()["test_accuracy"] >= 0.9
