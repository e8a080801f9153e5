"""Per-edge sequences: a sender's numberings and a receiver's de-duplication windows.

Part of the sum-weight ledger (:mod:`.ledger`), which uses them to keep a retried push
from merging twice. Sequences are per edge and never repeat: a sender numbers its
pushes to each receiver 1, 2, 3… for its whole incarnation, and a retry reuses its
number (:class:`Numberings`). When the receiver restarts (or leaves the view and
comes back) the sender starts a new *numbering*: the next sequence becomes its
``sequence_base``, carried by every push. The receiver keeps one de-duplication
window per (sender, incarnation, base) (:class:`Windows`). A restarted receiver
restores the windows of its checkpoint, which are a faithful record of what its
restored model holds: a retry of a push it merged before that checkpoint is answered
DUPLICATE, one it merged after (lost with the crash) is merged again, and new pushes
open a fresh window. A sender that restarted numbering at 1 into the receiver's
restored window would be answered DUPLICATE for pushes never merged, and drop their
weight: that was the defect this design removes.

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

from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
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

Numbering = tuple[str, int, int]  # (sender, incarnation, base)


@dataclass
class Numberings:
    """A sender's side: the last sequence used towards each receiver, and the first
    sequence of the numbering its pushes to that receiver belong to now."""

    last: dict[str, int] = field(default_factory=dict)
    bases: dict[str, int] = field(default_factory=dict)

    def next(self, receiver: str) -> tuple[int, int]:
        """(sequence, base) of the next push to ``receiver``."""
        sequence = self.last.get(receiver, 0) + 1
        self.last[receiver] = sequence
        return sequence, self.bases.get(receiver, 1)

    def renumber(self, receiver: str) -> None:
        """Number the next pushes to ``receiver`` in a numbering of their own."""
        if receiver in self.last:
            self.bases[receiver] = self.last[receiver] + 1

    def clear(self) -> None:
        self.last.clear()
        self.bases.clear()


@dataclass
class Window:
    """Recently merged (sequence, segment) pairs of one sender numbering, bounded in size."""

    base: int = 1
    seen: set[tuple[int, int]] = field(default_factory=set)
    order: deque[tuple[int, int]] = field(default_factory=deque)
    forgotten_up_to: int = -1
    highest: int | None = None

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

    def is_new(self, sequence: int, segment: int) -> bool:
        return sequence > self.forgotten_up_to and (sequence, segment) not in self.seen

    def admit(self, sequence: int, segment: int, capacity: int) -> bool:
        """True the first time a pair is offered; False for a repeat or anything too old."""
        ident = (sequence, segment)
        if not self.is_new(sequence, segment):
            return False
        self.highest = sequence if self.highest is None else max(self.highest, sequence)
        self.seen.add(ident)
        self.order.append(ident)
        while len(self.order) > capacity:
            old = self.order.popleft()
            self.seen.discard(old)
            self.forgotten_up_to = max(self.forgotten_up_to, old[0])
        return True

    def state(self) -> dict[str, Any]:
        return {"order": list(self.order), "forgotten": self.forgotten_up_to, "high": self.highest}

    @classmethod
    def restore(cls, state: Mapping[str, Any]) -> Window:
        order = deque(tuple(pair) for pair in state["order"])
        return cls(int(state.get("base", 1)), set(order), order, state["forgotten"], state["high"])


@dataclass
class Windows:
    """A receiver's side: one :class:`Window` per sender numbering it merged from."""

    by_numbering: dict[Numbering, Window] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.by_numbering)

    def __iter__(self) -> Iterator[Numbering]:
        return iter(self.by_numbering)

    def __getitem__(self, numbering: Numbering) -> Window:
        return self.by_numbering[numbering]

    def find(self, sender: str, incarnation: int, base: int) -> Window:
        """The numbering's window, or an empty one (not kept) if none is open yet."""
        return self.by_numbering.get((sender, incarnation, base)) or Window(base)

    def open(self, sender: str, incarnation: int, base: int) -> Window:
        """The numbering's window, opened if need be; a sender incarnation keeps at most
        ``NUMBERINGS_KEPT`` windows, its oldest numberings closed first."""
        window = self.by_numbering.get((sender, incarnation, base))
        if window is None:
            mine = sorted(b for s, i, b in self.by_numbering if (s, i) == (sender, incarnation))
            for old in mine[: max(0, len(mine) + 1 - NUMBERINGS_KEPT)]:
                del self.by_numbering[(sender, incarnation, old)]
            window = self.by_numbering[(sender, incarnation, base)] = Window(base)
        return window

    def forget_sender(self, sender: str, keep_incarnation: int) -> None:
        """Close the windows of a sender's older incarnations (it restarted)."""
        for key in [k for k in self.by_numbering if k[0] == sender and k[1] < keep_incarnation]:
            del self.by_numbering[key]

    def state(self) -> list[dict[str, Any]]:
        return [
            {"sender": s, "incarnation": i, "base": b, **w.state()}
            for (s, i, b), w in self.by_numbering.items()
        ]

    @classmethod
    def restore(cls, states: Iterable[Mapping[str, Any]]) -> Windows:
        return cls(
            {
                (w["sender"], w["incarnation"], int(w.get("base", 1))): Window.restore(w)
                for w in states
            }
        )
