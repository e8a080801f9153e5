"""The Gossip service's unary calls as a client makes them, with their message types.

The stub grpcio-tools generates (``gossip_pb2_grpc.GossipStub``) carries no type
information, so each call's request and reply would be ``Any`` wherever it is used;
:func:`gossip_calls` hands it out as :class:`GossipCalls` instead.
"""

from __future__ import annotations

from typing import Protocol

import grpc

from gossipd.proto import gossip_pb2 as pb
from gossipd.proto import gossip_pb2_grpc as pb_grpc


class GossipCalls(Protocol):
    """The unary calls of ``gossipd.v1.Gossip`` on one channel, and the relay's streams."""

    Handshake: grpc.aio.UnaryUnaryMultiCallable[pb.HandshakeRequest, pb.HandshakeReply]
    Leave: grpc.aio.UnaryUnaryMultiCallable[pb.LeaveRequest, pb.LeaveReply]
    Peers: grpc.aio.UnaryUnaryMultiCallable[pb.PeersRequest, pb.PeersReply]
    Status: grpc.aio.UnaryUnaryMultiCallable[pb.StatusRequest, pb.StatusReply]
    CheckReach: grpc.aio.UnaryUnaryMultiCallable[pb.ReachRequest, pb.ReachReply]
    Attach: grpc.aio.StreamStreamMultiCallable[pb.AttachFrame, pb.RelayOrder]
    Dial: grpc.aio.StreamStreamMultiCallable[pb.RelayFrame, pb.RelayFrame]
    Take: grpc.aio.StreamStreamMultiCallable[pb.RelayFrame, pb.RelayFrame]


def gossip_calls(channel: grpc.aio.Channel) -> GossipCalls:
    """The generated stub on ``channel``, typed by what each of its calls sends and gets."""
    stub: GossipCalls = pb_grpc.GossipStub(channel)  # type: ignore[no-untyped-call]  # generated untyped
    return stub
