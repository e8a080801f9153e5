"""The real half of `gossipd bench overlap`: 4 `gossipd node` processes, one mode at a time.

Each mode runs a fresh local mesh (:func:`gossipd.node.launch.launcher.run_mesh`, mutual
TLS, a `gossipd coordinator` process beside it for the coordinated mode) for the
same wall-clock budget, one after another: side by side they would share two
cores and time each other. Every node's ``[link]`` shapes its sends (the test
knob), so a pull pays the puller's latency for its request and the server's
latency plus S/R for the model: slow enough that it takes a good part of a period.

The job is :func:`paced_digits`: the real digits MLP, trained for real, plus a
fixed wait per step that stands for the compute of a heavier model on an
accelerator (the CPU idles meanwhile, as it does while a GPU computes). A step
that long is what scheduled overlap needs to hide a pull behind; four trainers
doing that much real CPU work on two cores would instead fight over them, and
their step times would be the machine's load, not the model's.
"""

from __future__ import annotations

import io
import threading
from dataclasses import dataclass
from typing import Any

from gossipd.node.errors import JobError
from gossipd.node.jobs.registry import JobSpec, build_job
from gossipd.node.launch.launcher import run_mesh
from gossipd.node.launch.localmesh import MeshSpec

JOB = "gossipd.bench.overlap_mesh:paced_digits"


class _PacedDigits:
    """The digits job (same options, seed, shard and learning rate) whose every step also
    waits ``compute_s``: the step time of a heavier model, without its CPU."""

    def __init__(self, spec: JobSpec) -> None:
        options = dict(spec.options)
        compute_s = options.pop("compute_s", 0.1)
        number = isinstance(compute_s, int | float) and not isinstance(compute_s, bool)
        if not number or not 0.0 <= compute_s <= 10.0:
            raise JobError(
                f"job {spec.name!r} option 'compute_s' must be a number of seconds in [0, 10], "
                f"got {compute_s!r}"
            )
        inner = build_job(
            JobSpec(
                "digits",
                seed=spec.seed,
                shard_index=spec.shard_index,
                num_shards=spec.num_shards,
                learning_rate=spec.learning_rate,
                batch_size=spec.batch_size,
                options=options,
            )
        )
        self._inner = inner
        self.model, self.optimizer = inner.model, inner.optimizer
        self.compute_s = float(compute_s)
        self._never = threading.Event()  # a wait that nothing cuts short

    @property
    def batch_size(self) -> int:
        return int(self._inner.batch_size)

    def train_step(self) -> float:
        self._never.wait(self.compute_s)
        return self._inner.train_step()

    def evaluate(self) -> dict[str, float]:
        return self._inner.evaluate()


def paced_digits(spec: JobSpec) -> _PacedDigits:
    """Plugin job factory (``gossipd.bench.overlap_mesh:paced_digits``); option ``compute_s``
    (default 0.1), the other options go to the digits job."""
    return _PacedDigits(spec)


@dataclass(frozen=True)
class MeshSettings:
    nodes: int = 4
    budget_s: float = 40.0  # training time per mode, from each node's first step
    period_steps: int = 16
    compute_s: float = 0.1
    latency_ms: float = 150.0
    rate_mbit: float = 2.0
    learning_rate: float = 0.02
    seed: int = 0  # the same for every mode: the same initial models and batches

    def describe(self) -> str:
        return (
            f"{self.nodes} gossipd processes, digits MLP + {self.compute_s * 1000:g} ms paced "
            f"compute per step, T = {self.period_steps}, every link {self.latency_ms:g} ms one "
            f"way and {self.rate_mbit:g} Mbit/s, lr {self.learning_rate:g}, "
            f"{self.budget_s:g} s of training per mode"
        )


def run_mode(settings: MeshSettings, mode: str, coordinator: bool) -> dict[str, Any]:
    """One mesh in ``mode`` for ``settings.budget_s``: per node and mean wait and accuracy."""
    spec = MeshSpec(
        nodes=settings.nodes,
        job=JOB,
        job_options={"compute_s": settings.compute_s},
        protocol="overlap",
        protocol_options={"period_steps": settings.period_steps, "mode": mode},
        coordinator=coordinator,
        duration_s=settings.budget_s,
        learning_rate=settings.learning_rate,
        link=[{"latency_ms": settings.latency_ms, "rate_mbit": settings.rate_mbit}]
        * settings.nodes,
        eval_every_steps=50,
        sample_interval_s=5.0,
        seed=settings.seed,
        quiet=True,
    )
    result = run_mesh(spec, progress=io.StringIO())
    nodes = result["nodes"]
    waits = [n["wait_fraction"] for n in nodes]
    accuracies = [n.get("test_accuracy", float("nan")) for n in nodes]
    return {
        "wait_mean": sum(waits) / len(waits),
        "wait_max": max(waits),
        "accuracy_mean": sum(accuracies) / len(accuracies),
        "accuracy_min": min(accuracies),
        "steps_mean": sum(n["steps"] for n in nodes) / len(nodes),
        "scheduling": sorted({n["scheduling"] for n in nodes}),
        "consensus_distance_end": result["consensus_distance_end"],
        "wall_s": result["wall_s"],
        "ok": result["ok"],
        "nodes": nodes,
    }
