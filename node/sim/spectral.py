"""The spectral yardstick: the mixing matrices the cores' pushes made, and what they predict.

Round k of gossip maps the models linearly, x(k) = W_k x(k−1), per segment: each
merge blends a row with a pushed snapshot, each fold-back with the sender's
own. Rather than form W_k and multiply, :class:`MixingTracker` runs the very same
merges on the rows of an N×N matrix that starts as the identity, so it holds
the product P_k = W_k ⋯ W_1 itself (row i: node i's model as a combination of
the initial ones). In synchronous rounds that is exactly the product of the
rounds' matrices; it stays exact when a push crosses a round boundary, where a
product of per-round matrices would not be.

Every merge is a convex combination, so P_k is row-stochastic and, with
J = 11ᵀ/N and D_k the deviations from the initial mean x̄, D_k = (P_k − J) D_0.
Hence, per segment, ‖D_k‖_F ≤ σ₁(P_k − J)·‖D_0‖_F: the root-mean-square
consensus error after k rounds is at most σ·(its initial value), where σ is
the largest σ₁(P_k − J) over segments. For doubly stochastic rounds that
σ₁(P_k − J) is the second singular value of P_k (Crossover-SGD's Figure 6). It
is a worst case over initial vectors: a random start decays like ‖P_k − J‖_F/√N,
which is between σ/√N and σ, so the two agree in per-round *rate* up to
log(√N)/k in log terms (see :func:`decay_rate`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Some segments of one node's row of the product, as they were (MixingTracker.snapshot).
Rows = dict[int, np.ndarray]

MAX_TRACKED_N = 1024  # S·N² float64: 32 MB at 4 segments; beyond that the product is too big


class MixingTracker:
    """Rows of P_k per segment, updated by the same snapshots, merges and fold-backs."""

    def __init__(self, nodes: int, segments: int) -> None:
        if nodes > MAX_TRACKED_N:
            raise ValueError(f"tracking {nodes} nodes needs S·N² floats; at most {MAX_TRACKED_N}")
        self.n = nodes
        self.p = np.repeat(np.eye(nodes)[None, :, :], segments, axis=0)

    def snapshot(self, index: int, segments: Sequence[int]) -> Rows:
        return {s: self.p[s, index].copy() for s in segments}

    def blend(self, index: int, segment: int, row: np.ndarray, alpha: float) -> None:
        mine = self.p[segment, index]
        mine *= 1.0 - alpha
        mine += alpha * row

    def sigma(self) -> float:
        """max over segments of σ₁(P_k − J): the bound on rms error(k) / rms error(0)."""
        return max(self._sigma(s) for s in range(len(self.p)))

    def _sigma(self, segment: int) -> float:
        """σ₁(P − J) as the root of the top eigenvalue of the Gram matrix (P − J)(P − J)ᵀ.

        LAPACK's full symmetric solver takes 0.09 s at N = 1,024 on one thread, as fast
        as asking for the top eigenvalue alone, which fails outright ("Internal Error")
        on the identity of round 0; ARPACK's svds needed thousands of iterations when
        the top singular values are nearly equal (early rounds), and a full SVD 0.3 s.
        """
        n = self.n
        if n < 2:
            return 0.0
        m = self.p[segment] - 1.0 / n
        return float(np.sqrt(max(np.linalg.eigvalsh(m @ m.T)[-1], 0.0)))


def predicted_errors(start: float, sigmas: Sequence[float]) -> list[float]:
    """Error after each round predicted from σ₁(P_k − J), scaled from the measured start."""
    return [start * s for s in sigmas]


def decay_rate(errors: Sequence[float], first: int = 1, floor: float = 1e-12) -> float:
    """Geometric-mean factor per round from round ``first`` to the last error above ``floor``."""
    above = [k for k in range(first, len(errors)) if errors[k] > floor]
    if len(above) < 2:
        return 0.0
    a, b = above[0], above[-1]
    return float((errors[b] / errors[a]) ** (1.0 / (b - a)))


def rounds_to(errors: Sequence[float], target: float) -> int | None:
    """The first round whose error is at or below ``target`` (None if none is)."""
    return next((k for k, e in enumerate(errors) if e <= target), None)
