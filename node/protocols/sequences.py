"""A receiver's de-duplication windows, one per sender numbering.

Part of the sum-weight ledger (:mod:`.ledger`), which uses them to keep a retried push
from merging twice. Sequences are per edge and never repeat: a sender numbers its
pushes to each receiver in numberings of consecutive sequences, each known by its first
(``sequence_base``, carried by every push), and a retry reuses its number
(:mod:`.numberings`, the sender's side). A new numbering starts above every sequence the
sender used, when its last one was closed (settled, below) or the receiver restarted or
left the view and came back. The receiver keeps one window per (sender, incarnation,
base) (:class:`Windows`). A restarted receiver restores the windows of its checkpoint,
which are a faithful record of what its restored model holds: a retry of a push it
merged before that checkpoint is answered DUPLICATE, one it merged after (lost with the
crash) is merged again, and new pushes open a fresh window. A sender that restarted
numbering at 1 into the receiver's restored window would be answered DUPLICATE for pushes
never merged, and drop their weight: that was the defect numberings remove.

Settled pushes are forgotten (:meth:`Windows.settle`): a push says what of its numbering
settled before it (acknowledged to the sender, which never sends those again), and a
``Settle`` says the sender closed the numbering, whose window then goes. A receiver keeps
windows only for the numberings still open towards it, not for every sender it ever met.
A settle is believed from the sender it names (the transport authenticates it); a
member lying in one can get a push it made that is still being retried merged twice,
which its credit bounds as it bounds any weight it brings (``limits.peer_credit``).

Within a window the receiver admits a sequence at most ``SEQUENCE_AHEAD`` beyond
the highest it admitted (beyond ``base - 1`` before the first) and refuses anything
further: it is never allowed to move the window. Only a segment this node remembers
merging is answered DUPLICATE; a sequence older than what it remembers is refused,
so the sender folds it back rather than losing it. An honest sender never sees
either refusal (it has one push in flight per edge); a forger who can pass as a
sender can at worst get that sender's pushes refused, never answered DUPLICATE
unmerged.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from gossipd.node.protocols.base import Refused

# How many recent sequences are remembered per (sender, incarnation). Sequences are
# per edge and a sender has at most one push in flight to us, so a retry older
# than this is long settled and treated as already merged.
DEDUP_WINDOW = 4096
# How far beyond the highest admitted sequence a push may be. Sequences to one
# receiver grow by one per push, so a gap only comes from pushes given up on.
SEQUENCE_AHEAD = 1024
# Windows kept per sender incarnation. A sender starts a numbering only when this
# node restarts or drops out of its view, and has one push in flight to it, so
# only the newest two ever matter; the rest bounds what a lying sender can open.
NUMBERINGS_KEPT = 4
# Shared windows remembered for new receivers to point at (see Windows.share); beyond this,
# the oldest is let go (the receivers that point at it keep it).
SHARED_KEPT = 1024

Numbering = tuple[str, int, int]  # (sender, incarnation, base)


class Window:
    """Recently merged (sequence, segment) pairs of one sender numbering, bounded in size.

    A receiver keeps one per sender numbering it merged from, so each is small: a
    simulated node of a 1,000-node crossover mesh merged from about 80 senders in 20
    rounds, and a set and a deque per window held 90 KB of its 156 KB. The newest
    sequence's segments are a bitmask kept inline; older sequences go to a dict (made
    when a second sequence arrives), oldest first, and are forgotten a whole sequence
    at a time once more than ``capacity`` pairs are remembered.
    """

    __slots__ = (
        "_mask",
        "_newest",
        "_older",
        "_pairs",
        "base",
        "forgotten_up_to",
        "highest",
        "incarnation",
        "previous",
        "shared",
    )

    def __init__(
        self,
        base: int = 1,
        incarnation: int = 0,
        forgotten_up_to: int = -1,
        highest: int | None = None,
    ) -> None:
        self.base = base
        self.incarnation = incarnation
        self.forgotten_up_to = forgotten_up_to
        self.highest = highest
        self._newest: int | None = None  # the sequence admitted into last
        self._mask = 0  # its segments, one bit each
        self._older: dict[int, int] | None = None  # earlier sequences' masks, oldest first
        self._pairs = 0
        self.previous: Window | None = None  # the sender's next older numbering, if kept
        self.shared = False  # held by several receivers (Windows.share): never written again

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Window):
            return NotImplemented
        return (self.incarnation, self.base, self.state()) == (
            other.incarnation,
            other.base,
            other.state(),
        )

    @property
    def remembered(self) -> int:
        """(sequence, segment) pairs remembered now."""
        return self._pairs

    def check(self, sequence: int) -> None:
        """Refuse a sequence too far ahead (it must not move the window) or forgotten."""
        if sequence < self.base:
            raise Refused(
                f"sequence {sequence} is below the base {self.base} of its own numbering; refused"
            )
        highest = self.base - 1 if self.highest is None else self.highest
        if sequence > highest + SEQUENCE_AHEAD:
            raise Refused(
                f"sequence {sequence} is more than {SEQUENCE_AHEAD} beyond the highest "
                f"admitted from this sender ({highest}); refused"
            )
        if sequence <= self.forgotten_up_to:
            raise Refused(
                f"sequence {sequence} is older than this node remembers (up to "
                f"{self.forgotten_up_to} forgotten); refused, not acknowledged"
            )

    def _mask_of(self, sequence: int) -> int:
        if sequence == self._newest:
            return self._mask
        return self._older.get(sequence, 0) if self._older else 0

    def is_new(self, sequence: int, segment: int) -> bool:
        return sequence > self.forgotten_up_to and not self._mask_of(sequence) >> segment & 1

    def admit(self, sequence: int, segment: int, capacity: int) -> bool:
        """True the first time a pair is offered; False for a repeat or anything too old."""
        if not self.is_new(sequence, segment):
            return False
        if self.shared:
            raise RuntimeError("a shared de-duplication window was written: copy it first")
        self.highest = sequence if self.highest is None else max(self.highest, sequence)
        bit = 1 << segment
        if sequence == self._newest:
            self._mask |= bit
        elif self._older is not None and sequence in self._older:
            self._older[sequence] |= bit
        else:
            if self._newest is not None:
                if self._older is None:
                    self._older = {}
                self._older[self._newest] = self._mask
            self._newest, self._mask = sequence, bit
        self._pairs += 1
        while self._pairs > capacity:
            self._forget_oldest()
        return True

    def _forget_oldest(self) -> None:
        if self._older:
            sequence = next(iter(self._older))
            mask = self._older.pop(sequence)
        else:
            assert self._newest is not None
            sequence, mask = self._newest, self._mask
            self._newest, self._mask = None, 0
        self._pairs -= mask.bit_count()
        self.forgotten_up_to = max(self.forgotten_up_to, sequence)

    def forget_up_to(self, sequence: int) -> None:
        """Forget every pair of a sequence up to ``sequence``: its sender settled them."""
        if self.shared:
            raise RuntimeError("a shared de-duplication window was written: copy it first")
        if self._older:
            for settled in [q for q in self._older if q <= sequence]:
                self._pairs -= self._older.pop(settled).bit_count()
        if self._newest is not None and self._newest <= sequence:
            self._pairs -= self._mask.bit_count()
            self._newest, self._mask = None, 0
        self.forgotten_up_to = max(self.forgotten_up_to, sequence)

    def pairs(self, after: int = -1) -> list[tuple[int, int]]:
        """The remembered pairs of sequences above ``after``, oldest sequence first."""
        masks = list((self._older or {}).items())
        if self._newest is not None:
            masks.append((self._newest, self._mask))
        return [
            (q, s)
            for q, mask in masks
            if q > after
            for s in range(mask.bit_length())
            if mask >> s & 1
        ]

    def state(self) -> dict[str, Any]:
        return {"order": self.pairs(), "forgotten": self.forgotten_up_to, "high": self.highest}

    def alike(self) -> tuple[int, int, int, int | None, int | None, int] | None:
        """What makes this window what it is, when that fits in a key (one sequence
        remembered, no older numbering linked): windows alike in it are interchangeable."""
        if self._older is not None or self.previous is not None:
            return None
        return (
            self.incarnation,
            self.base,
            self.forgotten_up_to,
            self.highest,
            self._newest,
            self._mask,
        )

    def copy(self) -> Window:
        """A window of its own, alike in every field but ``previous`` and ``shared``."""
        twin = Window(self.base, self.incarnation, self.forgotten_up_to, self.highest)
        twin._newest, twin._mask, twin._pairs = self._newest, self._mask, self._pairs
        twin._older = dict(self._older) if self._older is not None else None
        return twin

    @classmethod
    def restore(cls, state: Mapping[str, Any], incarnation: int = 0) -> Window:
        window = cls(int(state.get("base", 1)), incarnation, state["forgotten"])
        for sequence, segment in state["order"]:
            window.admit(int(sequence), int(segment), capacity=1 << 62)
        window.highest = state["high"]
        return window


@functools.lru_cache(maxsize=64)
def _empty(base: int) -> Window:
    return Window(base)


# Windows held by several receivers, by what makes them alike (Window.alike), oldest first.
_SHARED: dict[tuple[int, int, int, int | None, int | None, int], Window] = {}
_SHARED_LOCK = threading.Lock()  # replicas of one process merge on threads of their own


class Windows:
    """A receiver's side: one :class:`Window` per sender numbering it merged from.

    One dict entry per sender, its newest numbering's window, which links to the older
    ones kept (a sender has more than one only after this node restarted or left its
    view): a dict keyed by (sender, incarnation, base) and a scan of it to open a window
    made opening one O(senders), 5% of a simulated run.

    Windows alike in every field are held once (:meth:`share`), and copied before one is
    written: in a large crossover mesh nearly every sender pushes to a receiver once, so
    most windows remember one sequence of one segment, over 100 bytes each; a simulated node
    of a million-node mesh merges from about 80 senders in 20 rounds."""

    def __init__(self) -> None:
        self._newest: dict[str, Window] = {}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Windows):
            return NotImplemented
        return self.state() == other.state()

    def _chain(self, sender: str) -> Iterator[Window]:
        window = self._newest.get(sender)
        while window is not None:
            yield window
            window = window.previous

    def _relink(self, sender: str, windows: list[Window]) -> None:
        """``sender``'s windows become ``windows``, newest first (a shared one that must
        link to another is copied first)."""
        older: Window | None = None
        for window in reversed(windows):
            if window.previous is not older:
                if window.shared:
                    window = window.copy()
                window.previous = older
            older = window
        if older is not None:
            self._newest[sender] = older
        else:
            self._newest.pop(sender, None)

    def __len__(self) -> int:
        return sum(1 for sender in self._newest for _ in self._chain(sender))

    def __iter__(self) -> Iterator[Numbering]:
        return ((s, w.incarnation, w.base) for s in list(self._newest) for w in self._chain(s))

    def __getitem__(self, numbering: Numbering) -> Window:
        sender, incarnation, base = numbering
        window = self._get(sender, incarnation, base)
        if window is None:
            raise KeyError(numbering)
        return window

    def _get(self, sender: str, incarnation: int, base: int) -> Window | None:
        for window in self._chain(sender):
            if window.incarnation == incarnation and window.base == base:
                return window
        return None

    def find(self, sender: str, incarnation: int, base: int) -> Window:
        """The numbering's window, or an empty one (shared, not to be written) if none is
        open yet: most payloads of a large mesh come from a sender not seen before."""
        return self._get(sender, incarnation, base) or _empty(base)

    def open(self, sender: str, incarnation: int, base: int) -> Window:
        """The numbering's window, opened if need be; a sender incarnation keeps at most
        ``NUMBERINGS_KEPT`` windows, its oldest numberings closed first."""
        window = self._get(sender, incarnation, base)
        if window is None:
            kept = list(self._chain(sender))
            mine = sorted((w for w in kept if w.incarnation == incarnation), key=lambda w: w.base)
            closed = {id(w) for w in mine[: max(0, len(mine) + 1 - NUMBERINGS_KEPT)]}
            window = Window(base, incarnation)
            self._relink(sender, [window, *(w for w in kept if id(w) not in closed)])
        elif window.shared:  # about to be written: this receiver's own copy
            shared, window = window, window.copy()
            self._relink(sender, [window if w is shared else w for w in self._chain(sender)])
        return window

    def share(self, sender: str) -> None:
        """Point at a window alike in every field instead of ``sender``'s, if there is one
        (call after writing it); otherwise offer it to the receivers that follow."""
        window = self._newest.get(sender)
        if window is None or window.shared:
            return
        key = window.alike()
        if key is None:
            return
        with _SHARED_LOCK:
            twin = _SHARED.get(key)
            if twin is None:
                window.shared = True
                if len(_SHARED) >= SHARED_KEPT:
                    del _SHARED[next(iter(_SHARED))]
                _SHARED[key] = window
        if twin is not None:
            self._newest[sender] = twin

    def of(self, sender: str) -> list[Window]:
        """``sender``'s windows, newest numbering first."""
        return list(self._chain(sender))

    def settle(self, sender: str, incarnation: int, base: int, up_to: int, closed: bool) -> None:
        """``sender`` settled its pushes of numbering ``base`` up to ``up_to``: forget them,
        and the window too if the sender ``closed`` the numbering (it never pushes in it
        again) or nothing of it is left. Idempotent, and a no-op for a window not kept."""
        window = self._get(sender, incarnation, base)
        if window is None:
            return
        if not closed:
            if window.shared:
                window = self.open(sender, incarnation, base)
            window.forget_up_to(up_to)
            if window.remembered:
                return
        self._relink(sender, [w for w in self._chain(sender) if w is not window])

    def forget_sender(self, sender: str, keep_incarnation: int) -> None:
        """Close the windows of a sender's older incarnations (it restarted)."""
        kept = [w for w in self._chain(sender) if w.incarnation >= keep_incarnation]
        self._relink(sender, kept)

    def state(self) -> list[dict[str, Any]]:
        return [
            {"sender": s, "incarnation": i, "base": b, **self[(s, i, b)].state()}
            for s, i, b in self
        ]

    @classmethod
    def restore(cls, states: Iterable[Mapping[str, Any]]) -> Windows:
        windows = cls()
        by_sender: dict[str, list[Window]] = {}
        for w in states:
            window = Window.restore(w, int(w["incarnation"]))
            by_sender.setdefault(w["sender"], []).append(window)
        for sender, kept in by_sender.items():
            windows._relink(sender, kept)
        return windows
