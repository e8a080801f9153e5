"""One exception hierarchy, so callers can catch gossipd's failures and nothing else.

Plain Python: the simulator, the config and the certificate tool raise these
without loading grpc. Where an error meets the wire, the servicer answers with
the status code its table gives the class (``STATUS_CODES`` in
:mod:`gossipd.node.net.wire.statuscodes`) and this error's text, so the text a remote peer
sees is the same text a local caller sees.
"""

from __future__ import annotations


class GossipdError(Exception):
    """Root of every error gossipd raises on purpose."""


class ConfigError(GossipdError):
    """A config file or flag is wrong; the message names the key and the fix."""


class InvalidFrame(GossipdError):
    """Bytes on the wire that do not follow the schema or disagree with their header."""


class PayloadTooLarge(GossipdError):
    """A payload over the configured size limits."""


class WeightOverCap(InvalidFrame):
    """A push whose merge would lift a sum-weight over limits.max_sum_weight (or, unset, the
    number of founding members): an inflated weight, refused before it spreads."""


class OverCredit(InvalidFrame):
    """A push bringing more sum-weight than its sender took from this node plus
    limits.peer_credit: weight made up, or taken from others, refused before it spreads."""


class NonFinitePayload(GossipdError):
    """A payload carrying NaN or infinity, which would poison every model it reaches."""


class MeshMismatch(GossipdError):
    """A peer from another mesh, or with another model fingerprint."""


class UnknownPeer(GossipdError):
    """A sender this node has never been introduced to."""


class Busy(GossipdError):
    """The receiver cannot take the payload now (inbox full or trainer stopped); retry later."""


class PeerUnreachable(GossipdError):
    """No answer from a peer in time: the only failure that counts against its liveness."""


class BulkClosed(PeerUnreachable):
    """A bulk-lane connection that closed, stalled or was never there, mid-push or mid-pull:
    nothing of that push was merged, so its sender retries it (a new connection)."""


class CheckpointError(GossipdError):
    """A checkpoint that cannot be written or does not match the model."""


class JobError(GossipdError):
    """A training job that cannot be found or built."""


class ForgedLeave(GossipdError):
    """A Leave for a node that, asked directly, is still there and not leaving."""


class Leaving(GossipdError):
    """This node is leaving the mesh: it takes no new peers and no new pushes."""


class StreamIdle(GossipdError):
    """An inbound stream that sent nothing, or a pull that read nothing, for too long."""


class TooManyStreams(Busy):
    """One peer already holds its share of the inbound push streams (a peer's cap, not the
    node's): refused at once so it cannot take the slots the other peers need."""


class TooManyOpens(Busy):
    """A peer that opens push streams faster than ``limits.max_stream_opens_per_s`` allows
    (after a burst of ``limits.stream_open_burst``): its new streams are refused for a
    back-off that doubles while it goes on, so a member reopening refused streams in a loop
    costs itself a wait, not the mesh its CPU. ``hold_s``: how long the refusal waits
    before it is answered (the rest of the back-off, at most ``limits.open_backoff_s``)."""

    def __init__(self, message: str, hold_s: float) -> None:
        super().__init__(message)
        self.hold_s = hold_s


class PushTooSlow(StreamIdle):
    """An inbound push below the minimum rate: it would hold its slot for hours, a byte at a
    time, however short each silence is."""


class PullTooSlow(StreamIdle):
    """A pull we serve whose reader takes it slower than ``limits.min_pull_rate_bytes_s``:
    reading just inside the idle timeout, it would hold a slot and a whole snapshot of the
    model for as long as it likes."""


class PushTooLong(StreamIdle):
    """An inbound push still arriving at ``limits.max_push_s``: fast enough frame by frame,
    it would still hold its slot and reserved bytes for as long as its sender likes."""


class StaleReference(GossipdError):
    """A segment sent as a difference from a copy this node does not hold (forgotten, or a
    message in between was lost): nothing of it merged, and the sender sends it whole next."""


class PayloadOutOfBounds(GossipdError):
    """A finite payload too far from this node's own model to be an honest estimate of it
    (``limits.max_payload_distance``); refused whole, so the sender keeps its weight."""


class RelayRefused(GossipdError):
    """A relay request refused: ``reason`` is the metric label it is counted under
    (``gossipd_relay_refused_total``)."""

    reason = "refused"


class RelayAbsent(RelayRefused):
    """The site a Dial names is not attached to this relay (unknown, gone, or silent)."""

    reason = "absent"


class RelayLoop(RelayRefused):
    """A Dial that names the relay itself or the dialler: it would go round in a circle."""

    reason = "loop"


class RelayBusy(RelayRefused):
    """A relay's caps (attached sites, connections, connections per dialler) are full."""

    reason = "busy"


class RelayForged(RelayRefused):
    """A Take whose token this relay never gave to that site: a replay or a forgery."""

    reason = "forged"


class NotRelaying(RelayRefused):
    """This node relays for nobody (it cannot be dialled itself, or ``reach.relay`` is off),
    or an attaching site advertised a direct address."""

    reason = "not_relaying"
