"""Admission and budgets: what inbound streams may hold (stream slots, pending payload
bytes, silence), how fast one peer may open streams, and gossip's share of the CPU.

Owns the caps an outsider pushes against; each has a counted rejection reason and a
config key. May import the errors, :mod:`gossipd.node.shared`, :mod:`gossipd.node.model`
and :mod:`gossipd.node.compression`; no other room of ``net``.
"""
