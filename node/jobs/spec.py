"""What a node trains (:class:`JobSpec`), what the trainer drives (:class:`Job`), and the
checks every job's spec and options pass before anything is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from gossipd.node.errors import JobError

BUILTIN_JOBS: tuple[str, ...] = ("digits", "mnist1d", "shakespeare", "synthetic")
PLUGIN_SYNTAX = "package.module:factory"


@dataclass(frozen=True)
class JobSpec:
    """What a node trains; every node of a mesh shares it except seed and shard_index."""

    name: str  # a BUILTIN_JOBS name or a plugin "package.module:factory"
    seed: int = 0  # this node's model init and data order
    shard_index: int = 0
    num_shards: int = 1
    learning_rate: float | None = None  # None: the job's default; 0.0: averaging only
    batch_size: int | None = None  # None: the job's default
    options: dict[str, object] = field(default_factory=dict)  # job-specific knobs
    device: str = "cpu"  # "cpu" or "cuda:N": where a built-in job's model and data live


class Job(Protocol):
    """What the trainer drives; the trainer thread alone calls these, between merges.

    A job may also declare the optional members of :class:`DeclaresBatchSize` and
    :class:`DeclaresEpoch` (every built-in job does); one that does not still trains,
    without what they feed.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer

    def train_step(self) -> float: ...

    def evaluate(self) -> dict[str, float]: ...


@runtime_checkable
class DeclaresBatchSize(Protocol):
    """A job that says how many samples one ``train_step`` takes: ``gossipd_samples_total``
    counts them (a job without it counts none)."""

    batch_size: int


@runtime_checkable
class DeclaresEpoch(Protocol):
    """A job that says how many steps one pass over its shard takes: `gossipd mesh up
    --node-based` averages at each epoch's end (a job without it needs ``[gossip.persyn]
    epoch_steps`` in its configs)."""

    steps_per_epoch: int


def batch_size_of(job: Job) -> int:
    """Samples per step of ``job``; 0 where it does not declare them."""
    return job.batch_size if isinstance(job, DeclaresBatchSize) else 0


def steps_per_epoch_of(job: Job) -> int | None:
    """Steps per epoch of ``job``; None where it does not declare them."""
    return job.steps_per_epoch if isinstance(job, DeclaresEpoch) else None


def check_spec(spec: JobSpec) -> None:
    """JobError naming the field if ``spec`` breaks a rule every job relies on."""
    if not isinstance(spec.seed, int) or isinstance(spec.seed, bool):
        raise JobError(f"seed must be an int, got {spec.seed!r}")
    if spec.num_shards < 1:
        raise JobError(f"num_shards must be >= 1, got {spec.num_shards}")
    if not 0 <= spec.shard_index < spec.num_shards:
        raise JobError(
            f"shard_index {spec.shard_index} is outside 0..{spec.num_shards - 1}; "
            f"pick a shard below num_shards={spec.num_shards}"
        )
    lr = spec.learning_rate
    if lr is not None and not (math.isfinite(lr) and lr >= 0.0):
        raise JobError(f"learning_rate must be finite and >= 0 (0.0 = averaging only), got {lr}")
    if spec.batch_size is not None and spec.batch_size < 1:
        raise JobError(f"batch_size must be >= 1, got {spec.batch_size}")
    if spec.device != "cpu":
        _check_cuda(spec.device)


def _check_cuda(device: str) -> None:
    if not device.startswith("cuda"):
        raise JobError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
    if not torch.cuda.is_available():
        raise JobError(
            f"job.device = {device!r} but torch sees no GPU (a CPU build of torch, or no "
            "driver); use job.device = 'cpu' or install torch's CUDA build"
        )
    index = torch.device(device).index or 0
    if index >= torch.cuda.device_count():
        raise JobError(
            f"job.device = {device!r} but only {torch.cuda.device_count()} GPU(s) are visible"
        )


def job_options(spec: JobSpec, defaults: dict[str, object]) -> dict[str, object]:
    """Merge ``spec.options`` over ``defaults``; reject unknown keys so a typo is not ignored."""
    unknown = sorted(set(spec.options) - set(defaults))
    if unknown:
        raise JobError(
            f"job {spec.name!r} has no option(s) {', '.join(unknown)}; "
            f"known options: {', '.join(sorted(defaults))}"
        )
    return {**defaults, **spec.options}


def positive_int(spec: JobSpec, key: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise JobError(f"job {spec.name!r} option {key!r} must be a positive int, got {value!r}")
    return value
