"""Keeping freed segment buffers in the process instead of handing them back to the kernel.

Every push, pull and snapshot allocates segment-sized buffers and frees them a moment
later. glibc's defaults serve a block that large with its own ``mmap`` (from 128 KiB,
rising to the largest block freed so far) and give the top of the heap back once more
than twice that is free, so nearly every buffer came back as fresh pages: one page fault
and one zeroed page per 4 KiB before a byte of payload landed. Measured on a 2-core VM,
the kernel's page clearing was 36% of a pulling process's CPU and 11% of the serving
daemon's (256 MiB pulls in 16 MiB segments), and 5 allocate-fill-free rounds of sixteen
16 MiB buffers took 775 ms against 153 ms with the settings below.

The settings: blocks up to glibc's ceiling for the heap (32 MiB on 64-bit) come from the
heap, and freed memory is trimmed only once ``trim_bytes`` of it lie at the top. The cost
is that a process keeps up to ``trim_bytes`` of freed memory it might have returned; the
node's own buffers are bounded by its admission limits. Bigger blocks (a segment over
32 MiB) are still mapped and unmapped each time. Other C libraries (musl) and other
systems are left as they are.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import sys

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc refuses more on 64-bit: HEAP_MAX_SIZE / 2
DEFAULT_TRIM_BYTES = 1 << 30


def keep_freed_buffers(trim_bytes: int = DEFAULT_TRIM_BYTES) -> bool:
    """Tune this process's glibc heap for segment buffers; False where it is not glibc.

    Call it once, early: it changes how every later allocation of the process is served.
    """
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    limit = min(trim_bytes, 2**31 - 1)
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(
        mallopt(M_TRIM_THRESHOLD, limit)
    )
    log.debug(
        "glibc heap: blocks up to %d bytes from the heap, trim above %d: %s",
        MMAP_THRESHOLD_MAX,
        limit,
        "set" if ok else "refused",
    )
    return ok
