"""Segment plans, model fingerprints, and flat per-segment storage of a model.

A model's shareable tensors (parameters and floating-point buffers such as
BatchNorm running statistics) are cut into contiguous segments of about equal
bytes. Each segment lives in one flat buffer and the module's tensors are
re-pointed to views of it, so merging or snapshotting a segment is one vector
operation with no gather or scatter copies. Integer buffers (for example
``num_batches_tracked``) are counters, not estimates, and stay local.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from gossipd.node.errors import MeshMismatch
from gossipd.node.model.torchthreads import worker_pool

DEFAULT_SEGMENT_BYTES = 4 << 20


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Segment:
    index: int
    dtype: torch.dtype
    tensors: tuple[TensorSpec, ...]

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


@dataclass(frozen=True)
class SegmentPlan:
    segments: tuple[Segment, ...]

    def __len__(self) -> int:
        return len(self.segments)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    @property
    def fingerprint(self) -> str:
        """Hash of every name, shape, dtype and the cut points: equal iff models are compatible."""
        desc = [
            [s.index, str(s.dtype), [[t.name, list(t.shape), str(t.dtype)] for t in s.tensors]]
            for s in self.segments
        ]
        blob = json.dumps(desc, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:32]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def shareable_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters and floating-point buffers, in registration order: what gossip averages."""
    out: list[tuple[str, torch.Tensor]] = [(n, p) for n, p in module.named_parameters()]
    out += [(n, b) for n, b in module.named_buffers() if b.is_floating_point()]
    return out


def plan_segments(
    named: Sequence[tuple[str, torch.Tensor]], segment_bytes: int = DEFAULT_SEGMENT_BYTES
) -> SegmentPlan:
    """Cut tensors, in order, into single-dtype segments of about ``segment_bytes`` each.

    A tensor is never split, so a tensor larger than ``segment_bytes`` forms a
    segment of its own; a dtype change always starts a new segment.
    """
    if segment_bytes <= 0:
        raise ValueError(f"segment_bytes must be positive, got {segment_bytes}")
    if not named:
        raise ValueError("the model has no parameters or floating-point buffers to share")
    segments: list[Segment] = []
    current: list[TensorSpec] = []
    current_bytes = 0
    for name, tensor in named:
        if not tensor.is_floating_point():
            raise ValueError(f"tensor {name!r} has dtype {tensor.dtype}; only floats are shared")
        spec = TensorSpec(name, tuple(tensor.shape), tensor.dtype)
        nbytes = spec.numel * tensor.element_size()
        if current and (current[0].dtype != spec.dtype or current_bytes + nbytes > segment_bytes):
            segments.append(Segment(len(segments), current[0].dtype, tuple(current)))
            current, current_bytes = [], 0
        current.append(spec)
        current_bytes += nbytes
    segments.append(Segment(len(segments), current[0].dtype, tuple(current)))
    return SegmentPlan(tuple(segments))


T = TypeVar("T")

PARALLEL_MIN_BYTES = 8 << 20  # below this a thread hand-off costs more than it saves
MAX_SEGMENT_THREADS = 8


class SegmentWork:
    """A merge's per-segment passes, side by side on the cores this process may use.

    A merge or a snapshot holds the trainer at its step boundary, and each segment is
    memory of its own, so the copies, subtractions, norms and in-place adds of different
    segments (torch releases the GIL) run on threads of their own; the results are the
    same bits as one after the other. On the 2-core benchmark VM a 256 MiB push merged
    in four 64 MiB parts took 14.5 ms a part on one core; side by side the push went
    from 1.75 to 1.97 GB/s. Their CPU counts as gossip's (not the trainer thread's) in
    the CPU budget. A process pinned to one core, a GPU model or a small payload runs
    everything on the calling thread.
    """

    def __init__(self, threads: int | None = None) -> None:
        if threads is None:
            threads = min(len(os.sched_getaffinity(0)), MAX_SEGMENT_THREADS)
        self._pool = worker_pool(threads, "segments") if threads > 1 else None

    def run(self, calls: Sequence[Callable[[], T]], nbytes: int) -> list[T]:
        """Every call's result, in order; raises the first call's error, in order, once
        none is still running (nothing may touch a refused payload after the refusal)."""
        if self._pool is None or len(calls) < 2 or nbytes < PARALLEL_MIN_BYTES:
            return [call() for call in calls]
        futures = [self._pool.submit(call) for call in calls]
        errors = [f.exception() for f in futures]  # waits for every one
        for error in errors:
            if error is not None:
                raise error
        return [f.result() for f in futures]


class FlatModel:
    """Owns one flat buffer per segment and makes the module's tensors views into it.

    The Parameter objects keep their identity (only ``.data`` is re-pointed), so
    an optimizer built before or after binding keeps working. Only the trainer
    thread may touch these buffers.
    """

    def __init__(self, module: torch.nn.Module, segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> None:
        named = shareable_tensors(module)
        self.plan = plan_segments(named, segment_bytes)
        self.module = module
        # Counts writes other than the optimizer's (merges, restores, a joiner's bootstrap):
        # a multi-rank site broadcasts its parameters to its other ranks only when it moved.
        # Drawn from a counter, since a merge writes its segments from several threads: a
        # write can at worst leave an earlier number of the same merge, never an old one.
        self._versions = itertools.count(1)
        self.version = 0
        self._host: Any = None  # a HostCopies once a GPU model is first snapshotted
        self.buffers: list[torch.Tensor] = []
        by_name = dict(named)
        for seg in self.plan.segments:
            device = by_name[seg.tensors[0].name].device
            flat = torch.empty(seg.numel, dtype=seg.dtype, device=device)
            offset = 0
            for spec in seg.tensors:
                tensor = by_name[spec.name]
                view = flat[offset : offset + spec.numel].view(spec.shape)
                view.copy_(tensor.detach())
                tensor.data = view
                offset += spec.numel
            self.buffers.append(flat)
        self.work = SegmentWork(1 if self.buffers[0].is_cuda else None)

    @property
    def fingerprint(self) -> str:
        return self.plan.fingerprint

    def check_bound(self) -> None:
        """Fail loudly if user code replaced a tensor, which would silently stop its gossip."""
        named = dict(shareable_tensors(self.module))
        for seg, flat in zip(self.plan.segments, self.buffers, strict=True):
            base = flat.data_ptr()
            end = base + flat.numel() * flat.element_size()
            for spec in seg.tensors:
                ptr = named[spec.name].data_ptr()
                if not base <= ptr < end:
                    raise MeshMismatch(
                        f"tensor {spec.name!r} no longer lives in gossip segment {seg.index}; "
                        "update parameters in place (param.data.copy_) instead of reassigning"
                    )

    def snapshot(self, segments: Iterable[int] | None = None) -> dict[int, torch.Tensor]:
        """Detached CPU copies of the given segments, safe to stream while training goes on
        (from a GPU: reusable pinned buffers filled on a side stream, see hostcopy)."""
        idx = range(len(self.buffers)) if segments is None else segments
        if self.buffers[0].is_cuda:
            if self._host is None:
                from gossipd.node.model.hostcopy import HostCopies

                self._host = HostCopies(self.buffers)
            return self._host.snapshot(idx)
        idx = list(idx)
        copies = self.work.run(
            [functools.partial(_cpu_copy, self.buffers[i]) for i in idx],
            sum(self.buffers[i].nbytes for i in idx),
        )
        return dict(zip(idx, copies, strict=True))

    def load_segment(self, index: int, values: torch.Tensor) -> None:
        with torch.no_grad():
            self.buffers[index].copy_(values)
        self.version = next(self._versions)

    def merge_segment(self, index: int, values: torch.Tensor, alpha: float) -> bool:
        """x ← (1 − α)·x + α·values unless that would be non-finite; False if refused."""
        blended = self.blend(index, values, alpha)
        if blended is None:
            return False
        self.load_segment(index, blended)
        return True

    def blend(self, index: int, values: torch.Tensor, alpha: float) -> torch.Tensor | None:
        """(1 − α)·x + α·values as a new tensor, or None if any element would be non-finite.

        Written as a weighted sum, not x + α·(y − x): with finite inputs each
        term is no larger than its input, so two finite models of opposite sign
        near the dtype's limit cannot overflow through their difference.
        """
        with torch.no_grad():
            flat = self.buffers[index]
            out = flat.mul(1.0 - alpha)
            out.add_(values.to(flat.device, flat.dtype), alpha=alpha)
            # One reduction settles the common case; only an inf/nan sum needs the exact test.
            if not torch.isfinite(out.sum()) and not bool(torch.isfinite(out).all()):
                return None
            return out

    def blend_delta(self, index: int, delta: torch.Tensor, alpha: float) -> torch.Tensor | None:
        """x + α·delta, written over ``delta`` (one pass, nothing allocated), or None if any
        element would be non-finite: the checked form of :meth:`add_delta`, for when the
        norms could not prove the blend finite. ``delta`` is incoming − x from a payload
        bound, finite by then, so this is the weighted sum of :meth:`blend` without its two
        temporaries: between x and the incoming values, it can overflow only by rounding at
        the dtype's limit, which the finite check catches."""
        with torch.no_grad():
            flat = self.buffers[index]
            out = torch.add(flat, delta, alpha=alpha, out=delta)
            if not torch.isfinite(out.sum()) and not bool(torch.isfinite(out).all()):
                return None
            return out

    def add_delta(self, index: int, delta: torch.Tensor, alpha: float) -> None:
        """x ← x + α·delta in place, for a blend already proven finite: the same arithmetic
        as :meth:`blend_delta` then :meth:`load_segment`, bit for bit, in one pass instead
        of three."""
        with torch.no_grad():
            self.buffers[index].add_(delta, alpha=alpha)
        self.version = next(self._versions)

    def lerp(self, index: int, values: torch.Tensor, alpha: float) -> None:
        """x ← x + α·(values − x) in place, one pass: the blend of a gauged payload, whose
        bound and finiteness were proven from its norms (:meth:`PayloadBound.admits`)."""
        with torch.no_grad():
            self.buffers[index].lerp_(values, alpha)
        self.version = next(self._versions)

    @contextmanager
    def holding(self, values: Mapping[int, torch.Tensor]) -> Iterator[None]:
        """Segments loaded with ``values`` for the block, their own contents back after
        it: to evaluate another model (a shared one) without building a second module."""
        own = {i: self.buffers[i].clone() for i in values}
        for i, v in values.items():
            self.load_segment(i, v)
        try:
            yield
        finally:
            for i, v in own.items():
                self.load_segment(i, v)

    def checksum(self) -> str:
        """Content hash of all segments, for `gossipd status` and bit-for-bit tests."""
        return model_checksum(self.buffers)


def _cpu_copy(flat: torch.Tensor) -> torch.Tensor:
    return flat.detach().to("cpu", copy=True)


def model_checksum(buffers: Sequence[torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for flat in buffers:
        digest.update(flat.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:32]


def check_protocol(local: str, remote: str, who: str) -> None:
    if local != remote:
        raise MeshMismatch(
            f"{who} gossips protocol {remote!r}, this node {local!r}; every node of a mesh "
            "must set the same gossip.protocol"
        )


def check_fingerprint(local: str, remote: str, who: str) -> None:
    if local != remote:
        raise MeshMismatch(
            f"model fingerprint mismatch with {who}: ours is {local}, theirs is {remote}; "
            "every node of a mesh must run the same job, model and segment_bytes"
        )
