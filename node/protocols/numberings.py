"""A sender's side of the per-edge sequences: its open numberings towards its receivers.

Part of the sum-weight ledger (:mod:`.ledger`); the receiver's side, the de-duplication
windows, is :mod:`.sequences`. A numbering is a run of consecutive sequences towards one
receiver, known by its first (``sequence_base``). It stays open while pushes go along
that edge, each carrying what of it settled before (``Push.settled``), and is closed once
the edge has been idle: the receiver is told (``Settle``) and both ends forget it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gossipd.node.protocols.settings import SETTLE_IDLE_STEPS


@dataclass
class Numberings:
    """A sender's side: per receiver with a numbering open, the last sequence used, the
    numbering's first sequence, the highest whose push the receiver acknowledged, and the
    local step of the last push.

    A numbering is closed once its receiver has been idle (:meth:`idle`): the receiver is
    told to forget its window (a ``Settle``), and the rows go, so this node keeps rows
    only for the receivers it pushes to now, not for every peer it ever met. The next
    push to that receiver opens a numbering above every sequence used before (``top``),
    so no base repeats within this incarnation and a window the receiver kept (a lost
    settle, a checkpoint restored) never answers for a push it did not see."""

    last: dict[str, int] = field(default_factory=dict)
    bases: dict[str, int] = field(default_factory=dict)
    acked: dict[str, int] = field(default_factory=dict)
    pushed_at: dict[str, int] = field(default_factory=dict)
    top: int = 0  # the highest sequence used towards any receiver
    idle_steps: int = SETTLE_IDLE_STEPS  # steps without a push that close a numbering

    def next(self, receiver: str, step: int = 0) -> tuple[int, int]:
        """(sequence, base) of the next push to ``receiver``, at local step ``step``."""
        last = self.last.get(receiver)
        if last is None:
            sequence = self.bases[receiver] = self.top + 1
        else:
            sequence = last + 1
        self.last[receiver] = sequence
        self.top = max(self.top, sequence)
        self.pushed_at[receiver] = step
        return sequence, self.bases[receiver]

    def acknowledged(self, receiver: str, base: int, sequence: int) -> None:
        """The receiver merged (some of) push ``sequence`` of numbering ``base``."""
        if self.bases.get(receiver) == base:
            self.acked[receiver] = max(self.acked.get(receiver, 0), sequence)

    def settled(self, receiver: str) -> int:
        """The highest sequence of the open numbering to ``receiver`` that the receiver
        acknowledged (0: none): what a push to it may tell it to forget."""
        return self.acked.get(receiver, 0)

    def idle(self, step: int) -> list[str]:
        """The receivers whose numbering saw no push for ``idle_steps`` steps."""
        return [r for r, at in self.pushed_at.items() if step - at >= self.idle_steps]

    def close(self, receiver: str) -> tuple[int, int, int] | None:
        """Forget the numbering to ``receiver``: (base, last sequence, highest acknowledged
        sequence), or None if none was open."""
        base = self.bases.pop(receiver, None)
        last = self.last.pop(receiver, None)
        acked = self.acked.pop(receiver, 0)
        self.pushed_at.pop(receiver, None)
        if base is None or last is None:
            return None
        return base, last, acked

    def renumber(self, receiver: str) -> None:
        """Number the next pushes to ``receiver`` in a numbering of their own (it restarted
        or left the view: its windows know only what its checkpoint held)."""
        self.close(receiver)

    def clear(self) -> None:
        self.last.clear()
        self.bases.clear()
        self.acked.clear()
        self.pushed_at.clear()
