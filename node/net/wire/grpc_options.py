"""The gRPC channel and server options every connection of a node uses.

A module of its own so that what only talks to a node (``gossipd status``, ``health``,
``status --mesh``) gets them without the transport, which loads torch: a health check a
container runs every few seconds took 3.6 s of CPU, 2 s of it importing torch.
"""

from __future__ import annotations

MAX_MESSAGE_BYTES = 16 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.bdp_probe", 1),
    # Keepalives on idle connections too, every 15 s: below the idle timeouts of common NATs
    # and firewalls (30 s and up), so a connection a site behind one dialled stays mapped;
    # the server side accepts pings that often (docs/nat.md).
    ("grpc.keepalive_time_ms", 15_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    # A peer that was down at first contact must be reachable soon after it starts:
    # grpc's default reconnect backoff (1 s, growing to 120 s) fails RPCs fast meanwhile.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
# A channel that shares no connection with the node's others: grpc pools connections by
# target and options, so a new channel to an address another channel failed to reach
# (a site killed and restarted there) fails at once with that connection's last error
# until its backoff ends. A reach check's dial-back must try the address now: through
# the pool, a restarted site was told "connection refused" and went outbound-only.
FRESH_CHANNEL_OPTIONS = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
# A channel to a site behind a relay (a loopback port of Routes joined to a Dial stream):
# - its own connection (no subchannel shared with the other channels to that port), so
#   a channel retired because its relay is leaving takes its connection with it;
# - 5 s to set the connection up, since grpc also takes the least reconnect backoff as its
#   connect timeout and a relayed TLS handshake crosses the relay's streams several times
#   (at 100 ms such a connection failed until the backoff had grown, for 10-40 s).
RELAYED_CHANNEL_OPTIONS = [
    *(o for o in FRESH_CHANNEL_OPTIONS if o[0] != "grpc.min_reconnect_backoff_ms"),
    ("grpc.min_reconnect_backoff_ms", 5_000),
]
