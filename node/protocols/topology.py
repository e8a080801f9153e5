"""Round topologies every node derives alike, and the spectral yardstick to compare them.

A topology here is a pure function of (N, seed parts): no node ever draws from a
shared stateful RNG, so a node that skipped a round, restarted, or joined late
computes exactly what every other node with the same view computes (docs/design.md §5,
"rules learned from the reference implementations"). The seed parts are the
mesh seed, the view's epoch, the round and, where it matters, the segment.

The functions that build a whole round's map are ``lru_cache``d: a simulator
runs thousands of cores in one process, and every core of a round asks for the
same map. The first pays O(N); the rest pay a dictionary look-up, so a core's
work per round stays O(segments) (crossover) or O(group size) (shuffle-exchange).
Cached values are tuples, so no caller can change what another one reads.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from gossipd.node.protocols.base import View, shared_seed

# One round's maps for every segment, for several rounds in flight at once (a
# simulator's nodes are not all in the same round). A map of 10,000 ranks is a
# tuple of 10,000 pointers to shared ints (about 80 KB), so the cache stays small.
_CACHE_SIZE = 256


@lru_cache(maxsize=8)
def _identity(n: int) -> tuple[int, ...]:
    """Shared int objects for ranks 0..n−1, so each cached map costs a pointer per rank."""
    return tuple(range(n))


@lru_cache(maxsize=_CACHE_SIZE)
def derangement(n: int, *seed_parts: int | str) -> tuple[int, ...]:
    """A uniformly random derangement of ``range(n)``, the same wherever the parts are.

    Rejection-sampled Fisher–Yates: shuffle, and start again while any rank maps
    to itself. A uniform permutation conditioned on having no fixed point is a
    uniform derangement, and about 1/e of permutations qualify, so it takes e
    shuffles on average. Two tempting alternatives are wrong: Sattolo's algorithm
    only yields single n-cycles (a tiny subset of derangements), and the
    Crossover-SGD paper's greedy roulette can dead-end when the last rank is the
    only one left for itself.

    The retries draw from one ``random.Random`` seeded by
    :func:`~gossipd.node.protocols.base.shared_seed` of the parts; Python's
    Mersenne Twister and ``shuffle`` give the same sequence for the same integer
    seed on every platform.
    """
    if n < 2:
        raise ValueError(f"a derangement needs at least 2 ranks, got {n}")
    rng = random.Random(shared_seed("derangement", n, *seed_parts))
    order = list(_identity(n))
    while True:
        rng.shuffle(order)
        if all(order[i] != i for i in range(n)):
            return tuple(order)


def ceil_log2(n: int) -> int:
    """m with 2^(m−1) < n ≤ 2^m: the number of doubling shifts that span ``n`` ranks."""
    if n < 1:
        raise ValueError(f"need at least one rank, got {n}")
    return (n - 1).bit_length()


def exponential_peer(rank: int, n: int, k: int, backward: bool = False) -> int:
    """Rank (rank ± 2^(k mod m)) mod n, m = ⌈log2 n⌉: the exponential graph, forward
    (+) or ``backward`` (−).

    The shifts 1, 2, …, 2^(m−1) are all below n, so there is never a self-edge,
    and sums of distinct shifts reach every offset 0..2^m − 1 ⊇ 0..n − 1, so any
    m consecutive iterations carry every node's mass to every other node. That holds
    whatever the sign of each shift: two subsets of signed shifts first differ at some
    2^j, and differ by 2^j times an odd number, never a multiple of 2^m, so the m
    iterations of a cycle reach every offset once even if the direction turns within
    them. Hence the protocols turn it every cycle (:func:`cycle_backward`): the edge
    i → i + 2^k of one cycle is i + 2^k → i in the next, so a peer's weight comes back
    to it along the edge it left by, and a peer that never sends any back is a sink
    (:mod:`.sinks`), as with the undirected protocols.
    """
    if n < 2:
        raise ValueError(f"an exponential graph needs at least 2 ranks, got {n}")
    shift = 1 << (k % ceil_log2(n))
    return (rank - shift if backward else rank + shift) % n


def exponential_neighbours(view: View, a: str, b: str) -> bool:
    """Whether members ``a`` and ``b`` of ``view`` are joined by an edge of its exponential
    graph (one is the other ± a power of two below the number of members, modulo it): the
    pairs that push to each other, one way in one cycle, the other in the next."""
    if a not in view.rank_of or b not in view.rank_of or a == b:
        return False
    n = len(view.members)
    d = (view.rank_of[b] - view.rank_of[a]) % n
    return d & (d - 1) == 0 or (n - d) & (n - d - 1) == 0


def cycle_backward(cycle: int) -> bool:
    """Whether the exponential graph's ``cycle``-th cycle (m iterations, or one burst of
    sub-rounds) runs backward: every other one does."""
    return cycle % 2 == 1


@dataclass(frozen=True)
class Grouping:
    """Ranks cut into groups: ``groups[group_of[r]]`` is the group of rank r."""

    groups: tuple[tuple[int, ...], ...]
    group_of: tuple[int, ...]


@lru_cache(maxsize=_CACHE_SIZE)
def shuffled_groups(n: int, *seed_parts: int | str) -> Grouping:
    """Shuffle ``range(n)`` and cut it into k = round(√n) contiguous near-equal chunks.

    Chunk j is ``order[j·n//k : (j+1)·n//k]``, so sizes differ by at most one.
    k ≈ √n makes both the number of groups and a group's size O(√n): each node
    talks to O(√n) peers per round (SESGD's point), yet every pair of nodes shares
    a group with probability about 1/√n per round, so models still mix globally.
    """
    if n < 1:
        raise ValueError(f"need at least one rank, got {n}")
    k = max(1, round(math.sqrt(n)))
    order = list(_identity(n))
    random.Random(shared_seed("groups", n, *seed_parts)).shuffle(order)
    bounds = [j * n // k for j in range(k + 1)]
    groups = tuple(tuple(order[bounds[j] : bounds[j + 1]]) for j in range(k))
    group_of = [0] * n
    for j, group in enumerate(groups):
        for rank in group:
            group_of[rank] = j
    return Grouping(groups, tuple(group_of))


def second_singular_value(matrices: Iterable[np.ndarray]) -> float:
    """σ₂ of the product M_k ⋯ M_1 of mixing matrices (``matrices`` in the order applied).

    For doubly stochastic M, σ₁ = 1 (the all-ones vector) and σ₂ bounds how much
    k rounds can shrink any disagreement: ‖M x − x̄‖ ≤ σ₂ ‖x − x̄‖, with equality
    for the worst x. This is the quantity of Crossover-SGD's Figure 6 (which calls
    it the second eigenvalue; for a non-symmetric product the singular value is
    the one that bounds the error).
    """
    product: np.ndarray | None = None
    for m in matrices:
        product = m if product is None else m @ product
    if product is None:
        raise ValueError("need at least one mixing matrix")
    values = np.linalg.svd(product, compute_uv=False)
    return float(values[1]) if len(values) > 1 else 0.0
