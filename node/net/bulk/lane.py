"""The bulk lane: segment payloads as raw bytes on a plain TCP (or TLS) socket beside gRPC.

grpc.aio moves a megabyte chunk through several copies and Python objects on the
event loop's one thread; on a 2-core machine a bare grpc.aio stream tops out near
half of what a TCP socket moves, and gossip's own work comes on top. The lane
takes the bytes off that path: the push (or pull) itself still runs on gRPC,
with every frame, check, refusal and reply as before, but a header marked
``bulk`` says that its payload follows on the sender's lane connection instead
of in chunk frames. The receiver reads exactly ``payload_bytes`` from that
socket straight into the segment's buffer (``recv_into``, in a worker thread
that releases the GIL), then checks it as it checks chunks.

A connection starts with TLS 1.3 and the site certificates the gRPC port uses
(the peer's node id is its certificate's, and ``tls.allow`` applies), then a
hello: ``GDB1`` and a 16-byte token the dialer chose. Over TLS a dialer whose peer
advertises ``HandshakeReply.bulk_sealed`` says ``GDB2`` instead, with a key seed; the
server answers with its own seed, and from there the connection carries sealed
records on the bare socket (:mod:`gossipd.node.net.bulk.sealing`: the same certificates and
secrecy, at a fraction of Python ``ssl``'s CPU). A push names the token in
``PushOpen.bulk_token``; the connection must belong to the push's sender and
carries one push at a time, its payloads in header order. Anything that goes
wrong mid-push (a refusal, a stall, a cut) closes the connection, since bytes
may be left unread on it; a clean push leaves it for the next one.

Every connection counts against ``limits.max_inbound_pushes_per_peer`` and
``limits.max_inbound_pushes`` (as ``Exchange`` streams do, separately), a
handshake or hello must finish within ``limits.stream_idle_timeout_s``, and a
connection idle that long, or closed by its peer, is closed here.

The lane's parts: :mod:`~gossipd.node.net.bulk.connection` (a connection, its hello, payloads
written in order), :mod:`~gossipd.node.net.bulk.listener` (the listener and the connections
it admitted) and :mod:`~gossipd.node.net.bulk.dialer` (a client's connections to a peer's
lane). Their public names are importable from here too.
"""

from gossipd.node.net.bulk.connection import (
    MAGIC,
    MAGIC_SEALED,
    TOKEN_BYTES,
    BulkConn,
    InOrder,
    leave_tls,
)
from gossipd.node.net.bulk.dialer import BulkDialer
from gossipd.node.net.bulk.listener import BulkServer

__all__ = [
    "MAGIC",
    "MAGIC_SEALED",
    "TOKEN_BYTES",
    "BulkConn",
    "BulkDialer",
    "BulkServer",
    "InOrder",
    "leave_tls",
]
