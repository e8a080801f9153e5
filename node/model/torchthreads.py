"""Every thread of a node that calls torch runs at the process's intra-op thread count.

``torch.set_num_threads`` (``gossipd node --threads``, default 1) reaches a new thread
only once torch's own parallel code has run there: until then, a BLAS call from it
(the gauge's dot products, a plugin's first matmul) asks OpenMP for as many threads as
the machine has cores. On the 2-core VM a bulk-lane worker's dots ran on two threads
at 1.5 CPU-seconds per second of wall time, the second thread spinning in OpenMP
while both cores were wanted by the transfer. Reading the count settles it.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

import torch

# What asyncio's own default executor would have: Python's default for
# ThreadPoolExecutor, min(32, cores + 4).
_IO_WORKERS = min(32, (os.cpu_count() or 1) + 4)


def adopt_thread_count() -> None:
    """Make the calling thread use the process's intra-op thread count from now on."""
    torch.get_num_threads()  # its first call in a thread applies the process's count


def worker_pool(max_workers: int, thread_name_prefix: str) -> ThreadPoolExecutor:
    """A thread pool whose threads use the process's intra-op thread count."""
    return ThreadPoolExecutor(
        max_workers=max_workers,
        thread_name_prefix=thread_name_prefix,
        initializer=adopt_thread_count,
    )


def use_for_default_executor(loop: asyncio.AbstractEventLoop) -> None:
    """Give ``loop`` a default executor (``asyncio.to_thread``) of :func:`worker_pool`
    threads, the same size as asyncio's own."""
    loop.set_default_executor(worker_pool(_IO_WORKERS, "gossipd-io"))
