"""The wide-area testbed: real namespaces, veths, a bridge and tbf, real processes in them.

The namespace tests need root and iproute2 and are skipped, with have_root()'s reason,
where those are missing; the loopback fallback and its no-root label are tested
everywhere (as root, by a child process that drops to an unprivileged user).
"""

from __future__ import annotations

import json
import logging
import queue
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from gossipd.bench import wan_net
from gossipd.bench.wan_scenarios import SiteLink
from tests.conftest import wait_until

ROOT, WHY_NOT = wan_net.have_root()
needs_root = pytest.mark.skipif(not ROOT, reason=f"the testbed needs namespaces: {WHY_NOT}")
WAIT_S = 60.0
MB = 1_000_000

# Serves `count` connections on (address, any free port), echoing what each sends;
# prints the port first.
ECHO_SERVER = """
import socket, sys
server = socket.create_server((sys.argv[1], 0))
server.settimeout(60)
print(server.getsockname()[1], flush=True)
for _ in range(int(sys.argv[2])):
    conn, _ = server.accept()
    with conn:
        conn.settimeout(60)
        conn.sendall(conn.recv(1024))
"""
# Connects, sends argv[3], prints what comes back.
ECHO_CLIENT = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60) as conn:
    conn.sendall(sys.argv[3].encode())
    print(conn.recv(1024).decode(), flush=True)
"""
# Takes one connection, reads it to EOF, prints bytes and goodput from first byte to last.
RECEIVER = """
import json, socket, sys, time
server = socket.create_server((sys.argv[1], 0))
server.settimeout(60)
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
conn.settimeout(60)
buffer = bytearray(1 << 16)
total = first = 0
started = last = None
while n := conn.recv_into(buffer):
    last = time.perf_counter()
    if started is None:
        started, first = last, n
    total += n
print(json.dumps({"bytes": total, "after_first": total - first, "seconds": last - started}))
"""
SENDER = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60) as conn:
    conn.sendall(bytes(int(sys.argv[3])))
"""


def lines_of(proc: subprocess.Popen[str]) -> queue.Queue[str | None]:
    """The process's stdout lines as they come, for waits with a timeout; None at EOF."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in proc.stdout or ():
            lines.put(line.strip())
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def next_line(lines: queue.Queue[str | None], proc: subprocess.Popen[str], what: str) -> str:
    try:
        line = lines.get(timeout=WAIT_S)
    except queue.Empty:
        raise AssertionError(f"no {what} within {WAIT_S} s (exit {proc.poll()})") from None
    if line is None:
        raise AssertionError(f"no {what}: the process closed its output (exit {proc.wait(WAIT_S)})")
    return line


def python(bed: Any, site: int, script: str, *args: object) -> subprocess.Popen[str]:
    return bed.popen(
        site, [sys.executable, "-c", script, *map(str, args)], stdout=subprocess.PIPE, text=True
    )


def sleeping(pid: str) -> bool:
    """Whether the testbed child's site process (marked wan-sleeper) is still alive."""
    try:
        return b"wan-sleeper" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False


def netns_names() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@needs_root
def test_three_shaped_sites_reach_each_other_and_from_the_bridge_then_nothing_is_left() -> None:
    links = [SiteLink(20, 5), SiteLink(100, 50), SiteLink(1000, 5)]
    with wan_net.Testbed(links) as bed:
        tag = bed.tag
        assert bed.kernel_shaping and tag in bed.label
        assert [bed.latency_ms(i) for i in range(3)] == [5, 50, 5]
        for i, rate in enumerate(("20Mbit", "100Mbit", "1Gbit")):
            up = subprocess.run(
                ["tc", "-n", bed.netns(i), "qdisc", "show", "dev", bed.interface(i)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            down = subprocess.run(
                ["tc", "qdisc", "show", "dev", bed.host_interface(i)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            assert "tbf" in up and f"rate {rate}" in up, up
            assert "tbf" in down and f"rate {rate}" in down, down

        servers = [python(bed, i, ECHO_SERVER, bed.address(i), 3) for i in range(3)]
        ports = [int(next_line(lines_of(s), s, f"site {i}'s port")) for i, s in enumerate(servers)]
        before = [bed.counters(i) for i in range(3)]
        for i in range(3):
            for j in range(3):
                if i != j:
                    client = python(bed, i, ECHO_CLIENT, bed.address(j), ports[j], f"{i}->{j}")
                    out, _ = client.communicate(timeout=WAIT_S)
                    assert (client.returncode, out.strip()) == (0, f"{i}->{j}")
        # The harness, in the root namespace, reaches every site through the bridge.
        for j in range(3):
            with socket.create_connection((bed.address(j), ports[j]), WAIT_S) as c:
                c.sendall(b"bridge")
                assert c.recv(1024) == b"bridge"
        assert [s.wait(WAIT_S) for s in servers] == [0, 0, 0]
        after = [bed.counters(i) for i in range(3)]
        assert all(a[0] > b[0] and a[1] > b[1] for a, b in zip(after, before, strict=True))
        assert wan_net.leftovers(tag)
    assert wan_net.leftovers(tag) == []
    assert tag not in netns_names()


@needs_root
def test_two_testbeds_at_once_get_their_own_names_and_networks() -> None:
    with (
        wan_net.Testbed([SiteLink(100, 5)]) as one,
        wan_net.Testbed([SiteLink(100, 5)]) as two,
    ):
        assert one.tag != two.tag and one.network != two.network
        server = python(two, 0, ECHO_SERVER, two.address(0), 1)
        port = next_line(lines_of(server), server, "the server's port")
        with socket.create_connection((two.address(0), int(port)), WAIT_S) as conn:
            conn.sendall(b"two")
            assert conn.recv(1024) == b"two"
        assert server.wait(WAIT_S) == 0
        one.close()
        assert wan_net.leftovers(one.tag) == [] and wan_net.leftovers(two.tag)
    assert wan_net.leftovers(two.tag) == []


@needs_root
def test_an_exception_inside_the_with_stops_the_sites_processes_and_leaves_nothing() -> None:
    handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    with (
        pytest.raises(RuntimeError, match="inside the testbed"),
        wan_net.Testbed([SiteLink(100, 5)] * 2) as bed,
    ):
        tag = bed.tag
        sleeper = bed.popen(1, [sys.executable, "-c", "import time; time.sleep(600)"])
        raise RuntimeError("inside the testbed")
    assert sleeper.returncode is not None
    assert wan_net.leftovers(tag) == []
    assert tag not in netns_names()
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == handlers


@needs_root
def test_a_build_that_fails_half_way_removes_what_it_made() -> None:
    # A namespace left by an earlier testbed of the same tag (a pid reused after a
    # SIGKILL): site 1's namespace cannot be created, after the bridge and site 0 were.
    tag = wan_net.new_tag()
    subprocess.run(["ip", "netns", "add", f"{tag}n1"], check=True)
    try:
        with pytest.raises(wan_net.TestbedError, match=f"{tag}n1.*File exists.*building again"):
            wan_net.Testbed([SiteLink(100, 5)] * 3, tag=tag)
        assert wan_net.leftovers(tag) == []
        assert tag not in netns_names()
        with wan_net.Testbed([SiteLink(100, 5)] * 3, tag=tag) as bed:
            assert bed.counters(2)[1] >= 0
    finally:
        wan_net.remove(tag)
    assert wan_net.leftovers(tag) == []


CHILD = """
import subprocess, sys
from gossipd.bench import wan_net
from gossipd.bench.wan_scenarios import SiteLink
with wan_net.Testbed([SiteLink(100.0, 5.0)] * 2) as bed:
    sleeper = bed.popen(
        1,
        [sys.executable, "-c", "import time; time.sleep(600)", "wan-sleeper"],
        stdout=subprocess.DEVNULL,
    )
    print("ready", bed.tag, sleeper.pid, flush=True)
    sys.stdin.read()
"""


@needs_root
@pytest.mark.parametrize(
    "signum",
    [signal.SIGINT, signal.SIGTERM],
    ids=["SIGINT", "SIGTERM"],
)
def test_a_harness_stopped_by_a_signal_removes_its_testbed_and_still_dies_of_it(
    signum: signal.Signals,
) -> None:
    # The handler cleans up, puts the previous handler back and delivers the signal
    # again: SIGINT raises KeyboardInterrupt, which ends Python as killed by SIGINT;
    # SIGTERM's default action ends it.
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready = next_line(lines_of(child), child, "ready line").split()
        assert ready[0] == "ready", ready
        tag, sleeper = ready[1], ready[2]
        assert wan_net.leftovers(tag)
        child.send_signal(signum)
        assert child.wait(WAIT_S) == -signum, child.stderr.read() if child.stderr else ""
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(WAIT_S)
        for stream in (child.stdin, child.stdout, child.stderr):
            if stream:
                stream.close()
    assert wan_net.leftovers(tag) == []
    assert tag not in netns_names()
    assert not sleeping(sleeper)


@needs_root
def test_goodput_through_a_tbf_link_stays_within_a_fifth_above_its_rate_both_ways() -> None:
    # Site 0 at 20 Mbit/s, site 1 at 1000: site 0's upload then its download is the
    # narrow link. An upper bound only: a busy machine can only make it slower.
    rate_mbit = 20.0
    with wan_net.Testbed([SiteLink(rate_mbit, 0), SiteLink(1000, 0)]) as bed:
        for sender, receiver in ((0, 1), (1, 0)):
            sent_before = bed.counters(sender)[0]
            sink = python(bed, receiver, RECEIVER, bed.address(receiver))
            lines = lines_of(sink)
            port = next_line(lines, sink, "the receiver's port")
            source = python(bed, sender, SENDER, bed.address(receiver), port, 5 * MB)
            assert source.wait(WAIT_S) == 0
            result = json.loads(next_line(lines, sink, "the receiver's result"))
            assert sink.wait(WAIT_S) == 0
            assert result["bytes"] == 5 * MB
            goodput_mbit = result["after_first"] * 8 / result["seconds"] / 1e6
            assert goodput_mbit <= 1.2 * rate_mbit, (sender, receiver, goodput_mbit)
            assert bed.counters(sender)[0] - sent_before >= 5 * MB


def test_the_loopback_testbed_runs_sites_directly_and_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with (
        caplog.at_level(logging.INFO, "gossipd.bench.wan_net"),
        wan_net.open_testbed([SiteLink(100, 5), SiteLink(1000, 50)], force_loopback=True) as bed,
    ):
        assert isinstance(bed, wan_net.LoopbackTestbed) and not bed.kernel_shaping
        assert bed.label == "in-process shaping (loopback asked for)"
        assert [bed.address(i) for i in range(2)] == ["127.0.0.1"] * 2
        assert (bed.latency_ms(1), bed.rate_mbit(1), bed.counters(0)) == (50, 1000, None)
        echo = python(bed, 0, "print(__import__('os').getpid())")
        assert int(echo.communicate(timeout=WAIT_S)[0]) == echo.pid  # no wrapper between
        sleeper = bed.popen(1, [sys.executable, "-c", "import time; time.sleep(600)"])
        with pytest.raises(IndexError, match="no site 2"):
            bed.address(2)
    assert sleeper.returncode is not None
    assert "127.0.0.1 with in-process shaping (loopback asked for)" in caplog.text
    with pytest.raises(wan_net.TestbedError, match="closed"):
        bed.popen(0, ["true"])


# As root, the child drops to the unprivileged "nobody" (after its imports: the
# virtualenv may live where nobody cannot read) so have_root() really fails.
NOT_ROOT = """
import logging, os
from gossipd.bench import wan_net
from gossipd.bench.wan_scenarios import SiteLink
if os.geteuid() == 0:
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
logging.basicConfig(level=logging.INFO, format="%(message)s")
with wan_net.open_testbed([SiteLink(100, 5)]) as bed:
    print(type(bed).__name__, "|", bed.label)
"""


def test_without_root_open_testbed_falls_back_to_loopback_and_names_the_reason() -> None:
    done = subprocess.run(
        [sys.executable, "-c", NOT_ROOT], capture_output=True, text=True, timeout=WAIT_S
    )
    assert done.returncode == 0, done.stderr
    kind, label = done.stdout.strip().split(" | ")
    assert kind == "LoopbackTestbed"
    assert label.startswith("in-process shaping (not root: running as uid ")
    assert "run as root with iproute2 installed" in done.stderr


AT_EXIT = """
from gossipd.bench import wan_net
from gossipd.bench.wan_scenarios import SiteLink
bed = wan_net.Testbed([SiteLink(100.0, 5.0)] * 2)
print(bed.tag, flush=True)
"""


@needs_root
def test_a_testbed_left_open_is_removed_when_the_interpreter_exits() -> None:
    done = subprocess.run(
        [sys.executable, "-c", AT_EXIT], capture_output=True, text=True, timeout=WAIT_S
    )
    assert done.returncode == 0, done.stderr
    tag = done.stdout.strip()
    assert tag.startswith(wan_net.PREFIX) and len(tag) == 11
    assert wan_net.leftovers(tag) == []


@needs_root
def test_check_lists_what_a_killed_harness_left_and_clean_removes_it_with_its_processes() -> None:
    # SIGKILL is the one way out nothing can clean up after: the command is for that.
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        _, tag, sleeper = next_line(lines_of(child), child, "ready line").split()
    finally:
        child.kill()
        child.wait(WAIT_S)
        for stream in (child.stdin, child.stdout):
            if stream:
                stream.close()
    command = [sys.executable, "-m", "gossipd.bench.wan_net"]
    try:
        check = subprocess.run(
            [*command, "--check", tag], capture_output=True, text=True, timeout=WAIT_S
        )
        assert check.returncode == 1
        assert f"netns {tag}n0" in check.stdout and f"qdisc tbf on {tag}h1" in check.stdout
        assert sleeping(sleeper)  # the site's process outlived its harness
        clean = subprocess.run(
            [*command, "--clean", tag], capture_output=True, text=True, timeout=WAIT_S
        )
        assert clean.returncode == 0, clean.stdout + clean.stderr
    finally:
        wan_net.remove(tag)
    assert wan_net.leftovers(tag) == []
    wait_until(lambda: not sleeping(sleeper), "the orphaned site process to die", WAIT_S)
