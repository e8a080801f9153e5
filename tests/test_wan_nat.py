"""The wide-area testbed's NAT router: natted sites dial out, masqueraded; nobody dials in.

The router tests build real namespaces, veths, nftables rules and sysctls, so they need
root, iproute2 and nftables and are skipped, with the reason, where those are missing;
the checks of the ``natted`` argument and the loopback testbed's record of it run
everywhere. Every connection attempt that must fail is bounded by PROBE_S, every other
wait by WAIT_S, and every process started is reaped.
"""

from __future__ import annotations

import ipaddress
import socket
import subprocess
import sys

import pytest

from gossipd.bench import wan_nat, wan_net
from gossipd.bench.wan_scenarios import SiteLink
from gossipd.node.errors import ConfigError
from tests.test_wan_net import lines_of, next_line, python

ROOT, WHY_NOT = wan_net.have_root()
NFT_MISSING = wan_nat.nft_missing()
needs_nat = pytest.mark.skipif(
    not ROOT or NFT_MISSING is not None,
    reason=f"the NAT router needs namespaces and nftables: {WHY_NOT if not ROOT else NFT_MISSING}",
)
WAIT_S = 60.0
PROBE_S = 3.0  # a connection the NAT must stop fails within this (refused, unreachable or timeout)

# Serves `count` connections on (address, any free port): prints the port first, then
# each peer's address, and echoes what the peer sends.
PEER_SERVER = """
import socket, sys
server = socket.create_server((sys.argv[1], 0))
server.settimeout(60)
print(server.getsockname()[1], flush=True)
for _ in range(int(sys.argv[2])):
    conn, peer = server.accept()
    with conn:
        print(peer[0], flush=True)
        conn.settimeout(60)
        conn.sendall(conn.recv(1024))
"""
# Connects within argv[3] seconds, sends a word and prints what comes back, or prints
# "failed" and the error's name.
PROBE = """
import socket, sys
try:
    conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
except OSError as err:
    print("failed", type(err).__name__, err, flush=True)
else:
    with conn:
        conn.sendall(b"through")
        print(conn.recv(1024).decode(), flush=True)
"""


def probe(bed: wan_net.Testbed, site: int, address: str, port: int) -> str:
    """What site ``site`` gets dialing (address, port): "through" or "failed ...". The
    process is reaped within PROBE_S plus its start."""
    client = python(bed, site, PROBE, address, port, PROBE_S)
    out, _ = client.communicate(timeout=WAIT_S)
    assert client.returncode == 0, out
    return out.strip()


def sysctl(netns: str, key: str) -> int:
    out = subprocess.run(
        ["ip", "netns", "exec", netns, "cat", f"/proc/sys/{key}"],
        capture_output=True,
        text=True,
        check=True,
        timeout=WAIT_S,
    ).stdout
    return int(out)


@needs_nat
def test_nobody_outside_can_open_a_connection_to_a_natted_site() -> None:
    # Site 0 is public, sites 1 and 2 are natted; site 1 serves one connection, which
    # only site 2, on the same private network, can open: the control that the server
    # was listening while every other attempt failed.
    with wan_net.Testbed([SiteLink(100, 5)] * 3, natted={1, 2}) as bed:
        assert bed.nat is not None
        router = str(bed.router_address())
        server = python(bed, 1, PEER_SERVER, bed.address(1), 1)
        lines = lines_of(server)
        port = int(next_line(lines, server, "the natted server's port"))
        # A public site has no route to the private network ...
        assert probe(bed, 0, bed.address(1), port).startswith("failed"), "public, no route"
        # ... nor through the router with one: it forwards nothing opened from outside.
        subprocess.run(
            ["ip", "-n", bed.netns(0), "route", "add", str(bed.nat.private_network), "via", router],
            check=True,
            timeout=WAIT_S,
        )
        assert probe(bed, 0, bed.address(1), port).startswith("failed"), "public, routed"
        # No DNAT: the router's public address does not lead to the natted site.
        assert probe(bed, 0, router, port).startswith("failed ConnectionRefusedError")
        # Nor can the root namespace (the harness), at either address.
        for address in (bed.address(1), router):
            with pytest.raises(OSError):
                socket.create_connection((address, port), timeout=PROBE_S).close()
        assert probe(bed, 2, bed.address(1), port) == "through"
        assert next_line(lines, server, "the peer's address") == bed.address(2)
        assert server.wait(WAIT_S) == 0
    assert wan_net.leftovers(bed.tag) == []


@needs_nat
def test_a_natted_site_reaches_a_public_site_and_the_harness_from_the_routers_address() -> None:
    with wan_net.Testbed([SiteLink(100, 5), SiteLink(20, 50)], natted={1}) as bed:
        assert bed.nat is not None and bed.is_natted(1) and not bed.is_natted(0)
        router = bed.router_address()
        assert router is not None and ipaddress.ip_address(router) in bed.network
        assert ipaddress.ip_address(bed.address(1)) in bed.nat.private_network
        assert not bed.nat.private_network.overlaps(bed.network)
        # Shaped as a public site is: its own veth pair, tbf at its rate on both ends.
        for netns, dev in (
            (bed.netns(1), bed.interface(1)),
            (bed.nat.netns, bed.host_interface(1)),
        ):
            shown = subprocess.run(
                ["tc", "-n", netns, "qdisc", "show", "dev", dev],
                capture_output=True,
                text=True,
                check=True,
                timeout=WAIT_S,
            ).stdout
            assert "tbf" in shown and "rate 20Mbit" in shown, shown

        server = python(bed, 0, PEER_SERVER, bed.address(0), 1)
        lines = lines_of(server)
        port = int(next_line(lines, server, "the public server's port"))
        assert probe(bed, 1, bed.address(0), port) == "through"
        # Masqueraded: the public site sees the router, not the private address.
        assert next_line(lines, server, "the peer's address") == router
        assert server.wait(WAIT_S) == 0

        with socket.create_server((bed.bridge_address, 0)) as harness:
            harness.settimeout(WAIT_S)
            client = python(bed, 1, PROBE, bed.bridge_address, harness.getsockname()[1], WAIT_S)
            try:
                conn, peer = harness.accept()
                with conn:
                    conn.settimeout(WAIT_S)
                    conn.sendall(conn.recv(1024))
                out, _ = client.communicate(timeout=WAIT_S)
            finally:
                if client.poll() is None:
                    client.kill()
                client.wait(WAIT_S)
        assert (client.returncode, out.strip(), peer[0]) == (0, "through", router)
    assert wan_net.leftovers(bed.tag) == []


@needs_nat
def test_the_router_forgets_idle_connections_fast_and_forwards_in_its_namespace_only() -> None:
    with open("/proc/sys/" + wan_nat.CONNTRACK_IDLE) as f:
        root_idle = int(f.read())
    with wan_net.Testbed([SiteLink(100, 5)] * 2, natted={1}) as bed:
        assert bed.nat is not None
        assert sysctl(bed.nat.netns, wan_nat.CONNTRACK_IDLE) == wan_nat.NAT_IDLE_S == 30
        assert sysctl(bed.nat.netns, wan_nat.IP_FORWARD) == 1
        assert [sysctl(bed.netns(i), wan_nat.IP_FORWARD) for i in range(2)] == [0, 0]
        ruleset = subprocess.run(
            ["ip", "netns", "exec", bed.nat.netns, "nft", "list", "ruleset"],
            capture_output=True,
            text=True,
            check=True,
            timeout=WAIT_S,
        ).stdout
        assert "masquerade" in ruleset and "policy drop" in ruleset and "dnat" not in ruleset
    with wan_net.Testbed([SiteLink(100, 5)], natted={0}, nat_idle_s=45) as other:
        assert other.nat is not None
        assert sysctl(other.nat.netns, wan_nat.CONNTRACK_IDLE) == 45
        # Per namespace: the root namespace's timeout is untouched.
        with open("/proc/sys/" + wan_nat.CONNTRACK_IDLE) as f:
            assert int(f.read()) == root_idle
    assert wan_net.leftovers(other.tag) == []


KILLED = """
from gossipd.bench import wan_net
from gossipd.bench.wan_scenarios import SiteLink
bed = wan_net.Testbed([SiteLink(100.0, 5.0)] * 2, natted={1})
print(bed.tag, flush=True)
import os, signal
os.kill(os.getpid(), signal.SIGKILL)
"""


@needs_nat
def test_close_and_clean_remove_the_router_with_the_rest() -> None:
    with wan_net.Testbed([SiteLink(100, 5)] * 3, natted={0, 2}) as bed:
        assert bed.nat is not None
        left = wan_net.leftovers(bed.tag)
        assert f"netns {bed.nat.netns}" in left and f"link {bed.nat.host_interface}" in left
    assert wan_net.leftovers(bed.tag) == []
    # A harness killed by SIGKILL leaves the router; --check lists it, --clean removes it.
    done = subprocess.run(
        [sys.executable, "-c", KILLED], capture_output=True, text=True, timeout=WAIT_S
    )
    tag = done.stdout.strip()
    assert done.returncode == -9 and tag.startswith(wan_net.PREFIX), done.stderr
    command = [sys.executable, "-m", "gossipd.bench.wan_net"]
    try:
        check = subprocess.run(
            [*command, "--check", tag], capture_output=True, text=True, timeout=WAIT_S
        )
        assert check.returncode == 1 and f"netns {tag}r\n" in check.stdout, check.stdout
        clean = subprocess.run(
            [*command, "--clean", tag], capture_output=True, text=True, timeout=WAIT_S
        )
        assert clean.returncode == 0, clean.stdout + clean.stderr
    finally:
        wan_net.remove(tag)
    assert wan_net.leftovers(tag) == []


def test_natted_sites_must_be_sites_and_the_loopback_testbed_records_them() -> None:
    with pytest.raises(ConfigError, match=r"natted sites \[2\] are not sites"):
        wan_net.Testbed([SiteLink(100, 5)] * 2, natted={2})
    with pytest.raises(ConfigError, match="not sites"):
        wan_net.LoopbackTestbed([SiteLink(100, 5)], "test", natted={True})
    with wan_net.open_testbed([SiteLink(100, 5)] * 3, force_loopback=True, natted={1}) as bed:
        assert isinstance(bed, wan_net.LoopbackTestbed)
        assert [bed.is_natted(i) for i in range(3)] == [False, True, False]
        assert bed.address(1) == "127.0.0.1"
