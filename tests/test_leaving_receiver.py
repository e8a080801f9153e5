"""A leaving receiver merges nothing new but still answers DUPLICATE for what it merged.

The case: a sender's push was merged, its acknowledgement was lost, and the
receiver starts leaving before the sender's retry arrives. Refusing the retry
would make the sender fold the weight back while the receiver hands the same
weight on (mass created). Answering DUPLICATE lets the sender commit; leaving a
never-merged push unacknowledged lets it fold back, exactly, because the leaving
receiver will not merge it later either.
"""

from __future__ import annotations

import random

import torch

from gossipd.node.jobs.registry import JobSpec, build_job
from gossipd.node.net.wire.frames import ReceivedSegment
from gossipd.node.protocols.base import PushSettled, Settle
from gossipd.node.protocols.credit import DEFAULT_CREDIT
from gossipd.node.protocols.sumweight import SumWeightGossip
from gossipd.node.trainer.messages import (
    AskPeer,
    InboundPush,
    OutboundPull,
    OutboundPush,
    PushOutcome,
    ReportTransfer,
    ViewNotice,
)
from gossipd.node.trainer.replica import Replica


def _replica() -> Replica:
    job = build_job(JobSpec("synthetic", seed=3, learning_rate=0.0))
    return Replica(
        "r", job.model, segment_bytes=4 << 20, settings={"options": {"push_probability": 0.0}}
    )


def _deliver(replica: Replica, sequence: int, weight: float, *, merge_new: bool) -> list:
    values = torch.full((replica.flat.plan.segments[0].numel,), 7.0)
    item = InboundPush("s", 1, sequence, [ReceivedSegment(0, weight, values)], merge_new=merge_new)
    replica.inbox.put(item)
    replica.idle(0)
    return item.reply.result(timeout=5.0)


def test_a_retry_reaching_a_leaving_receiver_is_acknowledged_duplicate_and_changes_nothing():
    replica = _replica()
    [ack] = _deliver(replica, 1, 0.5, merge_new=True)
    assert not ack.duplicate
    merged = replica.flat.buffers[0].clone()
    assert replica.summary.weights == (1.5,)

    [retry] = _deliver(replica, 1, 0.5, merge_new=False)
    assert retry.duplicate
    assert torch.equal(replica.flat.buffers[0], merged)
    assert replica.summary.weights == (1.5,)


def test_a_new_push_reaching_a_leaving_receiver_is_left_unacknowledged_and_unmerged():
    replica = _replica()
    before = replica.flat.buffers[0].clone()
    assert _deliver(replica, 1, 0.5, merge_new=False) == []
    assert torch.equal(replica.flat.buffers[0], before)
    assert replica.summary.weights == (1.0,)
    # Nothing was admitted either: once the node stays, the same push still merges.
    [ack] = _deliver(replica, 1, 0.5, merge_new=True)
    assert not ack.duplicate


def test_sender_and_leaving_receiver_keep_the_total_exact_through_a_lost_ack():
    """Both answers settle the sender exactly: Σw stays 2 with the ack lost in between."""
    sender = SumWeightGossip("s", 1, push_probability=1.0, rng=random.Random(0))
    sender.on_peer_up("r")
    replica = _replica()
    [push] = sender.on_step_end()
    _deliver(replica, push.sequence, push.weights[0], merge_new=True)  # the ack is lost
    acks = _deliver(replica, push.sequence, push.weights[0], merge_new=False)  # the retry
    sender.handle(PushSettled("r", push.sequence, tuple(a.segment for a in acks)))
    assert sender.weights[0] + replica.summary.weights[0] == 2.0

    [second] = sender.on_step_end()
    acks = _deliver(replica, second.sequence, second.weights[0], merge_new=False)
    assert acks == []
    folds = sender.handle(PushSettled("r", second.sequence, ()))
    assert [f.segment for f in folds] == [0]
    assert sender.weights[0] + replica.summary.weights[0] == 2.0


def test_a_barrier_resolves_with_the_summary_of_every_event_before_it():
    """A site stopped 64 ms after a peer became live wrote its checkpoint with all its
    weight: the leave waited on a barrier, then read peers from a summary refreshed only
    at the end of the trainer's idle round, which did not list the new peer yet."""
    replica = _replica()
    replica.post(ViewNotice(frozenset({"r", "newcomer"})))
    seen: list[frozenset[str]] = []
    replica.barrier().add_done_callback(lambda _: seen.append(replica.summary.peers))
    replica.idle(0)
    assert seen == [frozenset({"newcomer"})]


def test_a_merge_is_in_the_published_summary_before_it_is_acknowledged():
    """A sender that commits on the acknowledgement and then reads the receiver's status
    saw the receiver's previous summary (Σw 1.75 for 2 in test_library_api under load)."""
    replica = _replica()
    values = torch.full((replica.flat.plan.segments[0].numel,), 7.0)
    item = InboundPush("s", 1, 1, [ReceivedSegment(0, 0.5, values)])
    seen: list[tuple[float, ...]] = []
    item.reply.add_done_callback(lambda _: seen.append(replica.summary.weights))
    replica.inbox.put(item)
    replica.idle(0)
    assert seen == [(1.5,)]


class HeldPort:
    """A network that has not yet carried out what it was handed (as a push that a timer
    made while the node leaves waits on the loop for its fold-back)."""

    def __init__(self) -> None:
        self.pushes: list[OutboundPush] = []

    def send_push(self, out: OutboundPush) -> None:
        self.pushes.append(out)

    def send_settle(self, settle: Settle) -> None:
        """Settles carry no weight: what this test follows is the weight."""

    def start_pull(self, out: OutboundPull) -> None:
        raise AssertionError("sum-weight gossip does not pull")

    def wake_at(self, at_s: float) -> None:
        pass

    def hurry_pull(self, out: OutboundPull) -> None:
        raise AssertionError("sum-weight gossip does not pull")

    def ask_peer(self, ask: AskPeer) -> None:
        raise AssertionError("no coordinator here")

    def report_transfer(self, report: ReportTransfer) -> None:
        raise AssertionError("no coordinator here")


def test_a_barrier_counts_pushes_outstanding_so_a_leave_hands_off_only_after_fold_backs():
    """A site told to leave over MQTT kept 0.92 of its 1.85 in its final checkpoint: a push
    made just before the hand-off reserved half, the hand-off carried the other half, and the
    fold-back landed after it. The leave now waits for a barrier that counts 0 outstanding."""
    job = build_job(JobSpec("synthetic", seed=3, learning_rate=0.0))
    replica = Replica(
        "s", job.model, segment_bytes=4 << 20, settings={"options": {"push_probability": 1.0}}
    )
    port = HeldPort()
    replica.attach(port)
    replica.post(ViewNotice(frozenset({"s", "r"})))
    replica.step()
    [push] = port.pushes
    # Half, cut to the credit a peer may hold of this node's weight, reserved until its
    # outcome lands.
    assert push.push.weights == {0: DEFAULT_CREDIT}

    counted = replica.barrier()
    replica.idle(0)
    assert counted.result(timeout=5.0) == 1
    replica.post(PushOutcome(push, (), "the node is leaving before sending it"))
    counted = replica.barrier()
    replica.idle(0)
    assert counted.result(timeout=5.0) == 0

    handed = replica.request_hand_off("r")
    replica.idle(0)
    assert handed.result(timeout=5.0).push.weights == {0: 1.0}


def test_a_push_accepted_before_the_leave_merges_before_the_hand_off_not_after():
    """A site told to leave over MQTT kept 0.77 in its final checkpoint (CI): a peer's push,
    accepted just before the leave, still waited in the inbox when the hand-off request was
    applied (events apply before merges), and merged after all weight had left."""
    replica = _replica()
    replica.post(ViewNotice(frozenset({"r", "s"})))
    replica.idle(0)
    values = torch.full((replica.flat.plan.segments[0].numel,), 7.0)
    accepted = InboundPush("s", 1, 1, [ReceivedSegment(0, 0.75, values)])
    replica.inbox.put(accepted)
    handed = replica.request_hand_off("s")
    replica.idle(0)
    assert [a.segment for a in accepted.reply.result(timeout=5.0)] == [0]
    assert handed.result(timeout=5.0).push.weights == {0: 1.75}  # all of it, merge included
