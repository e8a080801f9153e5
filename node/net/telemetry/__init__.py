"""What a node counts and logs: its Prometheus metrics (:mod:`.metrics`, their rows in
:mod:`.metric_table`), every refusal (counted, the first
of each kind logged and reported to the replica), and gRPC's C-core log lines routed
into the daemon's log.

May import the errors, :mod:`gossipd.node.shared` and the trainer's typed messages and
report; no other room of ``net``, so every room may count.
"""
