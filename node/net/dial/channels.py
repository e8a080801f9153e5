"""This node's channels to its peers: one per verified peer, replaced when the peer moves
or the certificates are reloaded, closed when the node closes.

A channel is opened for a node id, and its server's certificate must name that node
(:class:`~gossipd.node.net.dial.client.PeerClient`); a throwaway channel for a candidate
not yet verified is the dialler's own (:meth:`PeerChannels.throwaway`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gossipd.node.net.dial.client import Identity, PeerClient
from gossipd.node.net.relay.routes import Routes

if TYPE_CHECKING:
    from gossipd.node.compression.codecs import Codec
    from gossipd.node.compression.feedback import FeedbackSender
    from gossipd.node.net.wire.shaping import LinkShaper
    from gossipd.node.net.wire.tasks import LoopTasks
    from gossipd.node.shared.tls import Credentials

# The deadline of one control RPC to a peer (Handshake, Peers, Leave).
RPC_TIMEOUT_S = 5.0
# How long a retired channel's calls may go on before it closes (a push on a slow link).
RETIRE_GRACE_S = 30.0


class PeerChannels:
    """The channel pool; usable once :meth:`serve_as` gave it this node's identity."""

    def __init__(
        self,
        *,
        tls: Credentials,
        codec: Codec,
        chunk_bytes: int,
        shaper: LinkShaper | None,
        bulk: bool,
        tasks: LoopTasks,
        feedback: FeedbackSender | None = None,
        routes: Routes | None = None,
    ) -> None:
        """``feedback``: this node's copies for error feedback (None: off); ``routes``: how
        a relayed peer is reached (its loopback port here)."""
        self.tls = tls
        self.codec = codec
        self.feedback = feedback
        self.chunk_bytes = chunk_bytes
        self.shaper = shaper
        self.bulk = bulk
        self.tasks = tasks
        self.identity: Identity | None = None
        self.routes = routes or Routes(tls)
        self.routes.on_leaving = self.retire
        self._clients: dict[str, PeerClient] = {}

    def serve_as(self, identity: Identity) -> None:
        """This node's identity, known once it serves (its bound address is in it), and
        again whenever its address changes (an outbound-only site's relays)."""
        self.identity = identity
        self.routes.me = identity.address
        for client in self._clients.values():
            client.identity = identity

    def client(self, address: str, node_id: str) -> PeerClient:
        """The channel to verified peer ``node_id`` (whose certificate must name it)."""
        assert self.identity is not None, "start() the node first"
        client = self._clients.get(address)
        if client is None or client.expected != node_id:
            if client is not None:
                self.tasks.spawn(client.close())
            client = self._clients[address] = PeerClient(
                address,
                self.identity,
                codec=self.codec,
                feedback=self.feedback,
                chunk_bytes=self.chunk_bytes,
                tls=self.tls,
                expected=node_id,
                shaper=self.shaper,
                bulk=self.bulk,
                target=self.routes.target(address),
            )
        return client

    def throwaway(self, address: str, expected: str | None) -> PeerClient:
        """A channel for one Handshake with a candidate; the caller closes it."""
        assert self.identity is not None, "start() the node first"
        return PeerClient(
            address,
            self.identity,
            tls=self.tls,
            expected=expected,
            target=self.routes.target(address),
        )

    def forget(self, address: str) -> None:
        """Close the channel to an address no verified peer holds any more."""
        client = self._clients.pop(address, None)
        if client is not None:
            self.tasks.spawn(client.close())

    def retire(self, address: str) -> None:
        """The relay of ``address``'s connection is leaving: let the calls on the channel
        finish, then close it (the relay waits for that); the next call opens a new one."""
        client = self._clients.pop(address, None)
        if client is not None:
            self.tasks.spawn(client.close(grace_s=RETIRE_GRACE_S))

    def replace_all(self) -> None:
        """Close every channel (new certificates): the next call opens a fresh one."""
        old, self._clients = self._clients, {}
        for client in old.values():
            self.tasks.spawn(client.close())

    async def close(self) -> None:
        for client in list(self._clients.values()):
            await client.close()
        await self.routes.close()
