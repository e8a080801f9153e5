"""What crosses a socket, both directions: segments to frames (:mod:`.frames`) and back
(:mod:`.assembly`), parsing a request before a servicer sees it, the service's typed
client calls (:mod:`.calls`), the error-to-status-code table, gRPC's channel and server
options, who a request names, link shaping, a call's outcome, a leaver's receipts, and
the loop's task set every part starts its work in.

May import the errors, :mod:`gossipd.node.compression`, :mod:`gossipd.node.model`, the
trainer's typed messages, ``gossipd.proto`` and :mod:`.limits`.
"""
