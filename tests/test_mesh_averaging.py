"""Pure averaging on real daemons (learning rate 0): every protocol computes the mean.

With training off, Σ wᵢ·xᵢ / Σ wᵢ never changes (each push is acknowledged before
its weight is committed, whatever protocol chose it), so every node must end at
the mean of the initial models, and the sum of weights must still be N. A protocol
without sum-weights (overlap: each pull averages the puller with a peer's copy,
row- but not column-stochastic) must still reach consensus, at a point every
coordinate of which lies between the initial models' (a convex combination).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gossipd.node.launch.localmesh import consensus_distance
from gossipd.node.protocols import PROTOCOLS, keeps_weights
from tests.averaging import average, averaging_spec


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_learning_rate_zero_mesh_converges_to_mean_of_initial_models(
    tmp_path: Path, protocol: str
) -> None:
    run = average(averaging_spec(protocol), tmp_path)
    initial, states, models, codes = run.initial, run.states, run.models, run.codes
    target = torch.stack(initial).mean(0)

    assert codes == [0, 0, 0]
    assert {s["protocol"] for s in states} == {protocol}
    assert all(s["round"] > 0 for s in states), [s["round"] for s in states]
    assert consensus_distance(initial) > 0.5
    # How far consensus gets depends on how many rounds the three nodes' 3,000 steps
    # overlap, which a loaded machine shortens: pushsum-expgraph (not exact at N = 3)
    # ended at 1.6e-6 in one CI run. The claim under test is the mean, checked below.
    assert consensus_distance(models) < 1e-5
    if not keeps_weights(protocol):
        stacked = torch.stack(initial)
        low, high = stacked.min(0).values, stacked.max(0).values
        slack = 1e-6 * float(stacked.abs().max())
        for model in models:
            assert bool(((model >= low - slack) & (model <= high + slack)).all())
        return
    weights = [s["sum_weights"][0] for s in states]
    assert sum(weights) == pytest.approx(3.0, abs=1e-12)
    weighted = sum(w * m for w, m in zip(weights, models, strict=True)) / sum(weights)
    assert float((weighted - target).norm() / target.norm()) < 1e-6
    for model in models:
        assert float((model - target).norm() / target.norm()) < 2e-5  # consensus + mean
