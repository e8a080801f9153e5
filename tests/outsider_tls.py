"""The outsider of :mod:`tests.outsider` over mutual TLS.

``tls`` is anything with the ``channel(address, options, expected)`` of
:class:`gossipd.node.shared.tls.Credentials`: a site's Credentials (a valid certificate of
the mesh), ``Credentials(insecure=True)`` (plaintext), or a test's own object that
presents files Credentials would refuse to load (expired, another CA's). Each call
opens its own channel and returns (status code, reply or None, error details).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc

from gossipd.node.shared.tls import Credentials
from gossipd.proto import gossip_pb2 as pb
from tests.outsider import (
    MESH,
    PushOutcome,
    handshake_request,
    push_frames,
    push_on,
    unary_call,
)


def call_tls(
    tls: Any,
    address: str,
    method: str,
    request: Any,
    reply_type: Any,
    *,
    expected: str | None = None,
    timeout_s: float = 10.0,
) -> tuple[grpc.StatusCode, Any, str]:
    """One unary RPC ``method`` over a channel from ``tls`` (server checked as ``expected``)."""

    async def call() -> tuple[grpc.StatusCode, Any, str]:
        async with tls.channel(address, [], expected) as channel:
            return await unary_call(channel, method, request, reply_type, timeout_s)

    return asyncio.run(call())


def handshake_tls(
    tls: Any,
    address: str,
    info: pb.NodeInfo,
    *,
    fingerprint: str | None = None,
    mesh_id: str = MESH,
    timeout_s: float = 10.0,
) -> tuple[grpc.StatusCode, pb.HandshakeReply | None, str]:
    """One Handshake claiming ``info``, presenting ``tls``'s certificate."""
    request = handshake_request(info, fingerprint, mesh_id)
    return call_tls(tls, address, "Handshake", request, pb.HandshakeReply, timeout_s=timeout_s)


def sync_channel(tls: Credentials, address: str) -> grpc.Channel:
    """A channel of grpc's sync API presenting ``tls``'s certificate (any site of the mesh
    may answer), or plaintext for insecure credentials: :func:`tests.outsider.push_on`
    needs one."""
    if tls.insecure:
        return grpc.insecure_channel(address)
    credentials, checked = tls.client()
    return grpc.secure_channel(address, credentials, options=[checked])


def push_tls(
    tls: Credentials, address: str, *, timeout_s: float = 20.0, **frame_fields: Any
) -> PushOutcome:
    """One push built by :func:`push_frames` from ``frame_fields``, presenting ``tls``."""
    with sync_channel(tls, address) as channel:
        return push_on(channel, push_frames(**frame_fields), timeout_s)


def leave_tls(
    tls: Any,
    address: str,
    node_id: str,
    incarnation: int,
    *,
    mesh_id: str = MESH,
    timeout_s: float = 20.0,
) -> tuple[grpc.StatusCode, str]:
    """One Leave claiming that ``node_id`` is leaving, presenting ``tls``; code and details."""
    request = pb.LeaveRequest(mesh_id=mesh_id, node_id=node_id, incarnation=incarnation)
    code, _, details = call_tls(tls, address, "Leave", request, pb.LeaveReply, timeout_s=timeout_s)
    return code, details


def peers_tls(
    tls: Any,
    address: str,
    sender: pb.NodeInfo,
    known: Sequence[pb.NodeInfo],
    *,
    mesh_id: str = MESH,
    timeout_s: float = 20.0,
) -> tuple[grpc.StatusCode, list[pb.NodeInfo], str]:
    """One Peers request from ``sender`` listing ``known``, presenting ``tls``."""
    request = pb.PeersRequest(mesh_id=mesh_id, sender=sender, known=list(known))
    code, reply, details = call_tls(
        tls, address, "Peers", request, pb.PeersReply, timeout_s=timeout_s
    )
    return code, list(reply.peers) if reply is not None else [], details


def status_tls(
    tls: Any, address: str, *, timeout_s: float = 10.0
) -> tuple[grpc.StatusCode, pb.StatusReply | None, str]:
    """One Status, presenting ``tls``'s certificate (or none, for a plaintext one)."""
    request = pb.StatusRequest()
    return call_tls(tls, address, "Status", request, pb.StatusReply, timeout_s=timeout_s)
