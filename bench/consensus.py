"""The consensus of a gossip run: the model its sites agree on, scored on each site's data.

Each site ends with its own model, drifted towards its own data since its last merges;
what the mesh converges to once training stops is their average weighted by the
sum-weights, per segment (Σ wᵢ·xᵢ / Σ wᵢ: what push-sum gossip preserves). A site's
weight is how much its data counts in that average, so this is where "each site's data
counts alike" is tested: a site left with little weight leaves a consensus that scores
poorly on its classes, whatever its own model scores.

Read from the checkpoints the sites wrote at exit (``checkpoint.pt``: segments and
sum-weights). Scored per site on the held-out samples of the classes that site trains
on (a label-skewed job: digits, mnist1d); a job without classes gets the overall metric
only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from gossipd.node.jobs.registry import Job, JobSpec, build_job
from gossipd.node.model.segments import FlatModel
from gossipd.node.trainer import checkpoint


@dataclass(frozen=True)
class ConsensusScores:
    """``weights``: each site's share of Σw (mean over segments, × the number of sites);
    ``consensus``: the weighted average's accuracy on each site's classes; ``own``: each
    site's final model on its own classes; ``overall``: the weighted average's metric on
    the whole held-out set (``evaluate``)."""

    weights: list[float]
    consensus: list[float] = field(default_factory=list)
    own: list[float] = field(default_factory=list)
    overall: dict[str, float] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {
            "weight_shares": self.weights,
            "consensus_on_site_classes": self.consensus,
            "own_model_on_site_classes": self.own,
            "consensus_overall": self.overall,
        }


def weighted_average(
    segments: list[list[torch.Tensor]], weights: list[list[float]]
) -> list[torch.Tensor]:
    """Per segment, Σ wᵢ·xᵢ / Σ wᵢ over the sites (float64, then the segments' dtype)."""
    averaged = []
    for s in range(len(segments[0])):
        total = sum(w[s] for w in weights)
        if not total > 0:
            raise ValueError(f"segment {s}: the sites' sum-weights add up to {total}")
        mixed = sum(w[s] * seg[s].double() for seg, w in zip(segments, weights, strict=True))
        averaged.append((mixed / total).to(segments[0][s].dtype))
    return averaged


@runtime_checkable
class LabelledJob(Protocol):
    """A job that keeps its data as samples and labels: what scoring on a site's classes
    reads (the built-in jobs do; their labels are class tensors in digits and mnist1d)."""

    train_y: object
    test_x: object
    test_y: object


def _has_classes(job: Job) -> bool:
    """Labelled classes in tensors (digits, mnist1d); not text windows or regression."""
    if not isinstance(job, LabelledJob):
        return False
    labels = [job.train_y, job.test_y]
    tensors = all(isinstance(y, torch.Tensor) and not torch.is_floating_point(y) for y in labels)
    return tensors and isinstance(job.test_x, torch.Tensor)


def _accuracy_on(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        model.eval()
        return float((model(x).argmax(dim=1) == y).double().mean()) if len(y) else float("nan")


def score(
    job: str,
    options: dict[str, Any],
    checkpoints: list[Path],
    segment_bytes: int,
) -> ConsensusScores:
    """The consensus of the sites whose final checkpoints are ``checkpoints`` (site i is
    shard i of their number, as ``gossipd bench wan`` and ``mesh up`` split a job)."""
    n = len(checkpoints)
    jobs = [
        build_job(JobSpec(job, seed=i, shard_index=i, num_shards=n, options=options))
        for i in range(n)
    ]
    flats = [FlatModel(j.model, segment_bytes) for j in jobs]
    saved = [checkpoint.load(p, fingerprint=flats[0].fingerprint) for p in checkpoints]
    weights = [list(c.weights) for c in saved]
    mean_weight = sum(sum(w) for w in weights) / (n * len(weights[0]))
    shares = [sum(w) / len(w) / mean_weight for w in weights]
    averaged = weighted_average([c.segments for c in saved], weights)
    result = ConsensusScores(shares)
    # Its own job: the sites' jobs get their own final models below, and site 0's would
    # otherwise become the "consensus" every later site is scored with.
    agreed = build_job(JobSpec(job, seed=0, shard_index=0, num_shards=n, options=options))
    agreed_flat = FlatModel(agreed.model, segment_bytes)
    for s, values in enumerate(averaged):
        agreed_flat.load_segment(s, values)
    result.overall.update(agreed.evaluate())
    if not all(_has_classes(j) for j in jobs):
        return result
    for i, site in enumerate(jobs):
        mask = torch.isin(site.test_y, torch.unique(site.train_y))
        x, y = site.test_x[mask], site.test_y[mask]
        result.consensus.append(_accuracy_on(agreed.model, x, y))
        for s, values in enumerate(saved[i].segments):
            flats[i].load_segment(s, values)
        result.own.append(_accuracy_on(site.model, x, y))
    return result
