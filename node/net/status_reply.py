"""The Status RPC's answer: read from the trainer's published summary and the network's
own tables, so it never waits on a step; a model checksum only on request, rate-limited.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from typing import TYPE_CHECKING

from gossipd.node.trainer.segments import model_checksum
from gossipd.proto import gossip_pb2 as pb

if TYPE_CHECKING:
    from gossipd.node.net.health import PeerHealth
    from gossipd.node.net.outbound import Outbound
    from gossipd.node.net.peering import Peering
    from gossipd.node.shared.rejections import RejectionLog
    from gossipd.node.shared.tls import Credentials
    from gossipd.node.trainer.replica import Replica

CHECKSUM_INTERVAL_S = 0.2


class StatusReplies:
    """Builds a node's ``StatusReply`` from the parts that know each field."""

    def __init__(
        self,
        *,
        node_id: str,
        mesh_id: str,
        replica: Replica,
        health: PeerHealth,
        peering: Peering,
        rejections: RejectionLog,
        tls: Credentials,
        outbound: Outbound,
    ) -> None:
        self.node_id = node_id
        self.mesh_id = mesh_id
        self.replica = replica
        self.membership = health.membership
        self.peering = peering
        self.rejections = rejections
        self.tls = tls
        self.outbound = outbound
        self._checksum_lock = asyncio.Lock()
        self._checksum_at = -math.inf

    async def reply(self, checksum: bool = False) -> pb.StatusReply:
        """Answered from the trainer's published summary: never waits on a step."""
        s = self.replica.summary
        return pb.StatusReply(
            node_id=self.node_id,
            mesh_id=self.mesh_id,
            step=s.steps,
            sum_weights=s.weights,
            live_peers=[p.node_id for p in self.membership.live()],
            fingerprint=self.replica.fingerprint,
            params_checksum=await self._checksum() if checksum else "",
            protocol=s.protocol,
            loss=s.loss,
            pushes_in_flight=s.in_flight,
            training_done=self.replica.training_done,
            pushes_acked=s.pushes_acked,
            pushes_failed=s.pushes_failed,
            pushes_merged=s.pushes_merged,
            peers=self.peering.known(),
            suspected_peers=[p.node_id for p in self.membership.suspected()],
            rejected=dict(self.rejections.counts),
            reserved_weights=s.reserved,
            round=s.round,
            membership_epoch=s.epoch,
            transport_security="insecure" if self.tls.insecure else "mtls",
            exchanged=[
                pb.PeerMass(node_id=peer, **dataclasses.asdict(mass))
                for peer, mass in sorted(s.exchanged.items())
            ],
            mass_inconsistencies=self.outbound.mass_inconsistencies,
            wait_s=s.wait_s,
            wait_fraction=s.wait_fraction,
            scheduling=s.scheduling,
        )

    async def _checksum(self) -> str:
        """A fresh hash of the model, one at a time and at most every CHECKSUM_INTERVAL_S.

        The copy is taken under the trainer's lock (a memcpy); the hashing runs off it.
        """
        async with self._checksum_lock:
            wait_s = self._checksum_at + CHECKSUM_INTERVAL_S - time.monotonic()
            if wait_s > 0:
                await asyncio.sleep(wait_s)
            self._checksum_at = time.monotonic()

            def compute() -> str:
                with self.replica.lock:
                    copies = [b.detach().cpu().clone() for b in self.replica.flat.buffers]
                return model_checksum(copies)

            return await asyncio.to_thread(compute)
