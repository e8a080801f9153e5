"""Who a node is on the wire: what its requests name it by."""

from __future__ import annotations

from dataclasses import dataclass

from gossipd.proto import gossip_pb2 as pb


@dataclass(frozen=True)
class Identity:
    """Who we are on the wire."""

    mesh_id: str
    node_id: str
    address: str
    incarnation: int
    fingerprint: str
    protocol: str

    def info(self) -> pb.NodeInfo:
        return pb.NodeInfo(node_id=self.node_id, address=self.address, incarnation=self.incarnation)
