"""The Status RPC's answer: read from the trainer's published summary and the network's
own tables, so it never waits on a step; a model checksum or sketch only on request,
rate-limited.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from gossipd.node.errors import InvalidFrame
from gossipd.node.model.segments import model_checksum
from gossipd.node.model.sketch import MAX_SKETCH_SIZE, sketch
from gossipd.proto import gossip_pb2 as pb

if TYPE_CHECKING:
    import torch

    from gossipd.node.net.gossip.outbound import Outbound
    from gossipd.node.net.peers.health import PeerHealth
    from gossipd.node.net.peers.peering import Peering
    from gossipd.node.shared.rejections import RejectionLog
    from gossipd.node.shared.tls import Credentials
    from gossipd.node.trainer.messages import ReplicaLink

CHECKSUM_INTERVAL_S = 0.2
T = TypeVar("T")


class StatusReplies:
    """Builds a node's ``StatusReply`` from the parts that know each field."""

    def __init__(
        self,
        *,
        node_id: str,
        mesh_id: str,
        replica: ReplicaLink,
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
        self._copy_lock = asyncio.Lock()
        self._copied_at = -math.inf
        # Set by the site that owns this network: what it alone knows.
        self.evaluation: tuple[dict[str, float], int] = ({}, 0)  # metrics, and their step
        self.ranks = 1
        self.crash = pb.CrashAudit()

    async def reply(self, checksum: bool = False, sketch_size: int = 0) -> pb.StatusReply:
        """Answered from the trainer's published summary: never waits on a step."""
        if sketch_size > MAX_SKETCH_SIZE:
            raise InvalidFrame(
                f"sketch_size {sketch_size} is over {MAX_SKETCH_SIZE}; ask for fewer buckets"
            )
        s = self.replica.summary
        metrics, eval_step = self.evaluation
        model_sketch: list[float] = []
        if sketch_size:
            model_sketch = await self._from_copy(lambda c: sketch(c, sketch_size))
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
            eval=metrics,
            eval_step=eval_step,
            model_sketch=model_sketch,
            pulls=s.pulls,
            ranks=self.ranks,
            crash=self.crash,
            weight_cut=s.weight_cut,
        )

    def set_crash(self, audit: pb.CrashAudit) -> None:
        """What the restart audit found so far (:mod:`gossipd.node.net.status.restart_audit`)."""
        self.crash = audit

    async def _checksum(self) -> str:
        return await self._from_copy(model_checksum)

    async def _from_copy(self, compute: Callable[[list[torch.Tensor]], T]) -> T:
        """``compute`` on a copy of the model, one at a time and at most every
        CHECKSUM_INTERVAL_S, so status requests cannot load the trainer.

        The copy is taken under the trainer's lock (a memcpy); the work runs off it.
        """
        async with self._copy_lock:
            wait_s = self._copied_at + CHECKSUM_INTERVAL_S - time.monotonic()
            if wait_s > 0:
                await asyncio.sleep(wait_s)
            self._copied_at = time.monotonic()

            def run() -> T:
                with self.replica.lock:
                    copies = [b.detach().cpu().clone() for b in self.replica.flat.buffers]
                return compute(copies)

            return await asyncio.to_thread(run)
