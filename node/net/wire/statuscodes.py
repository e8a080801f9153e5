"""The one place a gossipd error becomes a gRPC status: each error is answered with its
code and the same text the local log gets."""

from __future__ import annotations

import grpc

from gossipd.node import errors
from gossipd.node.errors import GossipdError
from gossipd.node.shared.certs import CertificateError
from gossipd.node.shared.tls import IdentityMismatch, NotAllowed

# The one place a gossipd error becomes a gRPC status: the nearest class in an
# error's MRO that is listed here gives its code (GossipdError itself: INTERNAL).
STATUS_CODES: dict[type[GossipdError], grpc.StatusCode] = {
    GossipdError: grpc.StatusCode.INTERNAL,
    errors.ConfigError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.InvalidFrame: grpc.StatusCode.INVALID_ARGUMENT,
    errors.WeightOverCap: grpc.StatusCode.INVALID_ARGUMENT,
    errors.OverCredit: grpc.StatusCode.INVALID_ARGUMENT,
    errors.PayloadTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.NonFinitePayload: grpc.StatusCode.INVALID_ARGUMENT,
    errors.MeshMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    errors.UnknownPeer: grpc.StatusCode.UNAUTHENTICATED,
    errors.Busy: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.PeerUnreachable: grpc.StatusCode.UNAVAILABLE,
    errors.BulkClosed: grpc.StatusCode.UNAVAILABLE,
    errors.CheckpointError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.JobError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.ForgedLeave: grpc.StatusCode.PERMISSION_DENIED,
    errors.Leaving: grpc.StatusCode.FAILED_PRECONDITION,
    errors.StreamIdle: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.TooManyStreams: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.TooManyOpens: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.PushTooSlow: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.PushTooLong: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.PullTooSlow: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.PayloadOutOfBounds: grpc.StatusCode.INVALID_ARGUMENT,
    errors.RelayRefused: grpc.StatusCode.FAILED_PRECONDITION,
    errors.RelayAbsent: grpc.StatusCode.UNAVAILABLE,
    errors.RelayLoop: grpc.StatusCode.INVALID_ARGUMENT,
    errors.RelayBusy: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.RelayForged: grpc.StatusCode.PERMISSION_DENIED,
    errors.NotRelaying: grpc.StatusCode.FAILED_PRECONDITION,
    errors.StaleReference: grpc.StatusCode.ABORTED,
    IdentityMismatch: grpc.StatusCode.PERMISSION_DENIED,
    NotAllowed: grpc.StatusCode.PERMISSION_DENIED,
    CertificateError: grpc.StatusCode.UNAUTHENTICATED,
}


def status_code(err: GossipdError) -> grpc.StatusCode:
    """The status a servicer answers ``err`` with (see ``STATUS_CODES``)."""
    for cls in type(err).__mro__:
        if cls in STATUS_CODES:
            return STATUS_CODES[cls]
    return grpc.StatusCode.INTERNAL
