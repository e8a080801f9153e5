"""The gossip itself on the loop: outbound pushes delivered and settled exactly once, a
node's leaving (hand-off and receipts), inbound pushes handed to the trainer's inbox,
pulls started on time, and the replica's port to all of it.

The meeting point with the trainer: only its typed messages
(:mod:`gossipd.node.trainer.messages`). May import :mod:`..peers`, :mod:`..dial`,
:mod:`..limits`, :mod:`..telemetry` and :mod:`..wire` of ``net``.
"""
