"""De-duplication windows alike in every field are held once (node/protocols/sequences.py).

In a large crossover mesh nearly every sender pushes to a receiver once, so most windows
remember one sequence of one segment; receivers point at one shared window instead of a
copy each (a simulated node of a 2,000-node mesh after 20 rounds: 11.4 KB of windows and
numberings, 3.4 KB shared). A shared window is never written: the receiver that admits
into it, or links an older numbering to it, gets its own copy first. These tests hold the
sharing to what it must never change: what each receiver remembers.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gossipd.node.protocols.base import Duplicate
from gossipd.node.protocols.sequences import Windows
from tests.sumweight_events import make, receive

PROPERTY = settings(max_examples=200, derandomize=True, deadline=None, database=None)
CAPACITY = 8  # pairs a window remembers: small, so forgetting is exercised too


def _merge(windows: Windows, sender: str, incarnation: int, base: int, seq: int, seg: int) -> bool:
    """What the ledger does with one merged segment: admit, then share."""
    admitted = windows.open(sender, incarnation, base).admit(seq, seg, CAPACITY)
    windows.share(sender)
    return admitted


def test_receivers_of_a_first_push_point_at_one_window_and_a_second_push_copies_it() -> None:
    a, b = Windows(), Windows()
    assert _merge(a, "s", 7, 1, 1, 2) and _merge(b, "t", 7, 1, 1, 2)
    shared = a.of("s")[0]
    assert b.of("t")[0] is shared and shared.shared

    assert _merge(a, "s", 7, 1, 2, 0)  # the sender's next push to a
    assert a.of("s")[0] is not shared
    assert b.of("t")[0] is shared and shared.pairs() == [(1, 2)]
    assert a.state() == [
        {
            "sender": "s",
            "incarnation": 7,
            "base": 1,
            "order": [(1, 2), (2, 0)],
            "forgotten": -1,
            "high": 2,
        }
    ]
    assert not _merge(b, "t", 7, 1, 1, 2)  # a duplicate is still a duplicate


def test_a_new_numbering_links_to_a_shared_window_without_changing_it() -> None:
    a, b = Windows(), Windows()
    _merge(a, "s", 7, 1, 1, 0)
    _merge(b, "t", 7, 1, 1, 0)
    shared = b.of("t")[0]
    _merge(a, "s", 7, 5, 5, 0)  # the sender numbers anew (this node left its view)
    assert [w.base for w in a.of("s")] == [5, 1]
    assert a.of("s")[1] is shared and shared.previous is None
    a.forget_sender("s", keep_incarnation=8)  # it restarted: both go
    assert a.of("s") == [] and b.of("t")[0] is shared and b.of("t")[0].pairs() == [(1, 0)]


def test_a_checkpoint_of_shared_windows_restores_the_same_windows() -> None:
    a = Windows()
    for sender in ("p", "q", "r"):
        _merge(a, sender, 3, 1, 1, 1)
    restored = Windows.restore(a.state())
    assert restored == a
    assert _merge(restored, "p", 3, 1, 2, 1) and restored.of("p")[0].pairs() == [(1, 1), (2, 1)]
    assert a.of("p")[0].pairs() == [(1, 1)]


OPS = st.lists(
    st.tuples(
        st.integers(0, 2),  # receiver
        st.sampled_from(["s", "t", "u"]),  # sender
        st.integers(1, 2),  # incarnation
        st.sampled_from([1, 4]),  # base
        st.integers(0, 6),  # sequence beyond the base
        st.integers(0, 3),  # segment
        st.booleans(),  # or: the sender restarted (its older incarnations go)
    ),
    max_size=60,
)


@PROPERTY
@given(OPS)
def test_sharing_never_changes_what_any_receiver_remembers(ops: list[tuple]) -> None:
    """Every receiver answers and remembers exactly as one that never shares."""
    sharing = [Windows() for _ in range(3)]
    alone = [Windows() for _ in range(3)]
    for receiver, sender, incarnation, base, ahead, segment, restart in ops:
        if restart:
            sharing[receiver].forget_sender(sender, incarnation)
            alone[receiver].forget_sender(sender, incarnation)
            continue
        seq = base + ahead
        mine = alone[receiver].open(sender, incarnation, base)
        expected = mine.admit(seq, segment, CAPACITY)
        assert _merge(sharing[receiver], sender, incarnation, base, seq, segment) == expected
        for s, w in zip(sharing, alone, strict=True):
            assert s.state() == w.state()


def test_a_mesh_of_cores_shares_windows_and_still_answers_duplicates() -> None:
    """Through the ledger: three receivers of one first push each, and a retry of each."""
    receivers = [make(node_id=f"r{i}", peers=()) for i in range(3)]
    for i, node in enumerate(receivers):
        receive(node, f"s{i}", 0, 1, 0, 0.5)
    windows = [node.windows.of(f"s{i}")[0] for i, node in enumerate(receivers)]
    assert windows[0] is windows[1] is windows[2]
    for i, node in enumerate(receivers):
        assert receive(node, f"s{i}", 0, 1, 0, 0.5) == Duplicate(0)  # merges nothing
        assert node.weights[0] == 1.5
