"""Who is in the mesh, from this node's point of view (sans-IO; the caller passes the time).

Two tables, both capped:

* **peers**: nodes this node has verified itself. A peer enters only when this
  node's own Handshake to an address returned that peer's id and incarnation
  (:meth:`Membership.verified`); the address that answered is the one on record.
  Only the peer itself moves its incarnation forward, and an address holds one
  node at a time. Consecutive failures past a threshold make a peer *suspected*
  (no new pushes, still retried); one success makes it live again; a peer
  suspected for longer than ``drop_after_s`` is declared dead and forgotten.
* **candidates**: addresses someone mentioned (a relayed peer list, or a node
  that handshook with us): claims, never identities. They wait, bounded, for this
  node to dial them, and never overwrite a verified entry.

Only verified peers are relayed to others, so a made-up entry dies where it was
planted instead of bouncing around the mesh.

Plain Python, no wire types: claims, replies and the relayed list are
:class:`NodeInfo` values; :mod:`gossipd.node.net.peers.peering` converts them to and from
the protobuf ``NodeInfo`` where they meet the network.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeInfo:
    """Who a node says it is and where it listens: a claim, a reply, or a relayed entry."""

    node_id: str
    address: str
    incarnation: int


@dataclass
class PeerState:
    node_id: str
    address: str
    incarnation: int
    live: bool = True
    failures: int = 0
    suspected_since: float | None = None

    def info(self) -> NodeInfo:
        return NodeInfo(self.node_id, self.address, self.incarnation)


@dataclass(frozen=True)
class Change:
    node_id: str
    live: bool


@dataclass(frozen=True)
class Verdict:
    """What one verification handshake did: peer changes, or why the claim was not taken."""

    changes: tuple[Change, ...] = ()
    refused: str | None = None


class Membership:
    def __init__(
        self,
        self_id: str,
        *,
        suspect_after_failures: int = 3,
        drop_after_s: float = 60.0,
        max_peers: int = 256,
        max_candidates: int = 64,
        max_departed: int = 1024,
    ) -> None:
        self.self_id = self_id
        self.self_address = ""
        self.suspect_after_failures = suspect_after_failures
        self.drop_after_s = drop_after_s
        self.max_peers = max_peers
        self.max_candidates = max_candidates
        self.max_departed = max_departed
        self.peers: dict[str, PeerState] = {}
        self.candidates: OrderedDict[str, NodeInfo] = OrderedDict()  # address -> claim
        self.departed: OrderedDict[str, int] = OrderedDict()  # node_id -> last incarnation

    # -- claims ---------------------------------------------------------------------
    def hear(self, info: NodeInfo, *, direct: bool = False) -> bool:
        """Note a claim about a node; True if it became a candidate worth dialling.

        ``direct`` marks a claim a node made about itself (its own Handshake): it
        may bring back a node this one had declared dead. A relayed claim about a
        departed incarnation is ignored, and nothing here touches a verified entry.
        """
        if not info.node_id or not info.address or info.node_id == self.self_id:
            return False
        if info.address == self.self_address:
            return False
        known = self.peers.get(info.node_id)
        if (
            known is not None
            and known.address == info.address
            and known.incarnation >= info.incarnation
        ):
            return False
        if not direct and self.departed.get(info.node_id, -1) >= info.incarnation:
            return False
        if info.address in self.candidates:
            if direct:
                self.candidates[info.address] = info
            return False
        if len(self.candidates) >= self.max_candidates:
            return False
        self.candidates[info.address] = info
        return True

    def take_candidates(self, count: int) -> list[tuple[str, NodeInfo]]:
        """The oldest candidates, removed from the table, for the caller to dial."""
        taken: list[tuple[str, NodeInfo]] = []
        while self.candidates and len(taken) < count:
            taken.append(self.candidates.popitem(last=False))
        return taken

    # -- verification ---------------------------------------------------------------
    def verified(self, address: str, reply: NodeInfo, claim: NodeInfo | None = None) -> Verdict:
        """This node's own Handshake to ``address`` was answered by ``reply``."""
        node_id = reply.node_id
        if not node_id or node_id == self.self_id:
            return Verdict(refused=f"{address} answered as {node_id or 'nobody'!r}")
        if claim is not None and (
            claim.node_id != node_id or claim.incarnation != reply.incarnation
        ):
            return Verdict(
                refused=f"{address} was said to be {claim.node_id!r} (incarnation "
                f"{claim.incarnation}) but answered as {node_id!r} (incarnation "
                f"{reply.incarnation})"
            )
        known = self.peers.get(node_id)
        if known is not None and reply.incarnation < known.incarnation:
            return Verdict(
                refused=f"{address} answered as {node_id!r} incarnation {reply.incarnation}, "
                f"older than the known {known.incarnation}"
            )
        changes: list[Change] = []
        for other in [p for p in self.peers.values() if p.address == address]:
            if other.node_id != node_id:  # an address holds one node: the old one is gone
                del self.peers[other.node_id]
                if other.live:
                    changes.append(Change(other.node_id, False))
        if known is None and len(self.peers) >= self.max_peers:
            return Verdict(
                tuple(changes),
                refused=f"peer table full ({self.max_peers} peers, membership.max_peers)",
            )
        self.departed.pop(node_id, None)
        self.candidates.pop(address, None)
        was_live = known is not None and known.live and known.incarnation == reply.incarnation
        if known is not None and known.live and known.incarnation != reply.incarnation:
            changes.append(Change(node_id, False))  # the old incarnation is dead
        self.peers[node_id] = PeerState(node_id, address, reply.incarnation)
        if not was_live:
            changes.append(Change(node_id, True))
        return Verdict(tuple(changes))

    # -- liveness -------------------------------------------------------------------
    def succeeded(self, node_id: str) -> Change | None:
        state = self.peers.get(node_id)
        if state is None:
            return None
        state.failures, state.suspected_since = 0, None
        if not state.live:
            state.live = True
            return Change(node_id, True)
        return None

    def failed(self, node_id: str, now: float) -> Change | None:
        state = self.peers.get(node_id)
        if state is None:
            return None
        state.failures += 1
        if state.live and state.failures >= self.suspect_after_failures:
            state.live = False
            state.suspected_since = now
            return Change(node_id, False)
        return None

    def drop(self, node_id: str) -> Change | None:
        """Forget a peer this node no longer admits (``tls.allow``); unlike a departed
        one, it is verified again if it is admitted later."""
        state = self.peers.pop(node_id, None)
        return Change(node_id, False) if state is not None and state.live else None

    def departed_now(self, node_id: str) -> Change | None:
        """The node left (checked with the node itself) or was declared dead."""
        state = self.peers.pop(node_id, None)
        if state is None:
            return None
        self.departed[node_id] = state.incarnation
        self.departed.move_to_end(node_id)
        while len(self.departed) > self.max_departed:
            self.departed.popitem(last=False)
        return Change(node_id, False) if state.live else None

    def expire(self, now: float) -> list[str]:
        """Declare dead the peers suspected for longer than ``drop_after_s``."""
        gone = [
            s.node_id
            for s in self.peers.values()
            if s.suspected_since is not None and now - s.suspected_since > self.drop_after_s
        ]
        for node_id in gone:
            self.departed_now(node_id)
        return gone

    # -- views ----------------------------------------------------------------------
    def live(self) -> list[PeerState]:
        return sorted((s for s in self.peers.values() if s.live), key=lambda s: s.node_id)

    def suspected(self) -> list[PeerState]:
        return sorted((s for s in self.peers.values() if not s.live), key=lambda s: s.node_id)

    def known(self) -> list[NodeInfo]:
        """Verified peers only: what this node relays to others."""
        return [s.info() for s in sorted(self.peers.values(), key=lambda s: s.node_id)]

    def is_current(self, node_id: str, incarnation: int) -> bool:
        state = self.peers.get(node_id)
        return state is not None and state.incarnation == incarnation
