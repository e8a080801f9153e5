"""iproute2 for the wide-area testbed: names, commands, probes, leftovers and removal.

Everything :mod:`gossipd.bench.wan_net` asks of the kernel goes through ``ip`` and
``tc`` here, with one timeout and one error (:class:`TestbedError`) that quotes the
command and what it answered. Names: a testbed's tag is ``gwan``, 5 base-36 digits
of the pid and 2 of a per-process counter, so tags have one width and none is the
start of another; every namespace, link and qdisc of a testbed starts with its tag.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import itertools
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

from gossipd.node.errors import GossipdError

PREFIX = "gwan"  # every testbed's names start with it; a tag is PREFIX + 5 + 2 characters
COMMAND_TIMEOUT_S = 30.0
LOCK_PATH = Path("/run/gossipd/wan-testbed.lock")  # root only, like the testbed itself
# tbf's bucket (burst): what the link may send at once after idling. One timer tick
# of the rate (4 ms: HZ = 250 here; tbf's own timer is finer) keeps a fast link from
# stalling between ticks, and 4 full Ethernet frames let a small link pass one
# packet plus the ones a sender writes back to back. Over a transfer of S bytes the
# bucket can only add its own size: at 20 Mbit/s that is 16 KB, 0.3% of 5 MB, so
# measured goodput stays within a few percent of the rate, and TCP/IP headers
# (counted by tbf) keep it below.
BUCKET_S = 0.004
BURST_FRAMES = 4
FRAME_BYTES = 1514
# tbf's queue (limit) beyond the bucket: 50 ms of the rate. Longer queues add delay
# the in-process latency does not account for; shorter ones drop TCP's bursts.
QUEUE_S = 0.05
_counter = itertools.count()


class TestbedError(GossipdError):
    """The testbed could not build, use or remove its namespaces, links or qdiscs."""


def new_tag() -> str:
    """A tag no other testbed has: this process's pid and a counter, fixed width, so no
    tag is the start of another."""
    return f"{process_prefix()}{_base36(next(_counter) % 36**2, 2)}"


def process_prefix(pid: int | None = None) -> str:
    """The start of every tag process ``pid`` (default: this one) gives its testbeds."""
    return f"{PREFIX}{_base36(os.getpid() if pid is None else pid, 5)}"


def have_root() -> tuple[bool, str]:
    """Whether this process can build a :class:`Testbed`, and if not, why: tried for real
    in a throwaway namespace (a container may be root and still refuse namespaces)."""
    if os.geteuid() != 0:
        return False, f"running as uid {os.geteuid()}, not 0; run as root (sudo) to use namespaces"
    missing = [name for name in ("ip", "tc") if which(name) is None]
    if missing:
        return (
            False,
            f"{' and '.join(missing)} not found; install iproute2 (apt-get install iproute2)",
        )
    ip, tc = tool("ip"), tool("tc")
    probe = f"{PREFIX}-probe-{os.getpid()}"
    try:
        run([ip, "netns", "add", probe], "creating a namespace")
        run(
            [ip, "-n", probe, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1"],
            "creating a veth pair",
        )
        run(
            [tc, "-n", probe, "qdisc", "add", "dev", "probe0", "root", *tbf_args(1.0)],
            "adding a tbf qdisc",
        )
    except TestbedError as err:
        return False, f"namespaces or tc refused: {err}"
    finally:
        subprocess.run([ip, "netns", "del", probe], capture_output=True, timeout=COMMAND_TIMEOUT_S)
    return True, "root, with ip, tc, network namespaces and tbf"


def tbf_args(rate_mbit: float) -> list[str]:
    """tc arguments for a tbf qdisc at ``rate_mbit`` (bucket and queue: see BUCKET_S)."""
    rate_bytes_s = rate_mbit * 1e6 / 8
    burst = int(rate_bytes_s * BUCKET_S) + BURST_FRAMES * FRAME_BYTES
    limit = burst + int(rate_bytes_s * QUEUE_S)
    return ["tbf", "rate", f"{round(rate_mbit * 1e6)}bit", "burst", str(burst), "limit", str(limit)]


def leftovers(tag: str = PREFIX) -> list[str]:
    """Namespaces, links and qdiscs whose names start with ``tag`` (one testbed's tag, or
    the prefix for every testbed's): empty once a testbed is closed."""
    ip = which("ip")
    if ip is None:
        return []
    found = [f"netns {name}" for name in namespaces(ip) if name.startswith(tag)]
    for line in run([ip, "-o", "link", "show"], "listing links").splitlines():
        name = line.split(": ")[1].split("@")[0]
        if name.startswith(tag):
            found.append(f"link {name}")
    tc = which("tc")
    if tc is not None:
        for line in run([tc, "qdisc", "show"], "listing qdiscs").splitlines():
            words = line.split()
            if "dev" in words and words[words.index("dev") + 1].startswith(tag):
                found.append(f"qdisc {words[1]} on {words[words.index('dev') + 1]}")
    return found


def remove(tag: str) -> None:
    """Delete every link and namespace whose name starts with ``tag`` (qdiscs go with
    their links), after SIGKILL to any process still in those namespaces: a namespace
    lives on, unnamed, while a process is in it, and after a harness was killed its
    sites' daemons would keep running. What is already gone is skipped."""
    ip = which("ip")
    if ip is None:
        return
    for name in namespaces(ip):
        if name.startswith(tag):
            for pid in run([ip, "netns", "pids", name], f"listing {name}'s processes").split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
    for line in run([ip, "-o", "link", "show"], "listing links").splitlines():
        name = line.split(": ")[1].split("@")[0]
        if name.startswith(tag):
            subprocess.run(
                [ip, "link", "del", name], capture_output=True, timeout=COMMAND_TIMEOUT_S
            )
    for name in namespaces(ip):
        if name.startswith(tag):
            run([ip, "netns", "del", name], f"removing namespace {name}")


def namespaces(ip: str) -> list[str]:
    return [
        line.split()[0]
        for line in run([ip, "netns", "list"], "listing namespaces").splitlines()
        if line.strip()
    ]


@contextlib.contextmanager
def network_lock() -> Iterator[None]:
    """Held from choosing a testbed's network until its bridge has the address, so a
    testbed built at the same time, in another process, sees it taken."""
    try:
        LOCK_PATH.parent.mkdir(parents=True, exist_ok=True)
        lock = LOCK_PATH.open("a")
    except OSError as err:
        raise TestbedError(
            f"cannot open the testbed's lock {LOCK_PATH}: {err.strerror or err}; the testbed "
            f"needs root (have_root() says what is missing here)"
        ) from err
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def free_network(tag: str, ip: str) -> ipaddress.IPv4Network:
    """A 10.X.Y.0/24 no interface here is on, starting from one the tag picks, so two
    testbeds built at once start apart. Broad routes (a /8 VPN) are not counted: the
    /24 is more specific and wins for its own addresses."""
    used = []
    for line in run([ip, "-o", "-4", "addr", "show"], "listing addresses").splitlines():
        words = line.split()
        net = ipaddress.ip_interface(words[words.index("inet") + 1]).network
        if net.prefixlen >= 16:
            used.append(net)
    start = int(tag[len(PREFIX) :], 36) % (50 * 256)
    for k in range(50 * 256):
        n = (start + k) % (50 * 256)
        candidate = ipaddress.ip_network(f"10.{200 + n // 256}.{n % 256}.0/24")
        if not any(candidate.overlaps(net) for net in used):
            return candidate
    raise TestbedError(
        "no free 10.200-249.*.0/24 network for the testbed's bridge; "
        "remove old testbeds (python -m gossipd.bench.wan_net --clean)"
    )


def run(argv: list[str], what: str) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise TestbedError(f"{what}: `{' '.join(argv)}` could not run: {err}") from err
    if done.returncode != 0:
        raise TestbedError(
            f"{what}: `{' '.join(argv)}` failed (exit {done.returncode}): "
            f"{done.stderr.strip() or done.stdout.strip()}"
        )
    return done.stdout


def which(name: str) -> str | None:
    """``name`` on PATH or in the sbin folders a non-root PATH may lack."""
    return shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if os.access(p, os.X_OK)), None
    )


def tool(name: str) -> str:
    path = which(name)
    if path is None:
        raise TestbedError(f"`{name}` not found; install iproute2 (apt-get install iproute2)")
    return path


def _base36(value: int, width: int) -> str:
    digits = ""
    for _ in range(width):
        value, digit = divmod(value, 36)
        digits = "0123456789abcdefghijklmnopqrstuvwxyz"[digit] + digits
    return digits
