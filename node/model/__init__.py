"""The model as both sides of a site see it: the segment plan and its flat buffers, the
model fingerprint, the payload bound on a segment's distance, the checksum sketch, the
outer optimizer of DiLoCo, and the worker threads byte work runs on.

Shared by :mod:`gossipd.node.net`, :mod:`gossipd.node.trainer`, :mod:`gossipd.node.sim`
(its real-model payload, lazily) and the baselines. May import the errors and
:mod:`gossipd.node.shared`.
"""
