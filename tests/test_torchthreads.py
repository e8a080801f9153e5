"""A node's worker threads call BLAS at the process's intra-op thread count.

Each case runs in a fresh interpreter with ``OMP_NUM_THREADS=4`` (what a new thread
asks OpenMP for until torch applies its own count there) and
``torch.set_num_threads(1)`` (what ``gossipd node`` sets). A dot product on a plain new
thread starts OpenMP's helper threads, which shows in ``/proc/self/task``; on a thread
of :func:`worker_pool` it must not.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import os, sys, threading, torch
from gossipd.node.model.torchthreads import worker_pool

torch.set_num_threads(1)
v = torch.randn(1 << 22)

def tasks():
    return len(os.listdir("/proc/self/task"))

def work():
    return float(torch.dot(v, v))

if sys.argv[1] == "pool":
    pool = worker_pool(1, "probe")
    pool.submit(lambda: None).result()  # the pool's thread exists before counting
    before = tasks()
    pool.submit(work).result()
else:
    go, done = threading.Event(), threading.Event()
    def body():
        go.wait()
        work()
        done.set()
        threading.Event().wait(5)  # alive while counted
    threading.Thread(target=body, daemon=True).start()
    before = tasks()
    go.set()
    done.wait()
print(before, tasks())
"""


def _threads_before_and_after(kind: str) -> tuple[int, int]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, kind],
        env={**os.environ, "OMP_NUM_THREADS": "4"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.split()
    return int(out[0]), int(out[1])


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_plain_thread_starts_openmp_helpers_and_a_worker_pool_thread_does_not() -> None:
    before, after = _threads_before_and_after("plain")
    assert after > before, "the probe no longer shows the problem; it proves nothing"
    before, after = _threads_before_and_after("pool")
    assert after == before
