"""A leaving peer's last word: which of this node's pushes it merged.

A leaving node merges nothing new, hands its weight on, then tells each peer in its
Leave which of that peer's pushes it merged (its de-duplication windows for that
sender). A push to it whose answer was lost (an attempt cut off under load, a retry
still on its way when the goodbye arrived) used to fold back once the leaver was
gone, although the leaver had merged it and handed its weight on: the mesh then held
that weight twice (seen once in CI, Σw 3.667 for 3 sites after a graceful leave).
Settled from the last word, such a push commits what the leaver merged and folds back
only what it did not, exactly.

The word is believed only from a Leave checked with the leaver itself (it answers as
gone or leaving), and it says nothing a member could not already say by acknowledging
or refusing: a liar moves weight no further than its credit lets its acks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gossipd.node.protocols.base import Receipts
from gossipd.node.protocols.sequences import NUMBERINGS_KEPT
from gossipd.proto import gossip_pb2 as pb

KEPT_PEERS = 64  # departed peers whose word is kept; older ones are forgotten first
# The newest sequences of each numbering a Leave names. A sender has at most a few pushes
# to one receiver unsettled, the newest ones; a whole window (4,096 sequences of every
# segment) of a 100-segment model would make a Leave of megabytes per peer.
SEQUENCES_SAID = 64


def to_messages(receipts: Iterable[Receipts]) -> list[pb.Receipts]:
    """The receipts as a Leave carries them: each numbering's newest ``SEQUENCES_SAID``
    sequences, the older ones said forgotten (a push among them settles as before)."""
    messages = []
    for r in receipts:
        newest = max((q for q, _ in r.pairs), default=r.forgotten_up_to)
        forgotten = max(r.forgotten_up_to, newest - SEQUENCES_SAID)
        pairs = sorted(p for p in r.pairs if p[0] > forgotten)
        messages.append(
            pb.Receipts(
                sender_incarnation=r.incarnation,
                base=r.base,
                forgotten_up_to=forgotten,
                sequences=[q for q, _ in pairs],
                segments=[s for _, s in pairs],
            )
        )
    return messages


def from_messages(messages: Sequence[pb.Receipts], segments: int) -> list[Receipts] | None:
    """The receipts, or None when they are malformed or more than a Leave says (at most
    ``NUMBERINGS_KEPT`` numberings per sender incarnation kept, ``SEQUENCES_SAID`` of each
    said, of every segment): such a word is ignored, and its pushes settle as before."""
    most = NUMBERINGS_KEPT * SEQUENCES_SAID * segments
    if sum(len(m.sequences) for m in messages) > most:
        return None
    receipts = []
    for m in messages:
        if len(m.sequences) != len(m.segments) or any(s >= segments for s in m.segments):
            return None
        pairs = frozenset(zip(m.sequences, m.segments, strict=True))
        receipts.append(Receipts(m.sender_incarnation, m.base, m.forgotten_up_to, pairs))
    return receipts


@dataclass(frozen=True)
class LastWord:
    incarnation: int  # the leaver's
    receipts: tuple[Receipts, ...]

    def merged(
        self, sender_incarnation: int, base: int, sequence: int, segments: Iterable[int]
    ) -> list[int] | None:
        """Which of the push's ``segments`` the leaver merged; None where it cannot tell
        (a sequence it forgot, or a numbering whose window it closed)."""
        mine = [r for r in self.receipts if r.incarnation == sender_incarnation]
        window = next((r for r in mine if r.base == base), None)
        if window is None:
            # A window opens at the first merge of its numbering: none means nothing of
            # it merged, unless a later numbering's window took its place.
            return None if any(r.base > base for r in mine) else []
        merged = []
        for segment in segments:
            answer = window.merged(sequence, segment)
            if answer is None:
                return None
            if answer:
                merged.append(segment)
        return merged


class LastWords:
    """The last words of peers that left, newest kept (bounded by ``KEPT_PEERS``)."""

    def __init__(self) -> None:
        self._words: OrderedDict[str, LastWord] = OrderedDict()

    def heard(self, peer: str, word: LastWord) -> None:
        self._words.pop(peer, None)
        self._words[peer] = word
        while len(self._words) > KEPT_PEERS:
            self._words.popitem(last=False)

    def of(self, peer: str, incarnation: int) -> LastWord | None:
        """``peer``'s word, if the incarnation that said it is ``incarnation``."""
        word = self._words.get(peer)
        return word if word is not None and word.incarnation == incarnation else None
