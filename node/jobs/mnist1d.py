"""The built-in ``mnist1d`` job: 1-D digit signals from the ``mnist1d`` package's own
generator, so nothing is downloaded and every site builds the same 4,000 + 1,000 samples.

MNIST-1D (Greydanus and Kobak, 2020) was made for what the digits job cannot show: its
classes overlap, a linear model reaches about 0.32 and the package's CNN about 0.94 on
4,000 training samples, so a site holding a few classes cannot learn the rest alone and
averaging has real work to do.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
import random
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

from gossipd.node.errors import JobError
from gossipd.node.jobs.builtin import SupervisedJob
from gossipd.node.jobs.data import shard_positions
from gossipd.node.jobs.models import init_seeded
from gossipd.node.jobs.packages import check_job_package
from gossipd.node.jobs.spec import JobSpec, job_options

SIGNAL_LENGTH = 40
CLASSES = 10
log = logging.getLogger(__name__)


MNIST1D_SHAPES = {"x": (4000, 40), "y": (4000,), "x_test": (1000, 40), "y_test": (1000,)}


@functools.cache
def mnist1d_data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train x, train y, test x, test y) from ``make_dataset`` with its default arguments
    (seed 42): the package's standard split. Never ``get_dataset``, which downloads.

    Generating it costs about 5.5 s of CPU (1.5 s importing the package), every time a
    site starts: the arrays are kept in :func:`cache_path` after the first time and read
    from there (a few milliseconds). The generator seeds Python's and NumPy's global
    generators; their states are put back after, so building this job moves no other
    code's random numbers.
    """
    check_job_package("mnist1d")
    path = cache_path()
    arrays = read_cached(path) if path is not None else None
    if arrays is None:
        arrays = _generate()
        if path is not None:
            write_cached(path, arrays)
    return (
        arrays["x"].astype(np.float32),
        arrays["y"].astype(np.int64),
        arrays["x_test"].astype(np.float32),
        arrays["y_test"].astype(np.int64),
    )


def _generate() -> dict[str, np.ndarray]:
    from mnist1d.data import get_dataset_args, make_dataset

    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        data = make_dataset(get_dataset_args())
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
    return {name: np.asarray(data[name]) for name in MNIST1D_SHAPES}


def cache_path() -> Path | None:
    """Where the generated set is kept: ``$XDG_CACHE_HOME/gossipd`` (``~/.cache/gossipd``),
    one file per ``mnist1d`` release (its generator is the release's); None without one."""
    try:
        version = importlib.metadata.version("mnist1d")
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    except (importlib.metadata.PackageNotFoundError, RuntimeError):
        return None
    return base / "gossipd" / f"mnist1d-{version}-default.npz"


def read_cached(path: Path) -> dict[str, np.ndarray] | None:
    """The cached arrays, or None if there are none or they are not the set's shapes (a
    damaged file is generated again and replaced)."""
    try:
        with np.load(path, allow_pickle=False) as stored:
            arrays = {name: stored[name] for name in MNIST1D_SHAPES}
    except (OSError, ValueError, KeyError) as err:
        if path.exists():
            log.info(
                "mnist1d: the cached set %s is unreadable (%s): generating it again", path, err
            )
        return None
    if any(arrays[name].shape != shape for name, shape in MNIST1D_SHAPES.items()):
        log.info("mnist1d: the cached set %s has other shapes: generating it again", path)
        return None
    return arrays


def write_cached(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Keep the arrays at ``path``, written whole under another name then renamed, so
    sites starting together never read half a file. A cache that cannot be written (a
    read-only home) costs only the next start its 5.5 s."""
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".npz", delete=False) as file:
            tmp = file.name
            np.savez(file, **arrays)
        os.replace(tmp, path)
    except OSError as err:
        log.debug("mnist1d: not caching the generated set at %s: %s", path, err)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


class _Conv1dNet(nn.Module):
    """The MNIST-1D paper's CNN: three strided 1-D convolutions of 25 channels, a linear head
    (5,210 parameters)."""

    def __init__(self, channels: int = 25) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(1, channels, 5, stride=2, padding=1)
        self.conv2 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        self.conv3 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        self.head = nn.Linear(channels * 5, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x.unsqueeze(1)))
        x = torch.relu(self.conv2(x))
        x = torch.relu(self.conv3(x))
        return self.head(x.flatten(1))


def mnist1d_model(kind: object) -> nn.Module:
    if kind == "cnn":
        return _Conv1dNet()
    if kind == "mlp":
        return nn.Sequential(
            nn.Linear(SIGNAL_LENGTH, 100),
            nn.ReLU(),
            nn.Linear(100, 100),
            nn.ReLU(),
            nn.Linear(100, CLASSES),
        )
    raise JobError(f"job 'mnist1d' option 'model' must be 'cnn' or 'mlp', got {kind!r}")


class Mnist1dJob(SupervisedJob):
    """Classify MNIST-1D signals; each node trains on one shard of the 4,000 training samples.

    Options: ``model`` ("cnn", the default, or "mlp"), ``partition`` ("by_label", the
    default: each site holds a few classes, or "iid"). The 1,000 test samples are the same
    on every site, so a site's accuracy is over all ten classes.
    """

    DEFAULT_LR = 0.05
    DEFAULT_BATCH = 64

    def __init__(self, spec: JobSpec) -> None:
        opts = job_options(spec, {"model": "cnn", "partition": "by_label"})
        self.spec = spec
        model_kind = opts["model"]
        mnist1d_model(model_kind)  # a bad option fails before the data is generated
        x, y, test_x, test_y = mnist1d_data()
        pos = shard_positions(len(y), spec, y, opts["partition"])
        self.sample_ids = pos
        self.train_x, self.train_y = torch.from_numpy(x[pos]), torch.from_numpy(y[pos])
        self.test_x, self.test_y = torch.from_numpy(test_x), torch.from_numpy(test_y)
        self.model = init_seeded(lambda: mnist1d_model(model_kind), spec.seed)
        self.loss_fn = nn.functional.cross_entropy
        self._start_training(spec, len(pos), momentum=0.9)
