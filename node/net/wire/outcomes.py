"""What a call to a peer ended with, as one of our errors: refused, or outcome unknown.

One call is one attempt. Its outcome is either known (acknowledged, or refused
by the receiver before it merged anything) or unknown (the connection broke, a
deadline passed, or nothing moved for ``progress_timeout_s``): an unknown
outcome raises :class:`OutcomeUnknown`, and the caller retries with the same
sequence instead of guessing.
"""

from __future__ import annotations

import asyncio

import grpc

from gossipd.node.errors import (
    Busy,
    GossipdError,
    InvalidFrame,
    MeshMismatch,
    PeerUnreachable,
    StaleReference,
    UnknownPeer,
)
from gossipd.node.shared.tls import NotAllowed
from gossipd.node.trainer.messages import Ack

# Statuses after which the receiver may or may not have merged the push. Every
# other status is an answer from the receiver's servicer, which refuses before it
# merges anything.
_UNKNOWN_OUTCOME = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
}
# What grpc says of a call it failed before any connection to the peer existed (the
# channel was in TRANSIENT_FAILURE: connection refused, no route): the push was never
# sent, so its outcome is known. A call cut on a live connection says otherwise.
_NEVER_CONNECTED = "failed to connect to all addresses"
_ERRORS: dict[grpc.StatusCode, type[GossipdError]] = {
    grpc.StatusCode.FAILED_PRECONDITION: MeshMismatch,
    grpc.StatusCode.UNAUTHENTICATED: UnknownPeer,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidFrame,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Busy,
    grpc.StatusCode.UNAVAILABLE: PeerUnreachable,
    grpc.StatusCode.DEADLINE_EXCEEDED: PeerUnreachable,
    grpc.StatusCode.CANCELLED: PeerUnreachable,
    grpc.StatusCode.PERMISSION_DENIED: NotAllowed,
    grpc.StatusCode.ABORTED: StaleReference,
}


class OutcomeUnknown(PeerUnreachable):
    """The push may or may not have been merged: retry it with the same sequence."""


class PartialPush(GossipdError):
    """Some streams of a push were acknowledged, others failed."""

    def __init__(self, acks: list[Ack], errors: list[GossipdError]) -> None:
        super().__init__(
            f"{len(acks)} segments acknowledged, {len(errors)} streams failed: "
            + "; ".join(str(e) for e in errors)
        )
        self.acks = acks
        self.errors = errors


def remote_error(err: grpc.aio.AioRpcError, peer: str) -> GossipdError:
    """The peer's status as one of our errors, keeping its text."""
    cls = _ERRORS.get(err.code(), GossipdError)
    return cls(f"{peer}: {err.code().name}: {err.details()}")


def stream_failure(err: BaseException, peer: str) -> GossipdError:
    """One push stream's failure as what it tells us: unknown, or refused."""
    if isinstance(err, grpc.aio.AioRpcError):
        details = err.details() or ""
        if err.code() == grpc.StatusCode.UNAVAILABLE and _NEVER_CONNECTED in details:
            # grpc started the call on no connection: not a byte of it left here.
            return PeerUnreachable(f"{peer}: nothing was sent: {details}")
        if err.code() in _UNKNOWN_OUTCOME:
            return OutcomeUnknown(f"{peer}: {err.code().name}: {details}")
        return remote_error(err, peer)
    if isinstance(err, GossipdError):
        return err
    if isinstance(err, asyncio.CancelledError):
        # grpc.aio ends a call whose channel was closed under it (a certificate
        # reload, a forgotten peer) this way: the receiver may have merged it.
        return OutcomeUnknown(f"{peer}: the channel was closed mid-push")
    raise err
