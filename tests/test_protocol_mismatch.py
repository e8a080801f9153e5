"""A mesh speaks one protocol: a node configured with another is refused, clearly.

Two in-process nodes (the library API: real gRPC servers on free ports) seed each
other; one runs crossover, the other sum-weight. Neither may become the other's
peer, the refusal names both protocols and the fix, and a third node with the
right protocol joins as usual.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from gossipd.node.jobs.registry import JobSpec, build_job
from gossipd.node.launch.localmesh import free_ports
from gossipd.node.site.api import GossipNode
from gossipd.proto import SCHEMA_VERSION
from gossipd.proto import gossip_pb2 as pb
from gossipd.proto import gossip_pb2_grpc as pb_grpc
from tests.conftest import wait_until


def _node(node_id: str, port: int, seeds: list[str], protocol: str) -> GossipNode:
    job = build_job(JobSpec("synthetic", seed=1, learning_rate=0.0))
    config: dict[str, Any] = {
        "mesh_id": "mixed",
        "node_id": node_id,
        "listen": f"127.0.0.1:{port}",
        "seeds": seeds,
        "gossip": {"protocol": protocol},
        "membership": {"anti_entropy_interval_s": 0.2},
        "metrics": {"listen": None},
        "tls": {"insecure": True},
        "shutdown_timeout_s": 3.0,
    }
    return GossipNode(config, job.model, job.optimizer)


async def _handshake(address: str, protocol: str, fingerprint: str) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await pb_grpc.GossipStub(channel).Handshake(
                pb.HandshakeRequest(
                    schema_version=SCHEMA_VERSION,
                    mesh_id="mixed",
                    node=pb.NodeInfo(node_id="probe", address="127.0.0.1:1", incarnation=1),
                    fingerprint=fingerprint,
                    protocol=protocol,
                ),
                timeout=10.0,
            )
    return caught.value


def test_a_node_with_another_protocol_is_refused_and_never_becomes_a_peer() -> None:
    ports = free_ports(3)
    addresses = [f"127.0.0.1:{p}" for p in ports]
    crossover = _node("x", ports[0], [addresses[1]], "crossover")
    sumweight = _node("s", ports[1], [addresses[0]], "sumweight")
    try:
        err = asyncio.run(_handshake(addresses[1], "crossover", sumweight.replica.fingerprint))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "'crossover'" in err.details() and "'sumweight'" in err.details()
        assert "gossip.protocol" in err.details()

        # A third node with the right protocol becomes live with s within the deadline,
        # while x (seeded with s and seeding s) never does, on either side.
        third = _node("t", ports[2], [addresses[1]], "sumweight")
        try:
            assert third.wait_for_peers(1, 60.0)
            assert sumweight.wait_for_peers(1, 60.0)
            # Both sides have dialled the other and refused it: what "never" means here.
            wait_until(
                lambda: (
                    sumweight.network.rejections.counts["MeshMismatch"] > 0
                    and crossover.network.rejections.counts["MeshMismatch"] > 0
                ),
                "x and s to have dialled and refused each other",
                60.0,
            )
            assert {p.node_id for p in sumweight.network.membership.live()} == {"t"}
            assert crossover.network.membership.live() == []
            assert sumweight.network.rejections.counts["MeshMismatch"] > 0
            assert crossover.network.rejections.counts["MeshMismatch"] > 0
        finally:
            third.close()
    finally:
        crossover.close()
        sumweight.close()
