"""Whether a site can be dialled: a peer dials it back at the address it advertises.

The asking side (:func:`ask_reach`) asks its seeds in turn; the first that answers
decides. The answering side (:class:`ReachChecker`) dials only the address the asking
site advertises in its request, only after the asker's certificate was checked against
the node id it claims, only with a TLS handshake that the far end must pass as that
same node (a health check over mutual TLS), at most once per ``PER_ASKER_S`` per site
and ``MAX_AT_ONCE`` at a time: a member cannot use it to make a site dial arbitrary
addresses, nor to make it dial often.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gossipd.node.errors import Busy, MeshMismatch
from gossipd.node.net.wire.calls import gossip_calls
from gossipd.node.net.wire.grpc_options import CHANNEL_OPTIONS, FRESH_CHANNEL_OPTIONS
from gossipd.node.shared.relay_address import is_relayed
from gossipd.node.shared.tls import Credentials, check_claim
from gossipd.proto import gossip_pb2 as pb

DIAL_BACK_S = 3.0
PER_ASKER_S = 2.0
MAX_AT_ONCE = 4
MAX_ASKERS = 1024


@dataclass(frozen=True)
class Finding:
    """What the reach check found: ``reachable`` None when no peer could be asked."""

    reachable: bool | None
    peer: str
    detail: str


async def dial_back(tls: Credentials, address: str, node_id: str) -> tuple[bool, str]:
    """Whether ``node_id`` answers a health check at ``address``, over its own certificate."""
    channel = tls.channel(address, FRESH_CHANNEL_OPTIONS, node_id or None)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=DIAL_BACK_S)
        return True, f"{address} answered as {node_id}"
    except grpc.aio.AioRpcError as err:
        return False, f"{address}: {err.code().name.lower()} ({err.details()})"
    finally:
        await channel.close()


class ReachChecker:
    """The answering side of ``CheckReach``."""

    def __init__(self, tls: Credentials, mesh_id: str) -> None:
        self.tls = tls
        self.mesh_id = mesh_id
        self.asked: OrderedDict[str, float] = OrderedDict()  # asker -> when, bounded
        self.now_checking = 0

    async def check(self, who: str | None, request: pb.ReachRequest) -> pb.ReachReply:
        node = request.node
        check_claim(who, node.node_id, "a reach check")
        if request.mesh_id != self.mesh_id:
            raise MeshMismatch(f"{node.node_id!r} asks for mesh {request.mesh_id!r}, not ours")
        if is_relayed(node.address) or not node.address:
            return pb.ReachReply(
                reachable=False, detail=f"{node.address!r} is not an address to dial back"
            )
        now = time.monotonic()
        last = self.asked.get(node.node_id)
        if (last is not None and now - last < PER_ASKER_S) or self.now_checking >= MAX_AT_ONCE:
            raise Busy(f"reach checks are limited to one per {PER_ASKER_S:g} s per site")
        self.asked[node.node_id] = now
        self.asked.move_to_end(node.node_id)
        while len(self.asked) > MAX_ASKERS:
            self.asked.popitem(last=False)
        self.now_checking += 1
        try:
            ok, detail = await dial_back(self.tls, node.address, node.node_id)
        finally:
            self.now_checking -= 1
        return pb.ReachReply(reachable=ok, detail=detail)


async def ask_reach(tls: Credentials, mesh_id: str, me: pb.NodeInfo, peers: list[str]) -> Finding:
    """Ask ``peers`` in turn to dial ``me`` back; the first answer decides."""
    tried: list[str] = []
    for address in peers:
        channel = tls.channel(address, CHANNEL_OPTIONS, None)
        try:
            reply = await gossip_calls(channel).CheckReach(
                pb.ReachRequest(mesh_id=mesh_id, node=me), timeout=DIAL_BACK_S + 5.0
            )
            return Finding(reply.reachable, address, reply.detail)
        except grpc.aio.AioRpcError as err:
            tried.append(f"{address} ({err.code().name.lower()})")
        except asyncio.CancelledError:
            raise
        finally:
            await channel.close()
    return Finding(
        None, "", "no peer answered a reach check: " + (", ".join(tried) or "none to ask")
    )
