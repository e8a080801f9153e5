"""The consensus `gossipd bench wan` scores: the sites' final models averaged by weight.

Built from real checkpoints of real digits jobs (two label-skewed shards), written the
way a site writes them at exit.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from gossipd.bench.consensus import score, weighted_average
from gossipd.node.jobs.registry import JobSpec, build_job
from gossipd.node.model.segments import FlatModel
from gossipd.node.trainer import checkpoint

SEGMENT_BYTES = 1024  # several segments, so the average is taken per segment
BY_LABEL = {"partition": "by_label"}  # site 0 holds digits 0-4, site 1 digits 5-9


def _write_sites(tmp_path: Path, weights: list[float], steps: int) -> list[Path]:
    """Two digits sites, each trained ``steps`` steps on its own shard, saved with
    ``weights`` as every segment's sum-weight."""
    paths = []
    for i, weight in enumerate(weights):
        spec = JobSpec("digits", seed=i, shard_index=i, num_shards=len(weights), options=BY_LABEL)
        job = build_job(spec)
        flat = FlatModel(job.model, SEGMENT_BYTES)
        for _ in range(steps):
            job.train_step()
        segments = [b.clone() for b in flat.buffers]
        saved = checkpoint.Checkpoint(
            node_id=f"site-{i}",
            fingerprint=flat.fingerprint,
            step=steps,
            core={},
            segments=segments,
            weights=[weight] * len(segments),
        )
        directory = tmp_path / f"site-{i}"
        directory.mkdir()
        paths.append(checkpoint.save(directory, saved))
    return paths


def test_the_average_is_taken_per_segment_by_weight() -> None:
    a = [torch.tensor([1.0, 1.0]), torch.tensor([4.0])]
    b = [torch.tensor([3.0, 5.0]), torch.tensor([0.0])]
    mixed = weighted_average([a, b], [[1.0, 3.0], [1.0, 1.0]])
    assert torch.equal(mixed[0], torch.tensor([2.0, 3.0]))
    assert torch.equal(mixed[1], torch.tensor([3.0]))
    with pytest.raises(ValueError, match="add up to 0"):
        weighted_average([a, b], [[0.0, 1.0], [0.0, 1.0]])


def test_a_site_holding_all_the_weight_is_the_consensus(tmp_path: Path) -> None:
    """Site 1 holds nothing: the consensus is site 0's model, so it scores on each site's
    classes exactly as site 0's own model does, well on site 0's and poorly on site 1's."""
    scores = score("digits", BY_LABEL, _write_sites(tmp_path, [2.0, 0.0], steps=150), SEGMENT_BYTES)
    assert scores.weights == [2.0, 0.0]
    assert scores.consensus[0] == scores.own[0]
    assert scores.consensus[0] > 0.8 and scores.consensus[1] < 0.5
    assert 0.0 <= scores.overall["test_accuracy"] <= 1.0


def test_every_site_is_scored_with_the_consensus_not_an_earlier_sites_own_model(
    tmp_path: Path,
) -> None:
    """Site 0 holds nothing, so the consensus is site 1's model, on site 0's classes as on
    site 1's: scoring site 0's own model must not replace it before site 1 is scored."""
    scores = score("digits", BY_LABEL, _write_sites(tmp_path, [0.0, 2.0], steps=150), SEGMENT_BYTES)
    assert scores.consensus[1] == scores.own[1] > 0.8
    assert scores.consensus[0] < 0.5 < scores.own[0]


def test_weights_shared_evenly_leave_a_consensus_of_both(tmp_path: Path) -> None:
    scores = score("digits", BY_LABEL, _write_sites(tmp_path, [1.0, 1.0], steps=150), SEGMENT_BYTES)
    assert scores.weights == [1.0, 1.0]
    assert len(scores.consensus) == len(scores.own) == 2
    assert all(0.0 <= s <= 1.0 for s in [*scores.consensus, *scores.own])
    assert scores.as_json()["weight_shares"] == [1.0, 1.0]


def test_a_job_without_classes_gets_the_overall_metric_only(tmp_path: Path) -> None:
    """The synthetic job's targets are real numbers (shakespeare's are text windows): no
    site has classes to score on, so only the consensus's own metrics are given."""
    paths = []
    for i in range(2):
        job = build_job(JobSpec("synthetic", seed=i, shard_index=i, num_shards=2))
        flat = FlatModel(job.model, SEGMENT_BYTES)
        saved = checkpoint.Checkpoint(
            node_id=f"site-{i}",
            fingerprint=flat.fingerprint,
            step=0,
            core={},
            segments=[b.clone() for b in flat.buffers],
            weights=[1.0] * len(flat.buffers),
        )
        (tmp_path / f"site-{i}").mkdir()
        paths.append(checkpoint.save(tmp_path / f"site-{i}", saved))
    scores = score("synthetic", {}, paths, SEGMENT_BYTES)
    assert scores.consensus == [] and scores.own == []
    assert math.isfinite(scores.overall["test_loss"])
