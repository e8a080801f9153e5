"""The network side of a site, run by its asyncio event loop: the gRPC server and clients,
the bulk lane, membership, pushes and pulls in flight, MQTT discovery, metrics.

May import the errors, the protocol cores, :mod:`gossipd.node.shared`, the trainer room's
types and messages, and this room; never a site, a launcher, the CLI or the coordinator.
"""
