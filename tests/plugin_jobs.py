"""Plugin jobs used by the tests, loaded by daemons as ``tests.plugin_jobs:NAME``."""

from __future__ import annotations

import threading

from gossipd.node.jobs.registry import JobSpec, build_job


class _FailsAtStep:
    """The synthetic job, except that its step ``fail_at`` raises, as a user's bug would."""

    def __init__(self, spec: JobSpec) -> None:
        inner = build_job(JobSpec("synthetic", seed=spec.seed, learning_rate=0.0))
        self.model, self.optimizer, self._inner = inner.model, inner.optimizer, inner
        self.fail_at = int(spec.options.get("fail_at", 50))  # type: ignore[arg-type]
        self.steps = 0

    def train_step(self) -> float:
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError(f"user code blew up at step {self.steps}")
        return self._inner.train_step()

    def evaluate(self) -> dict[str, float]:
        return self._inner.evaluate()


def failing_job(spec: JobSpec) -> _FailsAtStep:
    return _FailsAtStep(spec)


class _Paced:
    """The synthetic job with training off and a fixed compute time per step.

    Models a site whose step takes ``step_time_s``, so that gossip rounds of a
    real mesh are as long as a simulator's homogeneous rounds and messages land
    within the step they were sent in.
    """

    def __init__(self, spec: JobSpec) -> None:
        inner = build_job(JobSpec("synthetic", seed=spec.seed, learning_rate=0.0))
        self.model, self.optimizer, self._inner = inner.model, inner.optimizer, inner
        self.step_time_s = float(spec.options.get("step_time_s", 0.2))  # type: ignore[arg-type]
        self._stop = threading.Event()

    def train_step(self) -> float:
        self._stop.wait(self.step_time_s)  # the compute a real step would take
        return self._inner.train_step()

    def evaluate(self) -> dict[str, float]:
        return self._inner.evaluate()


def paced_job(spec: JobSpec) -> _Paced:
    return _Paced(spec)
