"""What an operator asks: the ``Status`` reply a node gives, ``gossipd status`` and
``status --mesh`` on the asking side, and what a restart cost the mesh.

May import every room of ``net`` but the network's own assembly (:mod:`..network`).
"""
