"""Training jobs: what one node trains, on which shard, from which initial model.

A job bundles a model, its optimizer, this node's data shard and a held-out test
set behind two verbs, ``train_step`` and ``evaluate``, so the trainer thread and
the simulator can drive any workload the same way. Built-in jobs need no
download (``digits`` uses scikit-learn's bundled copy) and are deterministic:
the data split depends only on the job, the initial model and data order only on
``JobSpec.seed``. Users plug their own job in as ``"package.module:factory"``.

With every learning rate at 0.0 a step changes nothing in the model, not even
BatchNorm statistics, so gossip alone moves it ("training off" in the
consensus tests).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torch import nn

from gossipd.node.errors import JobError

BUILTIN_JOBS: tuple[str, ...] = ("digits", "synthetic")
PLUGIN_SYNTAX = "package.module:factory"
_SPLIT_SEED = 0  # fixed on every node: the test set and shards must agree across the mesh


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
    """What the trainer drives; the trainer thread alone calls these, between merges."""

    model: nn.Module
    optimizer: torch.optim.Optimizer

    def train_step(self) -> float: ...

    def evaluate(self) -> dict[str, float]: ...


def build_job(spec: JobSpec) -> Job:
    """Build the job ``spec`` names, after checking the fields every job relies on."""
    _check_spec(spec)
    if ":" in spec.name:
        return _build_plugin(spec)
    builders: dict[str, Callable[[JobSpec], Job]] = {"digits": DigitsJob, "synthetic": SyntheticJob}
    if spec.name not in builders:
        raise JobError(
            f"unknown job {spec.name!r}: use one of {', '.join(BUILTIN_JOBS)}, "
            f"or a plugin written as '{PLUGIN_SYNTAX}'"
        )
    return builders[spec.name](spec)


def _check_spec(spec: JobSpec) -> None:
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


def _options(spec: JobSpec, defaults: dict[str, object]) -> dict[str, object]:
    """Merge ``spec.options`` over ``defaults``; reject unknown keys so a typo is not ignored."""
    unknown = sorted(set(spec.options) - set(defaults))
    if unknown:
        raise JobError(
            f"job {spec.name!r} has no option(s) {', '.join(unknown)}; "
            f"known options: {', '.join(sorted(defaults))}"
        )
    return {**defaults, **spec.options}


def _positive_int(spec: JobSpec, key: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise JobError(f"job {spec.name!r} option {key!r} must be a positive int, got {value!r}")
    return value


def _shard_positions(n: int, spec: JobSpec, labels: np.ndarray, partition: object) -> np.ndarray:
    """Positions (into the train split) of this node's shard; shards are disjoint and cover it.

    ``iid`` deals a fixed permutation out in equal slices; ``by_label`` sorts by
    label first, so each node sees few classes (the hard, non-IID case).
    """
    if spec.num_shards > n:
        raise JobError(
            f"num_shards={spec.num_shards} exceeds the {n} training samples of job "
            f"{spec.name!r}; use at most {n} shards"
        )
    if partition == "iid":
        order = np.random.default_rng(_SPLIT_SEED).permutation(n)
    elif partition == "by_label":
        order = np.argsort(labels, kind="stable")
    else:
        raise JobError(f"option 'partition' must be 'iid' or 'by_label', got {partition!r}")
    return np.sort(np.array_split(order, spec.num_shards)[spec.shard_index])


def _init_seeded(build: Callable[[], nn.Module], seed: int) -> nn.Module:
    """Build a model whose initial weights depend on ``seed`` alone.

    Modules are created on the meta device (no RNG drawn, no memory touched),
    then Linear/Conv weights are drawn from a private generator with torch's
    default distributions, and other modules (BatchNorm) reset to their fixed
    defaults. The global RNG is neither read nor moved, so building a job on one
    thread cannot shift another thread's random numbers.
    """
    with torch.device("meta"):
        model = build()
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear | nn.Conv2d):
                nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5), generator=gen)
                if module.bias is not None:
                    bound = 1.0 / math.sqrt(module.weight[0].numel())
                    nn.init.uniform_(module.bias, -bound, bound, generator=gen)
            elif isinstance(module, nn.BatchNorm1d | nn.BatchNorm2d):
                module.reset_parameters()
            elif isinstance(module, _PaddedLinear) and module.bulk is not None:
                module.bulk.uniform_(-0.05, 0.05, generator=gen)  # 6x faster than normal_
    return model


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


class _SupervisedJob:
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


@functools.cache
def _digits_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train_ids, test_ids, features in [0,1], labels); a stratified 20% test, same everywhere.

    The data is scikit-learn's bundled ``digits.csv.gz``, read without importing
    scikit-learn: its import (scipy and all) was about a second of every digits node's
    start on a 2-core VM, a quarter of it. The split is :func:`stratified_split`.
    """
    data = np.loadtxt(_digits_csv(), delimiter=",")
    x = (data[:, :-1] / 16.0).astype(np.float32)
    y = data[:, -1].astype(np.int64)
    train_ids, test_ids = stratified_split(y, test_fraction=0.2, seed=_SPLIT_SEED)
    for a in (train_ids, test_ids, x, y):
        a.flags.writeable = False
    return train_ids, test_ids, x, y


def _digits_csv() -> Path:
    spec = importlib.util.find_spec("sklearn")  # finds the package; runs none of it
    if spec is None or not spec.submodule_search_locations:
        raise JobError("job 'digits' reads scikit-learn's bundled digits; install scikit-learn")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():
        raise JobError(f"job 'digits': scikit-learn's bundled data is missing ({path})")
    return path


def stratified_split(
    y: np.ndarray, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Row indices (train, test) with each label's share kept: scikit-learn's
    ``train_test_split(arange(n), test_size=test_fraction, random_state=seed, stratify=y)``
    draw for draw (StratifiedShuffleSplit as of scikit-learn 1.9), so the digits job's
    split is the one it always had and no longer depends on the installed release."""
    n = len(y)
    n_test = math.ceil(test_fraction * n)
    n_train = n - n_test
    classes, y_indices = np.unique(y, return_inverse=True)
    class_counts = np.bincount(y_indices)
    class_indices = np.split(np.argsort(y_indices, kind="mergesort"), np.cumsum(class_counts)[:-1])
    rng = np.random.RandomState(seed)
    n_i = _approximate_mode(class_counts, n_train, rng)
    t_i = _approximate_mode(class_counts - n_i, n_test, rng)
    train: list[int] = []
    test: list[int] = []
    for i in range(len(classes)):
        permutation = rng.permutation(class_counts[i])
        members = class_indices[i].take(permutation, mode="clip")
        train.extend(members[: n_i[i]])
        test.extend(members[n_i[i] : n_i[i] + t_i[i]])
    return rng.permutation(train), rng.permutation(test)


def _approximate_mode(
    class_counts: np.ndarray, n_draws: int, rng: np.random.RandomState
) -> np.ndarray:
    """How many of ``n_draws`` each class gets: its floored share, the rest handed out by
    largest remainder, ties broken at random (scikit-learn's ``_approximate_mode``)."""
    continuous = class_counts / class_counts.sum() * n_draws
    floored = np.floor(continuous)
    need_to_add = int(n_draws - floored.sum())
    if need_to_add > 0:
        remainder = continuous - floored
        for value in np.sort(np.unique(remainder))[::-1]:
            (inds,) = np.where(remainder == value)
            add_now = min(len(inds), need_to_add)
            inds = rng.choice(inds, size=add_now, replace=False)
            floored[inds] += 1
            need_to_add -= add_now
            if need_to_add == 0:
                break
    return floored.astype(int)


def _digits_model(kind: object) -> nn.Module:
    if kind == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    if kind == "cnn":
        # BatchNorm gives the model floating buffers, which gossip must average too.
        return nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),
            nn.Conv2d(1, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(16 * 4 * 4, 10),
        )
    raise JobError(f"job 'digits' option 'model' must be 'mlp' or 'cnn', got {kind!r}")


class DigitsJob(_SupervisedJob):
    """Classify 8x8 digits; each node trains on one shard of the 1437-image train split.

    Options: ``model`` ("mlp" or "cnn"), ``partition`` ("iid" or "by_label").
    ``sample_ids`` and ``test_ids`` are row numbers in ``load_digits()``, for audits.
    """

    def __init__(self, spec: JobSpec) -> None:
        opts = _options(spec, {"model": "mlp", "partition": "iid"})
        self.spec = spec
        train_ids, test_ids, x, y = _digits_split()
        pos = _shard_positions(len(train_ids), spec, y[train_ids], opts["partition"])
        self.sample_ids = train_ids[pos]
        self.test_ids = test_ids
        self.train_x = torch.from_numpy(x[self.sample_ids])
        self.train_y = torch.from_numpy(y[self.sample_ids])
        self.test_x = torch.from_numpy(x[test_ids])
        self.test_y = torch.from_numpy(y[test_ids])
        self.model = _init_seeded(lambda: _digits_model(opts["model"]), spec.seed)
        self.loss_fn = nn.functional.cross_entropy
        self._start_training(spec, len(self.sample_ids), momentum=0.9)


class _PaddedLinear(nn.Module):
    """A regression head plus an optional ``bulk`` vector that only pads the parameter count.

    ``bulk`` never enters the loss, so it gets no gradient and the optimizer skips
    it: memory stays at one copy of the model, a step costs the same at 64M
    parameters as at 33, and only gossip changes ``bulk`` (handy for checking
    that averaging reaches the mean of the initial vectors).
    """

    def __init__(self, dim: int, bulk_numel: int) -> None:
        super().__init__()
        self.head = nn.Linear(dim, 1)
        self.bulk = nn.Parameter(torch.empty(bulk_numel)) if bulk_numel > 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x).squeeze(-1)


class SyntheticJob(_SupervisedJob):
    """Noisy linear regression y = x . w* + noise: fast and exact, for tests and transport benches.

    Options: ``dim`` (features, default 32), ``numel`` (total float32 parameters;
    padded with ``bulk``, e.g. 64M for a 256 MB model), ``samples`` (train pool
    shared out among shards, default 1024), ``noise`` (label noise std, default 0.1).
    The problem (w*, data) is the same on every node; only the init follows the seed.
    Plain SGD without momentum, so the optimizer holds no per-parameter state.
    """

    TEST_SAMPLES = 256

    def __init__(self, spec: JobSpec) -> None:
        opts = _options(spec, {"dim": 32, "numel": None, "samples": 1024, "noise": 0.1})
        self.spec = spec
        dim = _positive_int(spec, "dim", opts["dim"])
        samples = _positive_int(spec, "samples", opts["samples"])
        noise = opts["noise"]
        if not isinstance(noise, int | float) or not noise >= 0.0:
            raise JobError(f"job 'synthetic' option 'noise' must be a number >= 0, got {noise!r}")
        bulk_numel = 0
        if opts["numel"] is not None:
            numel = _positive_int(spec, "numel", opts["numel"])
            if numel < dim + 1:
                raise JobError(
                    f"job 'synthetic' option 'numel'={numel} is below the {dim + 1} parameters "
                    f"of the dim={dim} head; raise numel or lower dim"
                )
            bulk_numel = numel - (dim + 1)

        data_gen = torch.Generator().manual_seed(_SPLIT_SEED)
        w_star = torch.randn(dim, generator=data_gen) / math.sqrt(dim)
        x = torch.randn(samples + self.TEST_SAMPLES, dim, generator=data_gen)
        y = x @ w_star + float(noise) * torch.randn(len(x), generator=data_gen)
        pos = torch.from_numpy(_shard_positions(samples, spec, np.zeros(samples), "iid"))
        self.train_x, self.train_y = x[:samples][pos], y[:samples][pos]
        self.test_x, self.test_y = x[samples:], y[samples:]
        self.w_star = w_star

        self.model = _init_seeded(lambda: _PaddedLinear(dim, bulk_numel), spec.seed)
        self.loss_fn = nn.functional.mse_loss
        self._start_training(spec, len(pos), momentum=0.0)


_REQUIRED: dict[str, type | None] = {  # attribute -> its type; None: any callable
    "model": nn.Module, "optimizer": torch.optim.Optimizer, "train_step": None, "evaluate": None
}  # fmt: skip


def _build_plugin(spec: JobSpec) -> Job:
    module_name, _, factory_name = spec.name.partition(":")
    if not module_name or not factory_name or ":" in factory_name:
        raise JobError(f"plugin job {spec.name!r} must be written as '{PLUGIN_SYNTAX}'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise JobError(
            f"cannot import plugin module {module_name!r} for job {spec.name!r}: "
            f"{type(exc).__name__}: {exc}; check the module is installed or on PYTHONPATH"
        ) from exc
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        what = "is missing" if factory is None else f"is a {type(factory).__name__}, not callable"
        raise JobError(
            f"plugin module {module_name!r} attribute {factory_name!r} {what}; "
            f"point the job at a function taking a JobSpec and returning a job"
        )
    try:
        job = factory(spec)
    except JobError:
        raise
    except Exception as exc:
        raise JobError(f"plugin factory {spec.name!r} raised {type(exc).__name__}: {exc}") from exc

    problems = []
    for attr, kind in _REQUIRED.items():
        value = getattr(job, attr, None)
        if value is None:
            problems.append(f"missing {attr!r}")
        elif kind is not None and not isinstance(value, kind):
            problems.append(f"{attr!r} is a {type(value).__name__}, not a {kind.__name__}")
        elif kind is None and not callable(value):
            problems.append(f"{attr!r} is not callable")
    if problems:
        raise JobError(
            f"plugin factory {spec.name!r} returned a {type(job).__name__} that is not a job: "
            f"{'; '.join(problems)}; return an object with model, optimizer, train_step(), "
            f"evaluate()"
        )
    return job
