"""What the simulator reports of its own memory: resident now, and the peak so far.

Read from Linux's /proc; elsewhere the peak falls back to ``ru_maxrss`` and what is
resident now to 0 (unknown).
"""

from __future__ import annotations

import os
import resource
import sys


def resident_bytes() -> int:
    """This process's resident memory now (0 where /proc is not there to say)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_bytes() -> int:
    """This process's peak resident memory so far.

    Linux's VmHWM, the high-water mark of this program's own memory: ``ru_maxrss`` also
    keeps the peak of the process before it exec'd this one, and a simulation started
    from a test runner grown to 800 MB reported the runner's size as its own. Elsewhere
    ``ru_maxrss`` (macOS reports bytes, the others kilobytes)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
