"""Baselines that share gossipd's harness but not its gossip: synchronous all-reduce (torch
DDP across sites), run as a site process of its own.

May import the errors, :mod:`gossipd.node.shared` and the trainer room; never the network,
a gossip site, a launcher or the CLI.
"""
