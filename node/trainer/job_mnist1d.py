"""The built-in ``mnist1d`` job: 1-D digit signals from the ``mnist1d`` package's own
generator, so nothing is downloaded and every site builds the same 4,000 + 1,000 samples.

MNIST-1D (Greydanus and Kobak, 2020) was made for what the digits job cannot show: its
classes overlap, a linear model reaches about 0.32 and the package's CNN about 0.94 on
4,000 training samples, so a site holding a few classes cannot learn the rest alone and
averaging has real work to do.
"""

from __future__ import annotations

import functools
import random

import numpy as np
import torch
from torch import nn

from gossipd.node.errors import JobError
from gossipd.node.trainer.builtin_jobs import SupervisedJob
from gossipd.node.trainer.job_data import shard_positions
from gossipd.node.trainer.job_models import init_seeded
from gossipd.node.trainer.job_packages import check_job_package
from gossipd.node.trainer.job_spec import JobSpec, job_options

SIGNAL_LENGTH = 40
CLASSES = 10


@functools.cache
def mnist1d_data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train x, train y, test x, test y) from ``make_dataset`` with its default arguments
    (seed 42): the package's standard split. Never ``get_dataset``, which downloads.

    The generator seeds Python's and NumPy's global generators; their states are put back
    after, so building this job moves no other code's random numbers.
    """
    check_job_package("mnist1d")
    from mnist1d.data import get_dataset_args, make_dataset

    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        data = make_dataset(get_dataset_args())
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
    return (
        data["x"].astype(np.float32),
        data["y"].astype(np.int64),
        data["x_test"].astype(np.float32),
        data["y_test"].astype(np.int64),
    )


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
