"""Host copies of a GPU model's segments for pushes and served pulls.

A push streams a snapshot while training goes on, so the snapshot must be a copy.
For a model on a GPU the copy goes device → host on a side CUDA stream into pinned
(page-locked) buffers: pinned memory is what lets the copy run as DMA at full PCIe
speed, and the side stream keeps it off the training stream. The side stream first
waits for the training work already queued (the snapshot is of the parameters as
they are at this step boundary), and the training stream waits for the copy before
its next kernel (nothing overwrites a buffer being read); the host thread that asked
waits for the copy alone, and the push then encodes and sends from host memory.

Pinning is slow (a page-locked allocation costs far more than the copy), so buffers
are reused: one is handed out again only when nothing holds it any more, neither the
tensor itself nor a view or a NumPy array of its memory (a push in flight, a retry
kept for later, a pull being served).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable, Sequence

import torch

MAX_POOLED = 4  # per segment: pushes in flight to different peers, plus a pull or two


def _storage_uses(t: torch.Tensor) -> int | None:
    counter = getattr(torch._C, "_storage_Use_Count", None)
    return None if counter is None else int(counter(t.untyped_storage()._cdata))


class HostCopies:
    """Snapshots of ``buffers`` (all on one device) into reusable host buffers.

    ``pin``: page-locked buffers (default: when the buffers are on a GPU). On a CPU
    model the same pool works with plain memory, which is how the CPU tests check it.
    """

    def __init__(self, buffers: Sequence[torch.Tensor], *, pin: bool | None = None) -> None:
        self.buffers = buffers
        device = buffers[0].device
        self.cuda = device.type == "cuda"
        self.pin = self.cuda if pin is None else pin
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self.pool: dict[int, list[tuple[torch.Tensor, int | None]]] = {}
        self.lock = threading.Lock()  # the trainer and the server's loop both snapshot
        self.allocated = 0

    def _take(self, index: int) -> torch.Tensor:
        """A pooled host buffer for ``index`` that nothing else holds, or a new one."""
        pooled = self.pool.setdefault(index, [])
        for buf, uses in pooled:
            # Held only by the pool (this list, the loop variable, getrefcount's argument)
            # and its storage by itself alone: no tensor, view or array points into it.
            if sys.getrefcount(buf) <= 3 and uses is not None and _storage_uses(buf) == uses:
                return buf
        src = self.buffers[index]
        buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=self.pin)
        self.allocated += 1
        if len(pooled) < MAX_POOLED:
            pooled.append((buf, _storage_uses(buf)))
        return buf

    def snapshot(self, segments: Iterable[int]) -> dict[int, torch.Tensor]:
        with self.lock:
            out = {i: self._take(i) for i in segments}
            if self.stream is None:
                for i, buf in out.items():
                    buf.copy_(self.buffers[i].detach())
                return out
            training = torch.cuda.current_stream(self.buffers[0].device)
            self.stream.wait_stream(training)
            with torch.cuda.stream(self.stream):
                for i, buf in out.items():
                    buf.copy_(self.buffers[i].detach(), non_blocking=True)
                done = self.stream.record_event()
            training.wait_stream(self.stream)
            done.synchronize()  # this thread waits for the copy; the GPU does not
            return out
