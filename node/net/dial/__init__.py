"""The client side of the wire: one channel per verified peer, a push attempt's frames over
a peer's long-lived streams, a pull's reading, handshakes, leaves and peer lists.

One call is one attempt; what to do with its outcome is :mod:`..gossip`'s. May import
:mod:`..wire`, :mod:`..bulk` and :mod:`..telemetry` of ``net``.
"""
