"""What the node and the coordinator both use: the config models, certificates and mutual TLS,
counted rejections, small state files. Loaded by either process on any thread.

May import only :mod:`gossipd.node.errors`, the protocol cores and this room; never the
trainer, the network, a site, a launcher or the coordinator.
"""
