"""Ranks and shared seeds: what every node derives alike from the same view, with no
coordination and no shared random state."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from functools import lru_cache
from typing import TypeVar

_T = TypeVar("_T")  # what a set made from a PeerSet's operations holds


@dataclass(frozen=True)
class View:
    """Members ranked by sorted node id; ``epoch`` names the view, equal wherever views are."""

    members: tuple[str, ...]
    rank_of: Mapping[str, int]
    epoch: int


class PeerSet(AbstractSet[str]):
    """A view's members but one node: read through the view, not copied from it.

    A core's peers are asked for at every status; a copy costs O(members), and at
    20,000 simulated nodes checking the invariants (a status of every node at every
    probe) took minutes. Compares, hashes and combines as a frozenset does."""

    __slots__ = ("_me", "_view")

    def __init__(self, view: View, me: str) -> None:
        self._view = view
        self._me = me

    def __contains__(self, peer: object) -> bool:
        return peer != self._me and peer in self._view.rank_of

    def __iter__(self) -> Iterator[str]:
        return (m for m in self._view.members if m != self._me)

    def __len__(self) -> int:
        return len(self._view.members) - (self._me in self._view.rank_of)

    def __repr__(self) -> str:
        return f"PeerSet({sorted(self)!r})"

    __hash__ = AbstractSet._hash

    @classmethod
    def _from_iterable(cls, it: Iterable[_T]) -> frozenset[_T]:
        return frozenset(it)


@lru_cache(maxsize=64)
def ranked(members: frozenset[str]) -> View:
    """Cached: a simulator's thousands of nodes share one view object per membership."""
    ordered = tuple(sorted(members))
    digest = hashlib.blake2b("\n".join(ordered).encode(), digest_size=6).digest()
    return View(ordered, {m: i for i, m in enumerate(ordered)}, int.from_bytes(digest, "big"))


def shared_seed(*parts: int | str) -> int:
    """A 64-bit seed every node derives alike from the same parts, with no shared RNG state."""
    text = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big")
