"""Who is in the mesh, from this node's point of view (sans-IO; the caller passes the time).

A peer is *live* after a successful handshake. Consecutive failures past a
threshold make it *suspected*: it gets no pushes, but anti-entropy keeps trying
it, and one success makes it live again. A peer suspected for longer than
``drop_after_s`` is forgotten until someone mentions it again. A peer that says
``Leave`` is dropped at once. A higher incarnation of a known id replaces the
old entry (the node restarted, maybe on a new address).
"""

from __future__ import annotations

from dataclasses import dataclass

from gossipd.proto import gossip_pb2 as pb


@dataclass
class PeerState:
    node_id: str
    address: str
    incarnation: int
    live: bool = False
    failures: int = 0
    suspected_since: float | None = None

    def info(self) -> pb.NodeInfo:
        return pb.NodeInfo(node_id=self.node_id, address=self.address, incarnation=self.incarnation)


@dataclass(frozen=True)
class Change:
    node_id: str
    live: bool


class Membership:
    def __init__(
        self, self_id: str, *, suspect_after_failures: int = 3, drop_after_s: float = 15.0
    ) -> None:
        self.self_id = self_id
        self.suspect_after_failures = suspect_after_failures
        self.drop_after_s = drop_after_s
        self.peers: dict[str, PeerState] = {}
        self.left: dict[str, int] = {}  # node_id -> incarnation that said goodbye

    def learn(self, info: pb.NodeInfo) -> PeerState | None:
        """Record a peer we heard of; returns it if it is new or changed and needs a handshake."""
        if info.node_id == self.self_id or not info.node_id or not info.address:
            return None
        if self.left.get(info.node_id, -1) >= info.incarnation:
            return None
        known = self.peers.get(info.node_id)
        if known is not None and known.incarnation >= info.incarnation:
            return None
        # A restart of a live peer stays live until it fails at its new address: the
        # trainer only hears of Changes, so dropping it here silently would strand it.
        state = PeerState(
            info.node_id, info.address, info.incarnation, live=bool(known and known.live)
        )
        self.peers[info.node_id] = state
        return state

    def introduced(self, info: pb.NodeInfo) -> Change | None:
        """A handshake succeeded (either direction): the peer is live."""
        if info.node_id == self.self_id:
            return None
        self.left.pop(info.node_id, None)
        state = self.peers.get(info.node_id)
        if state is None or state.incarnation <= info.incarnation:
            was_live = state.live if state and state.incarnation == info.incarnation else False
            state = PeerState(info.node_id, info.address, info.incarnation)
            self.peers[info.node_id] = state
        else:
            was_live = state.live
        state.live, state.failures, state.suspected_since = True, 0, None
        return None if was_live else Change(info.node_id, True)

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
        if state.suspected_since is None and not state.live:
            state.suspected_since = now
        return None

    def departed(self, node_id: str) -> Change | None:
        state = self.peers.pop(node_id, None)
        if state is None:
            return None
        self.left[node_id] = state.incarnation
        return Change(node_id, False) if state.live else None

    def expire(self, now: float) -> list[str]:
        """Forget peers suspected for longer than ``drop_after_s``."""
        gone = [
            s.node_id
            for s in self.peers.values()
            if s.suspected_since is not None and now - s.suspected_since > self.drop_after_s
        ]
        for node_id in gone:
            del self.peers[node_id]
        return gone

    def live(self) -> list[PeerState]:
        return sorted((s for s in self.peers.values() if s.live), key=lambda s: s.node_id)

    def known(self) -> list[pb.NodeInfo]:
        return [s.info() for s in sorted(self.peers.values(), key=lambda s: s.node_id)]
