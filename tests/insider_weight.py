"""An insider for tests of weight: a member of the mesh (``tests/insider.py``) that sinks
weight and inflates it.

As a **sink** it acknowledges every segment of every push as merged and never pushes
back, which is what drained a 3-site mesh to Σw 8e-14 (issue 12). It counts, per
sender, how many pushes it took and how much sum-weight they carried. As an
**inflater** it pushes made-up weight to a daemon (:meth:`Member.push`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from gossipd.node.shared.tls import Credentials
from gossipd.proto import gossip_pb2 as pb
from tests.insider import Member


class WeightInsider(Member):
    """A member that takes every push it is sent (a sink) and can push any weight."""

    def __init__(self, node_id: str, tls: Credentials, *, incarnation: int = 1) -> None:
        self.pushes_taken: Counter[str] = Counter()  # pushes acknowledged, by sender
        self.weight_taken: Counter[str] = Counter()  # Σ sum-weight they carried, by sender
        super().__init__(node_id, tls, incarnation=incarnation)

    async def on_push(self, request_iterator: Any, context: Any) -> pb.PushReply:
        sender, acks = "", []
        async for frame in request_iterator:
            kind = frame.WhichOneof("kind")
            if kind == "open":
                sender = frame.open.sender
            elif kind == "header":
                acks.append(
                    pb.SegmentAck(
                        segment=frame.header.segment,
                        result=pb.SEGMENT_RESULT_MERGED,
                        receiver_weight=1.0,
                    )
                )
                self.weight_taken[sender] += frame.header.sum_weight
        self.pushes_taken[sender] += 1
        return pb.PushReply(acks=acks)
