"""Error feedback for compressed gossip (node/compression/feedback.py).

Protects the contract in that module's docstring (docs/design.md §4 lists the codecs it
builds on): a segment travels whole first, then as a difference from the copy both ends
hold, so the receiver rebuilds bit for bit what the sender recorded and what the codec
dropped is in the next difference; a retry sends the same bytes under the same version; a
sender keeps a copy only once the receiver acknowledged *and* kept it; a receiver refuses a
difference from a copy it lacks (``StaleReference``, its own copy untouched). How many
copies each end keeps, and forgetting a peer, are tests/test_feedback_memory.py's.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from gossipd.node.compression import codecs as wirecodec
from gossipd.node.compression.codecs import Codec
from gossipd.node.compression.feedback import (
    WHOLE,
    Encoded,
    FeedbackReceiver,
    FeedbackSender,
)
from gossipd.node.errors import StaleReference
from tests.tensors import BF16, F16, F32, F64, seeded_values

SENDER, RECEIVER = "alice", "bob"  # each end names the other: the sender's peer is RECEIVER
NUMEL = 1000  # four int8 blocks, the last one partial


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def received(
    receiver: FeedbackReceiver, segment: int, enc: Encoded, codec: Codec, like: torch.Tensor
) -> torch.Tensor:
    """What ``receiver`` rebuilds from ``enc``'s bytes, decoded from its own buffer."""
    decoded = wirecodec.decode(bytearray(enc.data), codec, like.dtype, like.numel())
    return receiver.rebuild(SENDER, segment, enc.base, enc.version, decoded)


def push(
    sender: FeedbackSender,
    receiver: FeedbackReceiver,
    values: torch.Tensor,
    sequence: int,
    segment: int = 0,
) -> tuple[Encoded, torch.Tensor]:
    """One push that arrives, is kept and is acknowledged as kept: the message and what the
    receiver rebuilt from it."""
    enc = sender.encode(RECEIVER, segment, values, sequence)
    rebuilt = received(receiver, segment, enc, sender.codec, values)
    receiver.keep(SENDER, segment, enc.version, rebuilt)
    kept = {segment} if receiver.kept(SENDER, segment, enc.version) else set()
    sender.settled(RECEIVER, sequence, kept=kept, segments={segment})
    return enc, rebuilt


def ends(codec: Codec = Codec.INT8, max_peers: int = 4) -> tuple[FeedbackSender, FeedbackReceiver]:
    return FeedbackSender(codec, max_peers, rng=random.Random(0)), FeedbackReceiver(max_peers)


def whole_error(values: torch.Tensor, codec: Codec) -> float:
    """The largest error of ``values`` sent whole in ``codec`` (no feedback)."""
    data = wirecodec.encode(values, codec)
    decoded = wirecodec.decode(bytearray(data), codec, values.dtype, values.numel())
    return float((decoded.double() - values.double()).abs().max())


# Whole first, then differences


@pytest.mark.parametrize("dtype", [F32, F64, F16], ids=str)
@pytest.mark.parametrize("codec", [Codec.INT8, Codec.INT4, Codec.FP16], ids=lambda c: c.name)
def test_a_first_message_is_whole_and_the_receiver_rebuilds_what_the_sender_recorded(
    codec: Codec, dtype: torch.dtype
) -> None:
    sender, receiver = ends(codec)
    x = seeded_values(dtype, NUMEL)
    enc = sender.encode(RECEIVER, 0, x, sequence=1)
    assert enc.base == WHOLE == 0
    assert enc.version != 0
    assert len(enc.data) == wirecodec.encoded_nbytes(codec, dtype, NUMEL)
    assert enc.rebuilt.dtype == dtype and enc.rebuilt.shape == x.shape
    # Sent whole, the message is the codec's encoding of the values themselves.
    assert bytes(enc.data) == bytes(wirecodec.encode(x, codec))
    rebuilt = received(receiver, 0, enc, codec, x)
    assert same_bits(rebuilt, enc.rebuilt)


@pytest.mark.parametrize("dtype", [F32, F64, F16], ids=str)
@pytest.mark.parametrize("codec", [Codec.INT8, Codec.INT4, Codec.FP16], ids=lambda c: c.name)
def test_a_kept_message_makes_the_next_one_a_difference_from_its_version(
    codec: Codec, dtype: torch.dtype
) -> None:
    sender, receiver = ends(codec)
    x1 = seeded_values(dtype, NUMEL, seed=1)
    first, _ = push(sender, receiver, x1, sequence=1)
    assert receiver.kept(SENDER, 0, first.version)

    step = (seeded_values(F64, NUMEL, seed=2) * 0.01).to(dtype)  # 0.1 per value, not 10
    x2 = x1 + step
    enc = sender.encode(RECEIVER, 0, x2, sequence=2)
    assert enc.base == first.version
    assert enc.version not in (0, first.version)
    assert enc.rebuilt.dtype == dtype
    # The bytes are the change since the shared copy (about 0.1 a value), not the values
    # themselves (about 10): at least ten times smaller.
    change = wirecodec.decode(bytearray(enc.data), codec, dtype, NUMEL)
    assert float(change.double().abs().max()) < 0.1 * float(x2.double().abs().max())
    rebuilt = received(receiver, 0, enc, codec, x2)
    assert same_bits(rebuilt, enc.rebuilt)
    assert same_bits(rebuilt, first.rebuilt + change)
    # A difference errs by a fraction of the change, far under a whole message's error
    # (both are 0 for fp16 of float16 values, which it carries exactly).
    assert float((rebuilt.double() - x2.double()).abs().max()) <= 0.1 * whole_error(x2, codec)


@pytest.mark.parametrize("dtype", [F32, F64], ids=str)
@pytest.mark.parametrize(
    ("codec", "shrink"), [(Codec.INT8, 100), (Codec.INT4, 5)], ids=["int8", "int4"]
)
def test_what_the_codec_dropped_travels_in_the_next_difference(
    codec: Codec, shrink: int, dtype: torch.dtype
) -> None:
    """Values that do not change reach the receiver ever more exactly: each difference
    carries the previous message's error, and its own error is half a step of that. The
    error shrank by about 254 times a round in int8 and 14 times in int4 when measured;
    the bounds (100, 5) leave room. A sender that kept the true values as its copy, not
    what the receiver rebuilt, would send zeros and stay at the first error."""
    sender, receiver = ends(codec)
    x = seeded_values(dtype, NUMEL)
    errors = []
    for sequence in range(1, 5):
        _, rebuilt = push(sender, receiver, x, sequence)
        errors.append(float((rebuilt.double() - x.double()).abs().max()))
    assert errors[0] > 0
    for before, after in itertools.pairwise(errors):
        assert after <= before / shrink, errors


def test_error_feedback_tracks_drifting_values_far_closer_than_whole_int8_messages() -> None:
    """Twenty rounds of values of about 1 that drift by 0.01 a round. Whole int8 messages
    err by about 1.6e-2 every round; differences, once the first whole message is kept,
    erred by at most 1.7e-4 when measured (half an int8 step of the drift). The bound,
    a twentieth of the smallest whole error (about 8e-4), leaves five times that."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(NUMEL, generator=g)
    sender, receiver = ends(Codec.INT8)
    feedback_errors, whole_errors = [], []
    for sequence in range(1, 21):
        if sequence > 1:
            x = x + 0.01 * torch.randn(NUMEL, generator=g)
        base = sender.copies.get(RECEIVER, 0)
        enc, rebuilt = push(sender, receiver, x, sequence)
        assert enc.base == (WHOLE if base is None else base[0])
        assert (enc.base == WHOLE) == (sequence == 1)
        assert same_bits(rebuilt, enc.rebuilt)
        feedback_errors.append(float((rebuilt - x).abs().max()))
        whole_errors.append(whole_error(x, Codec.INT8))
    assert min(whole_errors) > 1e-2
    assert feedback_errors[0] == pytest.approx(whole_errors[0])  # the first one is whole
    assert max(feedback_errors[1:]) < min(whole_errors) / 20, feedback_errors


# Retries and acknowledgements


def test_a_retry_sends_the_same_bytes_under_the_same_version_and_a_new_push_a_new_one() -> None:
    sender, _ = ends(Codec.INT8)
    x = seeded_values(F32, NUMEL)
    first = sender.encode(RECEIVER, 0, x, sequence=1)
    moved = x + 1.0  # the model moved between the attempts: the retry is still the same
    retry = sender.encode(RECEIVER, 0, moved, sequence=1)
    assert retry.version == first.version and retry.base == first.base
    assert bytes(retry.data) == bytes(first.data)
    assert same_bits(retry.rebuilt, first.rebuilt)

    another = sender.encode(RECEIVER, 0, x, sequence=2)
    assert another.version not in (0, first.version)
    assert another.base == WHOLE  # nothing settled yet: still no shared copy


def test_a_retry_of_a_difference_is_the_same_difference() -> None:
    sender, receiver = ends(Codec.INT8)
    x = seeded_values(F32, NUMEL)
    first, _ = push(sender, receiver, x, sequence=1)
    enc = sender.encode(RECEIVER, 0, x + 0.5, sequence=2)
    retry = sender.encode(RECEIVER, 0, x - 3.0, sequence=2)
    assert enc.base == first.version
    assert (retry.base, retry.version) == (enc.base, enc.version)
    assert bytes(retry.data) == bytes(enc.data)
    assert same_bits(retry.rebuilt, enc.rebuilt)


def test_a_retry_after_its_push_settled_is_a_new_message() -> None:
    sender, receiver = ends(Codec.INT8)
    x = seeded_values(F32, NUMEL)
    first, _ = push(sender, receiver, x, sequence=1)
    again = sender.encode(RECEIVER, 0, x, sequence=1)
    assert again.version != first.version
    assert again.base == first.version


def test_a_push_settled_without_being_kept_makes_the_next_message_whole() -> None:
    sender, receiver = ends(Codec.INT8)
    x = seeded_values(F32, NUMEL)
    push(sender, receiver, x, sequence=1)
    enc = sender.encode(RECEIVER, 0, x + 0.1, sequence=2)
    assert enc.base != WHOLE
    # The receiver did not keep it (or the acknowledgement was lost): it may hold either
    # version, so the sender forgets its copy.
    sender.settled(RECEIVER, 2, kept=set(), segments={0})
    assert sender.copies.get(RECEIVER, 0) is None
    assert sender.encode(RECEIVER, 0, x + 0.2, sequence=3).base == WHOLE


def test_a_whole_push_settled_without_being_kept_keeps_no_copy() -> None:
    sender, _ = ends(Codec.INT8)
    x = seeded_values(F32, NUMEL)
    sender.encode(RECEIVER, 0, x, sequence=1)
    sender.settled(RECEIVER, 1, kept=set(), segments={0})
    assert sender.copies.get(RECEIVER, 0) is None
    assert sender.encode(RECEIVER, 0, x, sequence=2).base == WHOLE


def test_an_acknowledgement_of_an_older_push_keeps_nothing_and_drops_the_copy() -> None:
    """The sender pushed sequence 3 after 2; an ack of 2 that says "kept" cannot tell which
    version the receiver holds now, so the sender starts over whole."""
    sender, receiver = ends(Codec.INT8)
    x = seeded_values(F32, NUMEL)
    push(sender, receiver, x, sequence=1)
    sender.encode(RECEIVER, 0, x + 0.1, sequence=2)
    sender.encode(RECEIVER, 0, x + 0.2, sequence=3)
    sender.settled(RECEIVER, 2, kept={0}, segments={0})
    assert sender.copies.get(RECEIVER, 0) is None
    assert sender.encode(RECEIVER, 0, x, sequence=4).base == WHOLE


def test_settling_one_segment_leaves_the_others_copies_alone() -> None:
    sender, receiver = ends(Codec.INT8)
    x = seeded_values(F32, NUMEL)
    push(sender, receiver, x, sequence=1, segment=0)
    first1, _ = push(sender, receiver, x, sequence=1, segment=1)
    sender.encode(RECEIVER, 0, x, sequence=2)
    sender.settled(RECEIVER, 2, kept=set(), segments={0})
    assert sender.copies.get(RECEIVER, 0) is None
    assert sender.copies.holds(RECEIVER, 1, first1.version)
    assert sender.encode(RECEIVER, 1, x, sequence=3).base == first1.version


# The receiver's checks


def test_a_receiver_with_no_copy_refuses_a_difference_and_keeps_nothing() -> None:
    sender, _ = ends(Codec.INT8)
    x = seeded_values(F32, NUMEL)
    push(sender, FeedbackReceiver(4), x, sequence=1)
    enc = sender.encode(RECEIVER, 0, x + 0.1, sequence=2)
    assert enc.base != WHOLE
    fresh = FeedbackReceiver(4)  # a restarted receiver: its copies are gone
    with pytest.raises(StaleReference) as refused:
        received(fresh, 0, enc, Codec.INT8, x)
    message = str(refused.value)
    assert "segment 0" in message and SENDER in message
    assert f"{enc.base:#x}" in message and "no copy" in message
    assert "the sender must send the values whole" in message
    assert fresh.copies.peers == 0 and fresh.copies.nbytes == 0


def test_a_receiver_holding_another_version_refuses_a_difference_and_keeps_its_copy() -> None:
    sender, receiver = ends(Codec.INT8)
    x = seeded_values(F32, NUMEL)
    push(sender, receiver, x, sequence=1, segment=5)
    # The receiver kept sequence 2, but the sender never heard (no settled): it still
    # takes its differences from version 1.
    second = sender.encode(RECEIVER, 5, x + 0.1, sequence=2)
    held = received(receiver, 5, second, Codec.INT8, x)
    receiver.keep(SENDER, 5, second.version, held)
    held_bits = held.clone()
    third = sender.encode(RECEIVER, 5, x + 0.2, sequence=3)
    assert third.base == second.base != second.version
    with pytest.raises(StaleReference) as refused:
        received(receiver, 5, third, Codec.INT8, x)
    message = str(refused.value)
    assert "segment 5 from alice" in message
    assert f"difference from version {third.base:#x}" in message
    assert f"holds version {second.version:#x}" in message
    assert "the sender must send the values whole" in message
    version, values = receiver.copies.get(SENDER, 5) or (None, None)
    assert version == second.version
    assert values is not None and same_bits(values, held_bits)
    assert receiver.kept(SENDER, 5, second.version)
    assert not receiver.kept(SENDER, 5, third.version)


def test_after_a_refusal_the_sender_forgets_the_peer_and_the_next_message_is_accepted() -> None:
    sender, receiver = ends(Codec.INT8)
    x = seeded_values(F32, NUMEL)
    push(sender, receiver, x, sequence=1)
    receiver.copies.drop(SENDER)  # the receiver lost its copy (evicted, restarted)
    stale = sender.encode(RECEIVER, 0, x, sequence=2)
    with pytest.raises(StaleReference):
        received(receiver, 0, stale, Codec.INT8, x)
    sender.settled(RECEIVER, 2, kept=set(), segments={0})
    sender.forget(RECEIVER)
    enc, rebuilt = push(sender, receiver, x, sequence=3)
    assert enc.base == WHOLE
    assert same_bits(rebuilt, enc.rebuilt)
    assert receiver.kept(SENDER, 0, enc.version)
    assert sender.encode(RECEIVER, 0, x, sequence=4).base == enc.version


def test_a_retry_whose_result_the_receiver_holds_stands_for_the_held_values() -> None:
    sender, receiver = ends(Codec.INT8)
    x = seeded_values(F32, NUMEL)
    first, _ = push(sender, receiver, x, sequence=1)
    enc = sender.encode(RECEIVER, 0, x + 0.1, sequence=2)
    merged = received(receiver, 0, enc, Codec.INT8, x)
    receiver.keep(SENDER, 0, enc.version, merged)
    # The acknowledgement was lost; the sender retries the same message, whose base
    # (version 1) the receiver no longer holds: it stands for the values already held.
    retry = sender.encode(RECEIVER, 0, x + 0.7, sequence=2)
    assert retry.base == first.version and retry.version == enc.version
    again = received(receiver, 0, retry, Codec.INT8, x)
    assert same_bits(again, merged) and same_bits(again, enc.rebuilt)
    assert receiver.kept(SENDER, 0, enc.version)


def test_a_whole_message_is_taken_whatever_the_receiver_holds() -> None:
    sender, receiver = ends(Codec.INT8)
    x = seeded_values(F32, NUMEL)
    push(sender, receiver, x, sequence=1)
    other = FeedbackSender(Codec.INT8, 4, rng=random.Random(1))  # the sender, restarted
    enc = other.encode(RECEIVER, 0, x * 2, sequence=1)
    assert enc.base == WHOLE
    assert same_bits(received(receiver, 0, enc, Codec.INT8, x), enc.rebuilt)


def test_version_zero_is_never_kept() -> None:
    receiver = FeedbackReceiver(4)
    receiver.keep(SENDER, 0, 0, torch.ones(4))
    assert receiver.copies.peers == 0 and receiver.copies.nbytes == 0
    assert not receiver.kept(SENDER, 0, 0)
    receiver.keep(SENDER, 0, 9, torch.ones(4))
    assert receiver.kept(SENDER, 0, 9)
    assert not receiver.kept(SENDER, 0, 0)
    assert not receiver.kept(SENDER, 1, 9) and not receiver.kept("carol", 0, 9)
    # Version 0 names no copy even if one were stored under it by hand.
    receiver.copies.put(SENDER, 2, 0, torch.ones(4))
    assert not receiver.kept(SENDER, 2, 0)


@pytest.mark.parametrize(
    ("codec", "dtype"),
    [
        pytest.param(Codec.INT8, F32, id="int8-float32"),
        pytest.param(Codec.INT8, F16, id="int8-float16"),
        pytest.param(Codec.FP16, F32, id="fp16-float32"),
        # The codec alone would send (and keep) a view of the caller's values here.
        pytest.param(Codec.FP16, F16, id="fp16-float16"),
        pytest.param(Codec.BF16, BF16, id="bf16-bfloat16"),
    ],
)
def test_a_message_is_a_snapshot_of_the_values_it_was_made_from(
    codec: Codec, dtype: torch.dtype
) -> None:
    """A retry must send the same bytes, and the copy must be what the receiver rebuilt,
    however the caller's values move after the push was made (training updates a model's
    segment buffers in place)."""
    sender = FeedbackSender(codec, 4, rng=random.Random(0))
    x = seeded_values(dtype, NUMEL)
    enc = sender.encode(RECEIVER, 0, x, sequence=1)
    data, rebuilt = bytes(enc.data), enc.rebuilt.clone()
    x += 1
    assert bytes(enc.data) == data
    assert same_bits(enc.rebuilt, rebuilt)
    assert bytes(sender.encode(RECEIVER, 0, x, sequence=1).data) == data
