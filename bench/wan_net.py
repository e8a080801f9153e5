"""A wide-area network on one machine: one network namespace per site, shaped by ``tc``.

Each site gets its own network namespace, joined by a veth pair to one Linux bridge
in the root namespace. The bridge has an address, so the benchmark harness, which
runs in the root namespace, reaches every site; site i is ``10.X.Y.(i+1)/24``. Each
site's bandwidth is shaped by a ``tbf`` qdisc at its rate in both directions: on the
site-side veth (what it uploads) and the bridge-side veth (what it downloads), so a
transfer between two sites runs at the slower of the two. Latency is not made by
``tc`` (this kernel has no ``netem``): gossipd injects it in-process with
``[link] latency_ms``, and the testbed only reports each site's value. Sites named in
``natted`` sit behind a NAT router instead of on the bridge (:mod:`gossipd.bench.wan_nat`):
they dial out, nobody dials in.

Building needs root and iproute2 (``ip``, ``tc``). Without them :func:`open_testbed`
falls back to :class:`LoopbackTestbed`: every site on 127.0.0.1, shaped by gossipd's
own ``[link] rate_mbit`` and ``latency_ms``. Both have the same interface.

Every name a testbed makes starts with its tag (``gwan`` + pid + counter), so two
testbeds in parallel test workers never collide and :func:`leftovers` finds exactly
one testbed's remains. ``python -m gossipd.bench.wan_net --check`` lists what any
testbed left behind (after a SIGKILL, which nothing can clean up after), ``--clean``
removes it.
"""

from __future__ import annotations

import abc
import argparse
import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Sequence
from typing import Any, Self

from gossipd.bench import wan_cleanup
from gossipd.bench.wan_iproute import (
    PREFIX,
    TestbedError,
    free_network,
    have_root,
    leftovers,
    network_lock,
    new_tag,
    process_prefix,
    remove,
    run,
    tbf_args,
    tool,
)
from gossipd.bench.wan_nat import NAT_IDLE_S, NatRouter, check_natted, nft_missing
from gossipd.bench.wan_scenarios import SiteLink
from gossipd.node.errors import ConfigError

__all__ = [
    "LoopbackTestbed",
    "Testbed",
    "TestbedError",
    "have_root",
    "leftovers",
    "new_tag",
    "open_testbed",
    "process_prefix",
    "remove",
]
log = logging.getLogger(__name__)

MAX_SITES = 253  # 10.X.Y.1 to .253 (.254 is the bridge); 3 digits keep names at 15 characters


class _Sites(abc.ABC):
    """What both testbeds share: the links, the processes they started, closing."""

    kernel_shaping = False
    label = ""

    def __init__(self, links: Sequence[SiteLink], natted: Iterable[int] = ()) -> None:
        if not 1 <= len(links) <= MAX_SITES:
            raise ConfigError(
                f"a wide-area testbed needs 1 to {MAX_SITES} sites, got {len(links)}; "
                f"give one SiteLink per site (Scenario.links(n_sites))"
            )
        self.links = list(links)
        self.natted = check_natted(natted, len(self.links))
        self.owner_pid = os.getpid()
        self._procs: list[subprocess.Popen[Any]] = []
        self._closed = False

    @property
    def n_sites(self) -> int:
        return len(self.links)

    def latency_ms(self, i: int) -> float:
        """Site i's one-way latency: the harness writes it into the site's ``[link]``."""
        return self.links[self._site(i)].latency_ms

    def rate_mbit(self, i: int) -> float:
        """Site i's bandwidth (both directions)."""
        return self.links[self._site(i)].rate_mbit

    def is_natted(self, i: int) -> bool:
        """Whether site i is behind the NAT router (only recorded by a loopback testbed)."""
        return self._site(i) in self.natted

    @abc.abstractmethod
    def address(self, i: int) -> str:
        """Each testbed says how (namespace or loopback)."""

    @abc.abstractmethod
    def counters(self, i: int) -> tuple[int, int] | None:
        """Each testbed says how (namespace or loopback)."""

    @abc.abstractmethod
    def _argv(self, i: int, argv: Sequence[str]) -> list[str]:
        """Each testbed says how (namespace or loopback)."""

    def popen(self, i: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` as site i, tracked so :meth:`close` stops it and its children (it
        leads a new process group unless ``start_new_session=False`` is given)."""
        if self._closed:
            raise TestbedError(f"this testbed ({self.label}) is closed; open a new one")
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self._argv(self._site(i), argv), **kwargs)
        self._procs.append(proc)
        return proc

    def close(self) -> None:
        """Stop every process started here (SIGTERM, then SIGKILL), then remove what was
        built. Idempotent; also run at exit and on SIGINT/SIGTERM."""
        if self._closed:
            return
        self._closed = True
        try:
            wan_cleanup.stop_processes(self._procs)
        finally:
            try:
                self._teardown()
            finally:
                wan_cleanup.unregister(self)

    def _teardown(self) -> None:  # noqa: B027 - a hook: loopback sites leave nothing behind
        """Nothing to remove for loopback sites."""

    def _site(self, i: int) -> int:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self.links):
            raise IndexError(f"no site {i!r}: this testbed has sites 0 to {len(self.links) - 1}")
        return i

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


class Testbed(_Sites):
    """N sites in network namespaces on one bridge, each shaped by tbf both ways (root)."""

    kernel_shaping = True

    def __init__(
        self,
        links: Sequence[SiteLink],
        *,
        tag: str | None = None,
        natted: Iterable[int] = (),
        nat_idle_s: int = NAT_IDLE_S,
    ) -> None:
        super().__init__(links, natted)
        if tag is not None and not re.fullmatch(f"{PREFIX}[0-9a-z]{{7}}", tag):
            raise ConfigError(
                f"testbed tag {tag!r} is not {PREFIX} and 7 lowercase letters or digits; "
                f"leave it out, or take one from new_tag()"
            )
        self.tag = tag or new_tag()
        self.bridge = f"{self.tag}b"
        self.nat: NatRouter | None = None
        self._ip = tool("ip")
        self._tc = tool("tc")
        self.label = f"network namespaces, bandwidth shaped by tc tbf (testbed {self.tag})"
        wan_cleanup.register(self)
        try:
            # Chosen and taken under one lock: two testbeds built at once get two networks.
            with network_lock():
                self.network = free_network(self.tag, self._ip)
                self.bridge_address = str(self.network.network_address + 254)
                self._build_bridge()
            if self.natted:
                self.nat = NatRouter(self.tag, self.natted, self.network, nat_idle_s)
                self.nat.build(self._ip, self.bridge, self.bridge_address, self._run)
            self._build_sites()
        except BaseException:
            self.close()
            # A signal's handler closes the testbed while an `ip` it started may still
            # be running; what that one made is removed now.
            if leftovers(self.tag):
                remove(self.tag)
            raise
        self.label = (
            f"network namespaces on {self.network}, bandwidth shaped by tc tbf (testbed {self.tag})"
        )

    def netns(self, i: int) -> str:
        """Site i's network namespace (``ip netns exec NAME ...`` runs inside it)."""
        return f"{self.tag}n{self._site(i)}"

    def interface(self, i: int) -> str:
        """Site i's interface, inside its namespace."""
        return f"{self.tag}s{self._site(i)}"

    def host_interface(self, i: int) -> str:
        """The bridge-side end of site i's veth pair: in the root namespace, or in the NAT
        router's (``nat.netns``) for a natted site."""
        return f"{self.tag}h{self._site(i)}"

    def address(self, i: int) -> str:
        """Site i's IP address (listen there from inside the site, dial it from anywhere;
        a natted site's is private: only it, other natted sites and the router reach it)."""
        if self.nat is not None and self.is_natted(i):
            return self.nat.site_address(i)
        return str(self.network.network_address + self._site(i) + 1)

    def router_address(self) -> str | None:
        """The NAT router's public address, which natted sites' connections come from;
        None without natted sites."""
        return None if self.nat is None else str(self.nat.public_address)

    def counters(self, i: int) -> tuple[int, int]:
        """(tx_bytes, rx_bytes) of site i's interface, read inside its namespace: the
        bytes it sent and received, Ethernet headers included."""
        out = self._run(
            [self._ip, "-n", self.netns(i), "-j", "-s", "link", "show", "dev", self.interface(i)],
            f"reading site {i}'s byte counters",
        )
        stats = json.loads(out)[0]["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])

    def _argv(self, i: int, argv: Sequence[str]) -> list[str]:
        return [self._ip, "netns", "exec", self.netns(i), *argv]

    def _build_bridge(self) -> None:
        ip, br = self._ip, self.bridge
        self._run([ip, "link", "add", br, "type", "bridge"], "creating the bridge")
        self._run(
            [ip, "addr", "add", f"{self.bridge_address}/{self.network.prefixlen}", "dev", br],
            "bridge address",
        )
        self._run([ip, "link", "set", br, "up"], "bringing the bridge up")

    def _build_sites(self) -> None:
        ip, tc, br = self._ip, self._tc, self.bridge
        prefix = self.network.prefixlen
        for i, link in enumerate(self.links):
            ns, site, host = self.netns(i), self.interface(i), self.host_interface(i)
            nat = self.nat if self.is_natted(i) else None  # its private bridge, in the router
            where, master = (["-n", nat.netns], nat.bridge) if nat else ([], br)
            self._run([ip, "netns", "add", ns], f"creating site {i}'s namespace")
            veth = [host, "type", "veth", "peer", "name", site, "netns", ns]
            self._run([ip, *where, "link", "add", *veth], f"creating site {i}'s veth pair")
            self._run(
                [ip, *where, "link", "set", host, "master", master, "up"], f"attaching site {i}"
            )
            self._run([ip, "-n", ns, "link", "set", "lo", "up"], f"site {i}'s loopback")
            self._run(
                [ip, "-n", ns, "addr", "add", f"{self.address(i)}/{prefix}", "dev", site],
                f"site {i}'s address",
            )
            self._run([ip, "-n", ns, "link", "set", site, "up"], f"bringing site {i} up")
            if nat:  # its private network is a /24 too
                route = ["route", "add", "default", "via", nat.gateway]
                self._run([ip, "-n", ns, *route], f"site {i}'s route to the NAT router")
            tbf = tbf_args(link.rate_mbit)
            self._run([tc, "-n", ns, "qdisc", "add", "dev", site, "root", *tbf], f"site {i} up")
            self._run([tc, *where, "qdisc", "add", "dev", host, "root", *tbf], f"site {i} down")

    def _teardown(self) -> None:
        remove(self.tag)
        left = leftovers(self.tag)
        if left:
            raise TestbedError(
                f"testbed {self.tag} could not remove {', '.join(left)}; remove them with "
                f"`python -m gossipd.bench.wan_net --clean {self.tag}`"
            )

    def _run(self, argv: list[str], what: str) -> str:
        try:
            return run(argv, f"testbed {self.tag}: {what}")
        except TestbedError as err:
            if "File exists" not in str(err):
                raise
            raise TestbedError(
                f"{err}. An earlier testbed with this tag (killed with SIGKILL, then its pid "
                f"reused?) left it; the failed build removes every {self.tag}* name, so "
                f"building again works"
            ) from err


class LoopbackTestbed(_Sites):
    """Every site on 127.0.0.1, without root: the sites' own ``[link] rate_mbit`` and
    ``latency_ms`` shape them in-process, and byte counters are unavailable."""

    def __init__(
        self, links: Sequence[SiteLink], reason: str, *, natted: Iterable[int] = ()
    ) -> None:
        super().__init__(links, natted)
        self.reason = reason
        self.label = f"in-process shaping ({reason})"
        wan_cleanup.register(self)

    def address(self, i: int) -> str:
        self._site(i)
        return "127.0.0.1"

    def counters(self, i: int) -> None:
        """None: loopback is shared by every site, so there is no per-site count."""
        self._site(i)
        return None

    def _argv(self, i: int, argv: Sequence[str]) -> list[str]:
        return list(argv)


def open_testbed(
    links: Sequence[SiteLink],
    *,
    force_loopback: bool = False,
    natted: Iterable[int] = (),
    nat_idle_s: int = NAT_IDLE_S,
) -> Testbed | LoopbackTestbed:
    """A :class:`Testbed` when namespaces and tc (and nft, for ``natted`` sites) work here,
    else a :class:`LoopbackTestbed` (or that one when ``force_loopback``); logs at INFO
    which one and why."""
    natted = frozenset(natted)
    if force_loopback:
        reason = "loopback asked for"
    else:
        usable, why = have_root()
        reason = f"not root: {why}"
        if usable and natted and nft_missing():
            usable, reason = False, str(nft_missing())
        if usable:
            bed = Testbed(links, natted=natted, nat_idle_s=nat_idle_s)
            log.info(
                "wide-area testbed: %d sites in %s; site 0 at %s",
                bed.n_sites,
                bed.label,
                bed.address(0),
            )
            return bed
    loop = LoopbackTestbed(links, reason, natted=natted)
    log.info(
        "wide-area testbed: %d sites on 127.0.0.1 with %s; each site's [link] rate_mbit and "
        "latency_ms shape it. For kernel shaping run as root with iproute2 installed",
        loop.n_sites,
        loop.label,
    )
    return loop


def main(argv: Sequence[str] | None = None) -> int:
    """``--check``: list what testbeds left behind (exit 1 if anything); ``--clean``:
    remove it."""
    parser = argparse.ArgumentParser(
        prog="python -m gossipd.bench.wan_net", description=__doc__.split("\n")[0]
    )
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument(
        "--check",
        nargs="?",
        const=PREFIX,
        metavar="TAG",
        help=f"list namespaces, links and qdiscs named TAG* (default {PREFIX}: every testbed's)",
    )
    action.add_argument(
        "--clean",
        nargs="?",
        const=PREFIX,
        metavar="TAG",
        help="remove them, killing what still runs in those namespaces (only while no "
        "testbed of that tag runs: without TAG, every testbed's)",
    )
    args = parser.parse_args(argv)
    if args.clean is not None:
        remove(args.clean)
    left = leftovers(args.check or args.clean)
    for item in left:
        print(item)
    if not left:
        print(f"no namespaces, links or qdiscs named {args.check or args.clean}*")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
