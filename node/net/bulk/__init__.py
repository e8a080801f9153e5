"""The bulk lane: segment payloads as raw bytes on a TCP socket beside gRPC (:mod:`.lane`
says why), its connections and hello, the dialler, the listener, and the AES-GCM sealed
records over TLS.

May import the errors, :mod:`gossipd.node.shared`, :mod:`gossipd.node.model`, and of ``net``
only :mod:`..limits` and :mod:`..telemetry`.
"""
