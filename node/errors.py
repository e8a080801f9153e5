"""One exception hierarchy, so callers can catch gossipd's failures and nothing else.

Each error carries the gRPC status code a servicer answers with, so the text a
remote peer sees is the same text a local caller sees.
"""

from __future__ import annotations

import grpc


class GossipdError(Exception):
    """Root of every error gossipd raises on purpose."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class ConfigError(GossipdError):
    """A config file or flag is wrong; the message names the key and the fix."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class InvalidFrame(GossipdError):
    """Bytes on the wire that do not follow the schema or disagree with their header."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class PayloadTooLarge(GossipdError):
    """A payload over the configured size limits."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class NonFinitePayload(GossipdError):
    """A payload carrying NaN or infinity, which would poison every model it reaches."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class MeshMismatch(GossipdError):
    """A peer from another mesh, or with another model fingerprint."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class UnknownPeer(GossipdError):
    """A sender this node has never been introduced to."""

    code = grpc.StatusCode.UNAUTHENTICATED


class Busy(GossipdError):
    """The receiver cannot take the payload now (inbox full or trainer stopped); retry later."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class PeerUnreachable(GossipdError):
    """No answer from a peer in time: the only failure that counts against its liveness."""

    code = grpc.StatusCode.UNAVAILABLE


class CheckpointError(GossipdError):
    """A checkpoint that cannot be written or does not match the model."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class JobError(GossipdError):
    """A training job that cannot be found or built."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class ForgedLeave(GossipdError):
    """A Leave for a node that, asked directly, is still there and not leaving."""

    code = grpc.StatusCode.PERMISSION_DENIED


class Leaving(GossipdError):
    """This node is leaving the mesh: it takes no new peers and no new pushes."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class StreamIdle(GossipdError):
    """An inbound stream that sent nothing, or a pull that read nothing, for too long."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
