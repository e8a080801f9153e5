"""The parameter side of a site, run by its trainer thread: segments and codecs, the
replica that drives the protocol core, merges, checkpoints, jobs, the ranks of a site.

May import the errors, the protocol cores, :mod:`gossipd.node.shared` and this room; never
the network (the event loop reaches the replica through typed messages,
:mod:`gossipd.node.trainer.messages`), a site, a launcher or the coordinator.
"""
