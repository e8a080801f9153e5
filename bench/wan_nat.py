"""A NAT router for the wide-area testbed: some sites behind one masquerading router.

Across the internet many sites sit behind a NAT (a home router, a carrier-grade NAT, a
cloud's egress gateway): they can dial out, nobody can dial in, and the NAT forgets an
idle connection's mapping after a while. gossipd has to live with that (natted peers
dial out; keepalives hold mappings open), so the testbed builds one for real:

* a router namespace ``TAGr`` with one leg on the testbed's bridge (``TAGhr`` in the
  root namespace, ``TAGrp`` in the router). Its public address is in the bridge's /24,
  in the slot of the first natted site (a natted site has no public address of its own);
  its default route is the bridge's address, so natted sites reach the harness there;
* a bridge ``TAGrb`` inside the router on a private /24 (in 10.250-254.*, a range no
  testbed's bridge takes), the router at .254. Natted site i's veth pair runs from its
  namespace to that bridge (``TAGhi`` lives in the router, not the root namespace) and
  is shaped like a public site's, by tbf on both ends; the site's address is private
  .(i+1) and its default route is the router. Natted sites reach each other directly,
  as hosts behind one home router do;
* nftables in the router: what leaves by the public leg from the private network is
  masqueraded, and only connections opened from the private side are forwarded (policy
  drop, no DNAT), so a public site or the root namespace cannot open one to a natted
  site, even with a route to it;
* ip_forward in the router's namespace only, and the router's conntrack timeout for
  established TCP connections lowered to ``nat_idle_s`` (30 s, where Linux has 5 days),
  so an idle connection's mapping dies as fast as in real NATs and keepalives matter.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable

from gossipd.bench.wan_iproute import PREFIX, TestbedError, run, which
from gossipd.node.errors import ConfigError

NAT_IDLE_S = 30  # the router forgets an idle TCP connection's mapping after this
TABLE = "gossipd_nat"
# Per network namespace (conntrack's TCP timeouts are per-netns data since Linux 3.7):
# written inside the router's namespace it leaves the root namespace's value alone, which
# the tests check by reading both.
CONNTRACK_IDLE = "net/netfilter/nf_conntrack_tcp_timeout_established"
IP_FORWARD = "net/ipv4/ip_forward"
PRIVATE_FIRST, PRIVATE_COUNT = 250, 5  # private /24s from 10.250.0.0 to 10.254.255.0

Runner = Callable[[list[str], str], str]


def check_natted(natted: Iterable[int], n_sites: int) -> frozenset[int]:
    """``natted`` as a set of site numbers, refused early (before anything is built) when
    one is not a site, so a typo does not quietly leave a site public."""
    sites = frozenset(natted)
    wrong = sorted(
        (s for s in sites if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < n_sites),
        key=repr,
    )
    if wrong:
        raise ConfigError(
            f"natted sites {wrong} are not sites of this testbed (0 to {n_sites - 1}); "
            f"give the numbers of the sites to put behind the NAT router"
        )
    return sites


def nft_missing() -> str | None:
    """Why a NAT router cannot be built here (nft is not installed), or None."""
    if which("nft") is None:
        return "nft not found; install nftables (apt-get install nftables)"
    return None


def free_private_network(tag: str, ip: str) -> ipaddress.IPv4Network:
    """A 10.250-254.*.0/24 no interface of the root namespace is on, from one the tag picks.
    Only the router and its natted sites use it, in their own namespaces, so two testbeds
    may share one; the range keeps it off every testbed's bridge network, which natted
    sites must reach."""
    used = []
    for line in run([ip, "-o", "-4", "addr", "show"], "listing addresses").splitlines():
        words = line.split()
        net = ipaddress.ip_interface(words[words.index("inet") + 1]).network
        if net.prefixlen >= 16:
            used.append(net)
    count = PRIVATE_COUNT * 256
    start = int(tag[len(PREFIX) :], 36) % count
    for k in range(count):
        n = (start + k) % count
        candidate = ipaddress.IPv4Network(f"10.{PRIVATE_FIRST + n // 256}.{n % 256}.0/24")
        if not any(candidate.overlaps(net) for net in used):
            return candidate
    raise TestbedError("no free 10.250-254.*.0/24 network for the testbed's NAT router")


class NatRouter:
    """One testbed's NAT router: its names and addresses, built by :meth:`build`, removed
    with the testbed's other ``TAG*`` names (the namespace takes its links, rules and
    sysctls with it)."""

    def __init__(
        self,
        tag: str,
        natted: frozenset[int],
        public_network: ipaddress.IPv4Network,
        nat_idle_s: int = NAT_IDLE_S,
    ) -> None:
        if not natted:
            raise ConfigError("a NAT router needs at least one natted site")
        if isinstance(nat_idle_s, bool) or not isinstance(nat_idle_s, int) or nat_idle_s < 1:
            raise ConfigError(
                f"nat_idle_s must be a whole number of seconds >= 1, not {nat_idle_s!r}"
            )
        self.tag = tag
        self.natted = natted
        self.nat_idle_s = nat_idle_s
        self.netns = f"{tag}r"
        self.bridge = f"{tag}rb"  # the private side, inside the router
        self.public_interface = f"{tag}rp"  # inside the router
        self.host_interface = f"{tag}hr"  # on the testbed's bridge, in the root namespace
        self.public_network = public_network
        self.public_address = public_network.network_address + min(natted) + 1
        self.private_network: ipaddress.IPv4Network | None = None

    @property
    def gateway(self) -> str:
        """The router's private address: the natted sites' default route."""
        return str(self._private().network_address + 254)

    def site_address(self, i: int) -> str:
        """Natted site i's private address (only the router and natted sites reach it)."""
        return str(self._private().network_address + i + 1)

    def build(self, ip: str, bridge: str, bridge_address: str, runner: Runner) -> None:
        """The namespace, its two legs, the rules and the sysctls (``runner`` runs each
        command and names the testbed in its errors). Sites are attached after."""
        nft = which("nft")
        if nft is None:
            raise TestbedError(f"testbed {self.tag}: {nft_missing()}")
        self.private_network = free_private_network(self.tag, ip)
        ns, pub, host, priv = self.netns, self.public_interface, self.host_interface, self.bridge
        runner([ip, "netns", "add", ns], "creating the NAT router's namespace")
        runner([ip, "-n", ns, "link", "set", "lo", "up"], "the router's loopback")
        runner(
            [ip, "link", "add", host, "type", "veth", "peer", "name", pub, "netns", ns],
            "creating the router's public veth pair",
        )
        runner([ip, "link", "set", host, "master", bridge, "up"], "attaching the router")
        prefix = self.public_network.prefixlen
        runner(
            [ip, "-n", ns, "addr", "add", f"{self.public_address}/{prefix}", "dev", pub],
            "the router's public address",
        )
        runner([ip, "-n", ns, "link", "set", pub, "up"], "bringing the router's public leg up")
        runner(
            [ip, "-n", ns, "route", "add", "default", "via", bridge_address],
            "the router's default route",
        )
        runner([ip, "-n", ns, "link", "add", priv, "type", "bridge"], "the router's private bridge")
        inside = f"{self.gateway}/{self._private().prefixlen}"
        runner([ip, "-n", ns, "addr", "add", inside, "dev", priv], "the router's private address")
        runner([ip, "-n", ns, "link", "set", priv, "up"], "bringing the private bridge up")
        # The rules first: they load conntrack, whose sysctls exist only once it is loaded.
        runner([ip, "netns", "exec", ns, nft, self.ruleset()], "the router's nftables rules")
        self._write_sysctl(ip, IP_FORWARD, 1, runner)
        self._write_sysctl(ip, CONNTRACK_IDLE, self.nat_idle_s, runner)

    def ruleset(self) -> str:
        """Masquerade outbound; forward what the private side opens and the replies, nothing
        else. ``iifname`` of the private bridge, not the public leg as well: with
        br_netfilter loaded, traffic between natted sites on that bridge passes the
        forward hook too."""
        return (
            f"table ip {TABLE} {{ chain forward {{ type filter hook forward priority filter; "
            f"policy drop; ct state established,related accept; "
            f'iifname "{self.bridge}" accept; }}; '
            f"chain postrouting {{ type nat hook postrouting priority srcnat; policy accept; "
            f'oifname "{self.public_interface}" ip saddr {self._private()} masquerade; }}; }}'
        )

    def read_sysctl(self, ip: str, key: str) -> int:
        """A sysctl (``net/...`` under /proc/sys) as the router's namespace sees it."""
        out = run([ip, "netns", "exec", self.netns, "cat", f"/proc/sys/{key}"], f"reading {key}")
        return int(out.strip())

    def _write_sysctl(self, ip: str, key: str, value: int, runner: Runner) -> None:
        # sh, not sysctl(8): procps may be missing where iproute2 is not. /proc/sys/net is
        # the namespace of the process that opens it, so this writes the router's.
        runner(
            [ip, "netns", "exec", self.netns, "sh", "-c", f"echo {value} > /proc/sys/{key}"],
            f"setting {key} in the router's namespace",
        )
        if (got := self.read_sysctl(ip, key)) != value:
            raise TestbedError(
                f"testbed {self.tag}: {key} in the router's namespace is {got} after writing "
                f"{value}; this kernel does not keep it per namespace"
            )

    def _private(self) -> ipaddress.IPv4Network:
        if self.private_network is None:
            raise TestbedError(f"testbed {self.tag}: the NAT router is not built yet")
        return self.private_network
