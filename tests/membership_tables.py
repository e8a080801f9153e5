"""A Membership as the membership tests build it, and its tables as they read them.

Used by tests/test_membership.py (claims and verification),
tests/test_membership_liveness.py and tests/test_membership_schedules.py.
"""

from __future__ import annotations

from gossipd.node.net.peers.membership import Membership, NodeInfo

SELF = "me"
SELF_ADDRESS = "me.example:5000"


def info(node_id: str, incarnation: int = 1, address: str | None = None) -> NodeInfo:
    return NodeInfo(
        node_id=node_id,
        address=address if address is not None else f"{node_id}.example:5000",
        incarnation=incarnation,
    )


def membership(**kwargs) -> Membership:
    m = Membership(SELF, **kwargs)
    m.self_address = SELF_ADDRESS
    return m


def verify(m: Membership, node_id: str, incarnation: int = 1, address: str | None = None):
    """Our own Handshake to the node's address, answered by the node itself."""
    reply = info(node_id, incarnation, address)
    return m.verified(reply.address, reply)


def live_ids(m: Membership) -> list[str]:
    return [s.node_id for s in m.live()]


def known_triples(m: Membership) -> list[tuple[str, str, int]]:
    return [(i.node_id, i.address, i.incarnation) for i in m.known()]


def peer_table(m: Membership) -> dict[str, tuple]:
    return {
        n: (s.address, s.incarnation, s.live, s.failures, s.suspected_since)
        for n, s in m.peers.items()
    }
