"""Error feedback's memory (node/compression/feedback.py): the copies each end keeps.

Protects the last part of that module's contract (the rest is tests/test_feedback.py):
each end keeps copies for at most ``max_peers`` peers, least recently used dropped first,
counts their bytes once per copy, and forgetting a peer drops its copies and pending
messages only, so a sender's next message to it is whole and a receiver refuses the
evicted peer's differences.
"""

from __future__ import annotations

import random

import pytest
import torch

from gossipd.node.compression.codecs import Codec
from gossipd.node.compression.feedback import WHOLE, Copies, FeedbackReceiver, FeedbackSender
from gossipd.node.errors import StaleReference
from tests.tensors import F16, F32, F64, seeded_values
from tests.test_feedback import NUMEL, RECEIVER, SENDER, push, received

# Copies


@pytest.mark.parametrize("max_peers", [0, -1])
def test_copies_refuse_room_for_fewer_than_one_peer(max_peers: int) -> None:
    with pytest.raises(ValueError, match=f"max_peers must be at least 1, not {max_peers}"):
        Copies(max_peers)


def test_copies_put_get_hold_and_drop_one_segment_or_a_whole_peer() -> None:
    copies = Copies(4)
    one, two, three = torch.ones(3), torch.full((3,), 2.0), torch.full((3,), 3.0)
    assert copies.get("a", 0) is None
    copies.put("a", 0, 11, one)
    copies.put("a", 1, 12, two)
    copies.put("b", 0, 21, three)
    assert copies.peers == 2
    assert copies.get("a", 0) == (11, one)
    assert copies.get("a", 1) == (12, two)
    assert copies.get("a", 2) is None
    assert copies.holds("a", 0, 11)
    assert not copies.holds("a", 0, 12)  # another version
    assert not copies.holds("a", 2, 11)  # another segment
    assert not copies.holds("c", 0, 11)  # another peer
    copies.put("a", 0, 13, two)  # a new version replaces the old one
    assert copies.get("a", 0) == (13, two)
    assert not copies.holds("a", 0, 11)

    copies.drop("a", 0)
    assert copies.get("a", 0) is None
    assert copies.get("a", 1) == (12, two)
    assert copies.get("b", 0) == (21, three)
    copies.drop("a", 7)  # nothing there: no error
    copies.drop("z", 0)
    copies.drop("z")

    copies.drop("a")
    assert copies.get("a", 1) is None
    assert copies.get("b", 0) == (21, three)
    assert copies.peers == 1


def test_copies_forget_the_least_recently_used_peer_first() -> None:
    copies = Copies(2)
    copies.put("a", 0, 1, torch.zeros(2))
    copies.put("b", 0, 2, torch.zeros(2))
    copies.put("c", 0, 3, torch.zeros(2))
    assert copies.peers == 2
    assert copies.get("a", 0) is None
    assert copies.holds("b", 0, 2) and copies.holds("c", 0, 3)


def test_copies_getting_a_peer_refreshes_it_so_the_other_is_forgotten() -> None:
    copies = Copies(2)
    copies.put("a", 0, 1, torch.zeros(2))
    copies.put("b", 0, 2, torch.zeros(2))
    assert copies.get("a", 0) is not None  # "a" is now the most recently used
    copies.put("c", 0, 3, torch.zeros(2))
    assert copies.peers == 2
    assert copies.holds("a", 0, 1)
    assert copies.get("b", 0) is None
    assert copies.holds("c", 0, 3)


def test_copies_putting_another_segment_of_a_peer_refreshes_it_too() -> None:
    copies = Copies(2)
    copies.put("a", 0, 1, torch.zeros(2))
    copies.put("b", 0, 2, torch.zeros(2))
    copies.put("a", 1, 3, torch.zeros(2))
    copies.put("c", 0, 4, torch.zeros(2))
    assert copies.holds("a", 0, 1) and copies.holds("a", 1, 3)
    assert copies.get("b", 0) is None


def test_copies_count_the_bytes_they_hold_once_per_copy() -> None:
    copies = Copies(2)
    assert copies.nbytes == 0
    copies.put("a", 0, 1, torch.zeros(100, dtype=F32))
    copies.put("a", 1, 2, torch.zeros(50, dtype=F64))
    copies.put("b", 0, 3, torch.zeros(10, dtype=F16))
    assert copies.nbytes == 400 + 400 + 20
    copies.put("a", 0, 4, torch.zeros(100, dtype=F32))  # replaces, not adds
    assert copies.nbytes == 820
    copies.drop("a", 1)
    assert copies.nbytes == 420
    copies.put("c", 0, 5, torch.zeros(1000, dtype=F32))  # evicts "b", used least recently
    assert copies.nbytes == 400 + 4000
    copies.drop("a")
    assert copies.nbytes == 4000


# Forgetting and memory


def test_forget_drops_one_peers_copies_and_pending_messages_only() -> None:
    sender = FeedbackSender(Codec.INT8, 4, rng=random.Random(0))
    x = seeded_values(F32, NUMEL)
    for peer in ("bob", "carol"):
        for segment in (0, 1):
            sender.encode(peer, segment, x, sequence=1)
        sender.settled(peer, 1, kept={0, 1}, segments={0, 1})
    pending = {peer: sender.encode(peer, 0, x + 0.1, sequence=2) for peer in ("bob", "carol")}
    assert all(enc.base != WHOLE for enc in pending.values())

    sender.forget("bob")
    assert sender.copies.peers == 1
    assert sender.copies.get("bob", 0) is None and sender.copies.get("bob", 1) is None
    # Bob's pending message is gone: the same sequence is a new, whole message.
    bob = sender.encode("bob", 0, x + 0.1, sequence=2)
    assert bob.base == WHOLE and bob.version != pending["bob"].version
    assert sender.encode("bob", 1, x, sequence=3).base == WHOLE
    # Carol's copies and pending message are untouched.
    carol = sender.encode("carol", 0, x + 0.9, sequence=2)
    assert carol.version == pending["carol"].version
    assert bytes(carol.data) == bytes(pending["carol"].data)
    assert sender.encode("carol", 1, x, sequence=3).base != WHOLE


def test_a_sender_keeps_copies_for_at_most_max_peers_peers() -> None:
    sender = FeedbackSender(Codec.INT8, 1, rng=random.Random(0))
    x = seeded_values(F32, NUMEL)
    for sequence, peer in enumerate(("bob", "carol"), start=1):
        assert sender.encode(peer, 0, x, sequence).base == WHOLE
        sender.settled(peer, sequence, kept={0}, segments={0})
    assert sender.copies.peers == 1
    assert sender.copies.nbytes == NUMEL * 4
    assert sender.encode("carol", 0, x, sequence=3).base != WHOLE
    assert sender.encode("bob", 0, x, sequence=3).base == WHOLE  # evicted


def test_a_receiver_past_max_peers_refuses_the_evicted_peers_differences() -> None:
    receiver = FeedbackReceiver(1)
    x = seeded_values(F32, NUMEL)
    alice = FeedbackSender(Codec.INT8, 4, rng=random.Random(0))
    first, _ = push(alice, receiver, x, sequence=1)
    receiver.keep("carol", 0, 77, x.clone())  # another peer takes the only slot
    assert not receiver.kept(SENDER, 0, first.version)
    enc = alice.encode(RECEIVER, 0, x, sequence=2)
    assert enc.base == first.version
    with pytest.raises(StaleReference, match="no copy"):
        received(receiver, 0, enc, Codec.INT8, x)
