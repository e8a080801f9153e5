"""Freed segment buffers come back from the heap, not as fresh pages (node/trainer/memory.py).

Each case runs in a child process, since the setting is the whole process's: rounds of
sixteen 16 MiB buffers (a 256 MiB model's push) are allocated, written and freed, and
the minor page faults of the six rounds after the first two are counted. A fault per fresh
page is what the setting exists to remove, so the count is the measure (no timing).

The control maps every buffer afresh (glibc's starting threshold, 128 KiB, held fixed),
which is what the setting exists to avoid. glibc's own defaults are no control: their
threshold moves with what was freed before, so they faulted 73,696-139,168 pages over 12
runs here but 8,192 in one CI run.
"""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

ROUNDS = """
import resource, sys, torch
from gossipd.node.trainer.memory import keep_freed_buffers
if sys.argv[1] == "keep":
    kept = keep_freed_buffers()
else:
    import ctypes
    kept = ctypes.CDLL(None).mallopt(-3, 128 << 10) == 1  # M_MMAP_THRESHOLD, fixed
def rounds(n):
    for _ in range(n):
        buffers = [torch.empty(16 << 20, dtype=torch.uint8) for _ in range(16)]
        for b in buffers:
            b.fill_(1)
        del buffers
rounds(2)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
rounds(6)
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    kept, faults = out.stdout.split()
    return kept, int(faults)


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="the heap setting is glibc's (Linux); elsewhere keep_freed_buffers does nothing",
)
def test_freed_segment_buffers_are_reused_without_page_faults() -> None:
    kept, faults = _faults("keep")
    assert kept == "True"
    mapped, mapped_faults = _faults("map")
    assert mapped == "True"
    one_buffer = (16 << 20) // 4096
    # 96 buffers of 16 MiB allocated and freed after the warm-up: with the setting about
    # one buffer's pages at most fault in again (0, 4,096 or 4,097 measured: the
    # interpreter's own allocations fault a page now and then; one loaded CI run 24,577,
    # six buffers); mapped afresh, every page of every buffer faults.
    assert faults <= 8 * one_buffer, (faults, mapped_faults)
    assert mapped_faults >= 90 * one_buffer, (faults, mapped_faults)
