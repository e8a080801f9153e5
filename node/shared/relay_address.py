"""How a site that cannot be dialled is addressed: ``relay://SITE@RELAY1,RELAY2``.

The address stays a plain string everywhere a direct one goes (membership, the
coordinator's view, MQTT presence, peer lists), so nothing that carries addresses
changes; only what dials one looks inside (:mod:`gossipd.node.net.relay.routes`). The relays are the
``HOST:PORT`` gRPC addresses of reachable peers, in the order a dialler tries them.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEME = "relay://"
# The most relays one address may name: what a dialler tries is bounded.
MAX_RELAYS = 8


@dataclass(frozen=True)
class Relayed:
    """A relayed site's address, taken apart."""

    site: str
    relays: tuple[str, ...]

    def address(self) -> str:
        return f"{SCHEME}{self.site}@{','.join(self.relays)}"


def parse(address: str) -> Relayed | None:
    """The relayed address taken apart; None for a direct ``HOST:PORT`` (or anything
    malformed, which then fails to dial like any wrong address)."""
    if not address.startswith(SCHEME):
        return None
    site, sep, rest = address[len(SCHEME) :].partition("@")
    if not sep or not site:
        return None
    relays = tuple(r for r in rest.split(",") if r)[:MAX_RELAYS]
    if any(r.startswith(SCHEME) or ":" not in r for r in relays):
        return None  # a relay is always reached directly: no chains, no loops
    return Relayed(site, relays)


def is_relayed(address: str) -> bool:
    return address.startswith(SCHEME)


def reach_of(address: str) -> str:
    """What ``status`` says of a site's reach: ``direct``, or the relays it is reached by."""
    relayed = parse(address)
    if relayed is None:
        return "relayed (no relay)" if is_relayed(address) else "direct"
    if not relayed.relays:
        return "relayed (no relay yet)"
    return "relayed by " + ", ".join(relayed.relays)


def check_advertised(address: str) -> str:
    """A site's advertised address: ``HOST:PORT``, or a well-formed relayed address."""
    from gossipd.node.shared.config_sections import check_address

    if not is_relayed(address):
        return check_address(address)
    relayed = parse(address)
    if relayed is None:
        raise ValueError(f"{address!r} is not relay://SITE@HOST:PORT,... (a relayed address)")
    for relay in relayed.relays:
        check_address(relay)
    return address
