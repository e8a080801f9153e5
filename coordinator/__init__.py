"""The optional coordinator: the mesh's registry and the scheduled-overlap scheduler's host.

Nodes that name it register, follow its view and ask it for pull times; when it is
gone they schedule alone (docs/coordinator.md). It imports only what node and
coordinator share (``gossipd.node.shared``, the protocol cores), never a node's rooms.
"""
