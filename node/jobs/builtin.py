"""The built-in jobs, ``digits`` and ``synthetic``, and the one supervised loop both run:
seeded mini-batches, a loss, an SGD step; frozen (nothing moves) when every lr is 0.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch import nn

from gossipd.node.errors import JobError
from gossipd.node.jobs.data import SPLIT_SEED, digits_split, shard_positions
from gossipd.node.jobs.models import PaddedLinear, digits_model, init_seeded
from gossipd.node.jobs.spec import JobSpec, job_options, positive_int


class _Batches:
    """Endless mini-batches over ``n`` samples, reshuffled each epoch from a seeded generator.

    The incomplete tail of an epoch is dropped, so every batch has the same
    size (BatchNorm and step-time metrics both prefer that).
    """

    def __init__(self, n: int, batch_size: int, seed: int) -> None:
        self.n = n
        self.batch_size = min(batch_size, n)
        self.epoch = 0
        self._gen = torch.Generator().manual_seed(seed)
        self._order = torch.randperm(n, generator=self._gen)
        self._pos = 0

    def next(self) -> torch.Tensor:
        if self._pos + self.batch_size > self.n:
            self._order = torch.randperm(self.n, generator=self._gen)
            self._pos = 0
            self.epoch += 1
        idx = self._order[self._pos : self._pos + self.batch_size]
        self._pos += self.batch_size
        return idx


class SupervisedJob:
    """One loop for every built-in job: a batch, a loss, a step; frozen when all lrs are 0."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    batches: _Batches
    DEFAULT_LR = 0.05
    DEFAULT_BATCH = 32

    def _start_training(self, spec: JobSpec, num_samples: int, momentum: float) -> None:
        if spec.device != "cpu":  # model and data move once; batches are indexed there
            device = torch.device(spec.device)
            self.model.to(device)
            self.train_x, self.train_y = self.train_x.to(device), self.train_y.to(device)
            self.test_x, self.test_y = self.test_x.to(device), self.test_y.to(device)
        lr = self.DEFAULT_LR if spec.learning_rate is None else spec.learning_rate
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=momentum)
        self.batches = _Batches(num_samples, spec.batch_size or self.DEFAULT_BATCH, spec.seed)

    @property
    def batch_size(self) -> int:
        """Samples per step, for ``gossipd_samples_total`` (a plugin job may define it too)."""
        return self.batches.batch_size

    @property
    def steps_per_epoch(self) -> int:
        """Steps in one pass over this node's shard (node-based mode averages at its end)."""
        return self.batches.n // self.batches.batch_size

    @property
    def frozen(self) -> bool:
        """True when no parameter group can move; read each step so a live lr change counts."""
        return all(group["lr"] == 0.0 for group in self.optimizer.param_groups)

    def train_step(self) -> float:
        idx = self.batches.next()
        x, y = self.train_x[idx], self.train_y[idx]
        if self.frozen:
            # No backward, no step, eval mode: parameters and buffers stay bit-identical.
            with _eval_mode(self.model):
                return float(self.loss_fn(self.model(x), y))
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def evaluate(self) -> dict[str, float]:
        with _eval_mode(self.model):
            out = self.model(self.test_x)
            metrics = {"test_loss": float(self.loss_fn(out, self.test_y))}
            if not torch.is_floating_point(self.test_y):
                metrics["test_accuracy"] = float((out.argmax(1) == self.test_y).float().mean())
        return metrics


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """No autograd and eval-mode BatchNorm, so nothing in the model changes; mode restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


class DigitsJob(SupervisedJob):
    """Classify 8x8 digits; each node trains on one shard of the 1437-image train split.

    Options: ``model`` ("mlp" or "cnn"), ``partition`` ("iid" or "by_label").
    ``sample_ids`` and ``test_ids`` are row numbers in ``load_digits()``, for audits.
    """

    def __init__(self, spec: JobSpec) -> None:
        opts = job_options(spec, {"model": "mlp", "partition": "iid"})
        self.spec = spec
        train_ids, test_ids, x, y = digits_split()
        pos = shard_positions(len(train_ids), spec, y[train_ids], opts["partition"])
        self.sample_ids = train_ids[pos]
        self.test_ids = test_ids
        self.train_x = torch.from_numpy(x[self.sample_ids])
        self.train_y = torch.from_numpy(y[self.sample_ids])
        self.test_x = torch.from_numpy(x[test_ids])
        self.test_y = torch.from_numpy(y[test_ids])
        self.model = init_seeded(lambda: digits_model(opts["model"]), spec.seed)
        self.loss_fn = nn.functional.cross_entropy
        self._start_training(spec, len(self.sample_ids), momentum=0.9)


class SyntheticJob(SupervisedJob):
    """Noisy linear regression y = x . w* + noise: fast and exact, for tests and transport benches.

    Options: ``dim`` (features, default 32), ``numel`` (total float32 parameters;
    padded with ``bulk``, e.g. 64M for a 256 MB model), ``samples`` (train pool
    shared out among shards, default 1024), ``noise`` (label noise std, default 0.1).
    The problem (w*, data) is the same on every node; only the init follows the seed.
    Plain SGD without momentum, so the optimizer holds no per-parameter state.
    """

    TEST_SAMPLES = 256

    def __init__(self, spec: JobSpec) -> None:
        opts = job_options(spec, {"dim": 32, "numel": None, "samples": 1024, "noise": 0.1})
        self.spec = spec
        dim = positive_int(spec, "dim", opts["dim"])
        samples = positive_int(spec, "samples", opts["samples"])
        noise = opts["noise"]
        if not isinstance(noise, int | float) or not noise >= 0.0:
            raise JobError(f"job 'synthetic' option 'noise' must be a number >= 0, got {noise!r}")
        bulk_numel = 0
        if opts["numel"] is not None:
            numel = positive_int(spec, "numel", opts["numel"])
            if numel < dim + 1:
                raise JobError(
                    f"job 'synthetic' option 'numel'={numel} is below the {dim + 1} parameters "
                    f"of the dim={dim} head; raise numel or lower dim"
                )
            bulk_numel = numel - (dim + 1)

        data_gen = torch.Generator().manual_seed(SPLIT_SEED)
        w_star = torch.randn(dim, generator=data_gen) / math.sqrt(dim)
        x = torch.randn(samples + self.TEST_SAMPLES, dim, generator=data_gen)
        y = x @ w_star + float(noise) * torch.randn(len(x), generator=data_gen)
        pos = torch.from_numpy(shard_positions(samples, spec, np.zeros(samples), "iid"))
        self.train_x, self.train_y = x[:samples][pos], y[:samples][pos]
        self.test_x, self.test_y = x[samples:], y[samples:]
        self.w_star = w_star

        self.model = init_seeded(lambda: PaddedLinear(dim, bulk_numel), spec.seed)
        self.loss_fn = nn.functional.mse_loss
        self._start_training(spec, len(pos), momentum=0.0)
