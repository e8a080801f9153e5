"""The documented import path of the jobs (docs/library.md): plugins written before the
jobs had a room of their own import ``JobSpec`` from here. The jobs live in
:mod:`gossipd.node.jobs`; this re-exports what :mod:`gossipd.node.jobs.registry` does."""

from gossipd.node.jobs.registry import (
    BUILTIN_JOBS,
    PLUGIN_SYNTAX,
    DeclaresBatchSize,
    DeclaresEpoch,
    DigitsJob,
    Job,
    JobSpec,
    SyntheticJob,
    build_job,
    stratified_split,
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
