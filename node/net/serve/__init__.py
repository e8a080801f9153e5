"""The server side of the wire: the gRPC server, the thin servicer (validate, convert, hand
off), the ``Exchange`` stream, and a push or pull being received or served frame by frame.

Hands off to :class:`.servicer.Handlers`, which the network implements; never decides
what merges. May import :mod:`..wire`, :mod:`..limits`, :mod:`..telemetry` and
:mod:`..bulk` of ``net``.
"""
