"""Plugin jobs used by the tests, loaded by daemons as ``tests.plugin_jobs:NAME``."""

from __future__ import annotations

from gossipd.node.jobs import JobSpec, build_job


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
