"""A leaving peer's last word: its Leave says which of the receiver's pushes it merged.

Both ends over real gRPC, with a daemon built through the library API and a fake site
(tests/fakepeer.py) on the other end:

- The sender's end. A push is taken in by a peer that never answers, the peer leaves
  and says it merged segment 0 of that push: the sender commits segment 0 and folds
  back segment 1, exactly. Before, the whole push folded back, and had the leaver really
  merged it (and handed its weight on), the mesh held that weight twice: seen once in
  CI, Σw 3.667 for 3 sites after a graceful leave in the operator's path.
- The leaver's end. A daemon merges a push from a peer, then leaves: its Leave to that
  peer names exactly the pushes it merged.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
import pytest
import torch

from gossipd.node.jobs.registry import JobSpec, build_job
from gossipd.node.model.segments import FlatModel
from gossipd.node.net.wire.lastwords import SEQUENCES_SAID, LastWord, from_messages, to_messages
from gossipd.node.protocols.base import Receipts
from gossipd.node.protocols.sequences import NUMBERINGS_KEPT
from gossipd.node.site.api import GossipNode
from gossipd.proto import gossip_pb2 as pb
from tests.fakepeer import MESH, FakePeer, leave_as

OPTIONS = {"numel": 600}  # two segments at SEGMENT_BYTES
SEGMENT_BYTES = 1024
TIMEOUT_S = 60.0


def _job() -> Any:
    return build_job(JobSpec("synthetic", seed=5, learning_rate=0.0, options=OPTIONS))


def _config(peer: FakePeer, **gossip: Any) -> dict[str, Any]:
    return {
        "mesh_id": MESH,
        "node_id": "user",
        "seeds": [peer.address],
        "gossip": {"segment_bytes": SEGMENT_BYTES, **gossip},
        "metrics": {"listen": None},
        "tls": {"insecure": True},
        "shutdown_timeout_s": 20.0,
    }


def _fingerprint() -> str:
    return FlatModel(_job().model, SEGMENT_BYTES).plan.fingerprint


def test_a_push_its_receiver_left_without_answering_settles_from_what_it_said_it_merged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="gossipd.node.net.gossip.outbound")
    with FakePeer("leaver", fingerprint=_fingerprint(), serve_peers=True, hang_pushes=True) as peer:
        job = _job()
        # A long progress timeout: the push stays taken in and unanswered until the leave.
        node = GossipNode(
            _config(peer, push_probability=1.0, progress_timeout_s=120.0, retry_max_s=0.5),
            job.model,
            job.optimizer,
        )
        try:
            assert node.wait_for_peers(1, TIMEOUT_S)
            deadline = time.monotonic() + TIMEOUT_S
            while not peer.push_opens:
                assert time.monotonic() < deadline, "no push reached the peer"
                node.step()
                time.sleep(0.01)
            opened = peer.push_opens[0]
            core = node.replica.core
            [push] = core.in_flight.values()
            assert set(push.weights) == {0, 1} and push.sequence == opened.sequence
            # The peer is gone (its address answers no more), and its Leave says it merged
            # segment 0 of that push and nothing else.
            peer.stop_serving()
            receipts = pb.Receipts(
                sender_incarnation=opened.incarnation,
                base=opened.sequence_base,
                forgotten_up_to=-1,
                sequences=[opened.sequence],
                segments=[0],
            )
            code = leave_as(node.address, "leaver", peer.incarnation, merged=[receipts])
            assert code == grpc.StatusCode.OK
            while core.in_flight:
                assert time.monotonic() < deadline, "the push to the leaver never settled"
                node.step()
                time.sleep(0.01)
        finally:
            node.close()
        # Segment 0 went with the leaver; segment 1 came home whole.
        assert core.weights[0] == pytest.approx(1.0 - push.weights[0], abs=1e-12)
        assert core.weights[1] == pytest.approx(1.0, abs=1e-12)
        assert core.reserved == [0.0, 0.0]
        said = [r.getMessage() for r in caplog.records if "said it merged" in r.getMessage()]
        assert said and "segments [0] merged (committed), [1] not (folded back)" in said[0]


def test_a_leaving_daemon_tells_each_peer_exactly_which_of_its_pushes_it_merged() -> None:
    fingerprint = _fingerprint()
    with FakePeer(
        "sender", fingerprint=fingerprint, serve_peers=True, take_leaves=True, take_pushes=True
    ) as peer:
        job = _job()
        node = GossipNode(_config(peer, push_probability=0.0), job.model, job.optimizer)
        pushed: list[Any] = []
        try:
            assert node.wait_for_peers(1, TIMEOUT_S)
            plan = node.replica.flat.plan
            for sequence, segment in ((1, 0), (2, 1), (3, 0)):
                done = threading.Event()

                def push(
                    sequence: int = sequence, segment: int = segment, done: Any = done
                ) -> None:
                    values = torch.zeros(plan.segments[segment].numel)
                    outcome = peer.push(
                        node.address, sequence=sequence, weight=0.1, values=values, segment=segment
                    )
                    pushed.append(outcome)
                    done.set()

                threading.Thread(target=push, daemon=True).start()
                deadline = time.monotonic() + TIMEOUT_S
                while not done.is_set():  # the push merges at one of this node's steps
                    assert time.monotonic() < deadline, "the push was never answered"
                    node.step()
                    time.sleep(0.01)
        finally:
            node.close()
        assert [p.code for p in pushed] == [grpc.StatusCode.OK] * 3, pushed
        [leave] = peer.leaves
        assert leave.node_id == "user"
        [receipts] = leave.merged
        assert receipts.sender_incarnation == peer.incarnation and receipts.base == 1
        pairs = sorted(zip(receipts.sequences, receipts.segments, strict=True))
        assert pairs == [(1, 0), (2, 1), (3, 0)]
        assert receipts.forgotten_up_to == -1


def test_a_leave_names_the_newest_sequences_and_a_word_past_its_bounds_is_ignored() -> None:
    """A Leave says each numbering's newest SEQUENCES_SAID sequences (the ones a sender can
    still hold unsettled), older ones as forgotten; a word naming more, or a segment the
    model lacks, is ignored whole."""
    pairs = frozenset((q, q % 2) for q in range(1, 201))
    [message] = to_messages([Receipts(7, 1, -1, pairs)])
    assert message.forgotten_up_to == 200 - SEQUENCES_SAID
    assert list(message.sequences) == list(range(201 - SEQUENCES_SAID, 201))
    [back] = from_messages([message], segments=2) or []
    word = LastWord(1, (back,))
    assert word.merged(7, 1, 200, [0, 1]) == [0]  # 200 carried segment 0 alone
    assert word.merged(7, 1, 100, [0]) is None  # said forgotten: settles as before
    assert from_messages([message], segments=1) is None  # segment 1 is not in this model
    flood = pb.Receipts(sender_incarnation=7, base=1, forgotten_up_to=-1)
    flood.sequences.extend(range(1, 2 + NUMBERINGS_KEPT * SEQUENCES_SAID * 2))
    flood.segments.extend([0] * len(flood.sequences))
    assert from_messages([flood], segments=2) is None
    uneven = pb.Receipts(sender_incarnation=7, base=1, sequences=[1, 2], segments=[0])
    assert from_messages([uneven], segments=2) is None
