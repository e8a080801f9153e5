"""The built-in jobs' data: the digits set read from scikit-learn's bundled file, its
stratified train/test split, and each node's shard. Every split is fixed by
:data:`SPLIT_SEED`, so the test set and the shards agree across the mesh.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from pathlib import Path

import numpy as np

from gossipd.node.errors import JobError
from gossipd.node.jobs.spec import JobSpec

SPLIT_SEED = 0  # fixed on every node: the test set and shards must agree across the mesh


def shard_positions(n: int, spec: JobSpec, labels: np.ndarray, partition: object) -> np.ndarray:
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
        order = np.random.default_rng(SPLIT_SEED).permutation(n)
    elif partition == "by_label":
        order = np.argsort(labels, kind="stable")
    else:
        raise JobError(f"option 'partition' must be 'iid' or 'by_label', got {partition!r}")
    return np.sort(np.array_split(order, spec.num_shards)[spec.shard_index])


@functools.cache
def digits_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train_ids, test_ids, features in [0,1], labels); a stratified 20% test, same everywhere.

    The data is scikit-learn's bundled ``digits.csv.gz``, read without importing
    scikit-learn: its import (scipy and all) was about a second of every digits node's
    start on a 2-core VM, a quarter of it. The split is :func:`stratified_split`.
    """
    data = np.loadtxt(_digits_csv(), delimiter=",")
    x = (data[:, :-1] / 16.0).astype(np.float32)
    y = data[:, -1].astype(np.int64)
    train_ids, test_ids = stratified_split(y, test_fraction=0.2, seed=SPLIT_SEED)
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
