"""The wire codecs and error feedback, below the network, the simulator and the trainer,
which all three use: ``raw``, ``fp16``, ``bf16``, ``int8`` and ``int4`` (:mod:`.codecs`), and
the copies a sender and a receiver keep to send differences (:mod:`.feedback`).

May import the errors and ``gossipd.proto`` (the wire enum of the codecs).
"""
