"""What a wide-area testbed started is stopped, on every way out of the harness.

A testbed leaves network namespaces, links and processes behind if the harness
stops without removing them, and they outlive it (a namespace with a process in
it stays, a link stays until deleted). So every open testbed is registered here:
closed on a normal exit by its ``with``, and also at interpreter exit (atexit)
and on SIGINT and SIGTERM, whose handlers clean up, put the previous handlers
back and deliver the signal again (Ctrl-C still raises KeyboardInterrupt,
SIGTERM still ends the process). The handlers are installed while at least one
testbed is open, and only from the main thread, where Python allows it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from typing import Any, Protocol

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0  # how long a site's process has to exit after SIGTERM before SIGKILL
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Closable(Protocol):
    owner_pid: int

    def close(self) -> None: ...


_open: list[Closable] = []
_previous: dict[int, Any] = {}
_atexit_registered = False
_cleaning = False


def register(bed: Closable) -> None:
    """Track ``bed`` until :func:`unregister`: closed at exit and on SIGINT/SIGTERM."""
    global _atexit_registered
    if not _atexit_registered:
        atexit.register(close_all)
        _atexit_registered = True
    # _previous is empty while ours are not installed (a close from another thread
    # cannot put the previous ones back; the next close from the main thread does).
    if not _previous and threading.current_thread() is threading.main_thread():
        for signum in SIGNALS:
            _previous[signum] = signal.signal(signum, _on_signal)
    _open.append(bed)


def unregister(bed: Closable) -> None:
    """``bed`` is closed; with none left open, the previous signal handlers are back."""
    with contextlib.suppress(ValueError):
        _open.remove(bed)
    if not _open:
        _restore_handlers()


def close_all() -> None:
    """Close every testbed this process opened (not one a forked child inherited)."""
    for bed in list(_open):
        if bed.owner_pid != os.getpid():
            continue
        try:
            bed.close()
        except Exception:
            log.exception(
                "closing a wide-area testbed failed; `python -m gossipd.bench.wan_net "
                "--check` lists what it left and `--clean TAG` removes it"
            )


def _restore_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for signum, handler in _previous.items():
        # None: a handler installed from C, which Python cannot put back; the default is
        # the closest there is.
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
    _previous.clear()


def _on_signal(signum: int, _frame: object) -> None:
    global _cleaning
    if _cleaning:  # a second Ctrl-C while cleaning up: the bounded cleanup finishes first
        return
    _cleaning = True
    try:
        log.info(
            "%s: removing the wide-area testbed's processes, namespaces and links before exiting",
            signal.Signals(signum).name,
        )
        close_all()
    finally:
        _cleaning = False
        _restore_handlers()
    signal.raise_signal(signum)


def stop_processes(procs: list[subprocess.Popen[Any]], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM each process (its whole group, when it leads one), wait up to ``timeout_s``
    for all, then SIGKILL the groups and reap: nothing started by a site is left running.

    A leader is only looked at, not reaped, until its group has been killed: while its
    pid is unreaped it cannot be reused, so the group signalled is surely still ours
    and its other members (children the process started) go too.
    """
    live = [p for p in procs if p.returncode is None]
    for proc in live:
        _signal(proc, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    waiting = list(live)
    while waiting and time.monotonic() < deadline:
        waiting = [p for p in waiting if not _exited(p)]
        if waiting:
            time.sleep(0.05)
    for proc in live:
        _signal(proc, signal.SIGKILL)
    for proc in live:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning(
                "process %d did not exit %.0f s after SIGKILL (stuck in the kernel?); "
                "check it with `ps -p %d`",
                proc.pid,
                timeout_s,
                proc.pid,
            )


def _signal(proc: subprocess.Popen[Any], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if _leads_group(proc):
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)


def _leads_group(proc: subprocess.Popen[Any]) -> bool:
    try:
        return os.getpgid(proc.pid) == proc.pid
    except ProcessLookupError:
        return False


def _exited(proc: subprocess.Popen[Any]) -> bool:
    """Whether ``proc`` has exited, without reaping it (WNOWAIT)."""
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # already reaped elsewhere
        return True
