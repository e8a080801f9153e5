"""The simulator half of `gossipd bench overlap`: the paper's experiment on a virtual clock.

Eight nodes train the digits MLP for real (one real SGD step per simulated step)
while the simulator (:mod:`gossipd.node.sim`) carries their pulls over virtual
links. As in the paper's §5 (VGG16 on CIFAR-100), every link has 5 ms of
latency, a model is 54 MiB on the wire, and a link runs at 10 Gbit/s between
two fast nodes and at 1 Gbit/s otherwise; with 0.1 s steps (10% lognormal
jitter) and T = 16, a pull over a slow link takes 2·5 ms + 0.45 s, 28% of a
1.6 s period, and over a fast one 0.055 s. Nodes 0..k−1 are the k fast ones.

Each (fast count, mode) cell runs every seed for the same virtual-time budget
and reports the trainer's wait fraction (mean over nodes, and the worst node)
and the mean test accuracy of the nodes at each period, averaged over seeds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gossipd.node.sim import SimSpec, run_sim
from gossipd.node.sim.scenarios import Scenario

MiB = 1 << 20

# (label, overlap mode, whether a coordinator schedules): the paper's four runs.
MODES: tuple[tuple[str, str, bool], ...] = (
    ("none", "none", False),
    ("naive", "naive", False),
    ("scheduled+coordinator", "scheduled", True),
    ("scheduled, decentralized", "scheduled", False),
)


@dataclass(frozen=True)
class SimSettings:
    nodes: int = 8
    fast_counts: tuple[int, ...] = (0, 2, 6)
    period_steps: int = 16
    periods: int = 25  # the virtual-time budget, in periods of the nominal step time
    seeds: tuple[int, ...] = (0, 1, 2)
    step_s: float = 0.1
    jitter: float = 0.1
    latency_s: float = 0.005
    slow_bytes_s: float = 1.25e8  # 1 Gbit/s
    fast_bytes_s: float = 1.25e9  # 10 Gbit/s, between two fast nodes only
    model_bytes: int = 54 * MiB
    learning_rate: float = 0.02

    @property
    def budget_s(self) -> float:
        return self.periods * self.period_steps * self.step_s

    def pull_s(self, fast: bool) -> float:
        """What one pull takes on the wire: the request's latency, then the model back."""
        rate = self.fast_bytes_s if fast else self.slow_bytes_s
        return 2 * self.latency_s + self.model_bytes / rate

    def describe(self) -> str:
        return (
            f"{self.nodes} nodes, digits MLP, {self.model_bytes / MiB:g} MiB on the wire, "
            f"{self.latency_s * 1000:g} ms links at {self.slow_bytes_s * 8 / 1e9:g} Gbit/s "
            f"({self.fast_bytes_s * 8 / 1e9:g} between fast nodes), {self.step_s:g} s steps "
            f"({self.jitter:.0%} jitter), T = {self.period_steps}: a slow pull takes "
            f"{self.pull_s(False):.3f} s of a {self.period_steps * self.step_s:g} s period; "
            f"budget {self.budget_s:g} virtual s, lr {self.learning_rate:g}, "
            f"seeds {', '.join(map(str, self.seeds))}"
        )


def scenario(settings: SimSettings, fast: int) -> Scenario:
    """One site per node; the first ``fast`` sites are the fast ones."""
    n = settings.nodes
    both_fast = [[a < fast and b < fast for b in range(n)] for a in range(n)]
    return Scenario(
        name=f"overlap-{fast}-fast",
        description=f"{n} sites, {fast} on fast links",
        step_time_s=(settings.step_s,) * n,
        jitter=settings.jitter,
        latency_s=((settings.latency_s,) * n,) * n,
        bandwidth_bytes_per_s=tuple(
            tuple(settings.fast_bytes_s if f else settings.slow_bytes_s for f in row)
            for row in both_fast
        ),
        timeout_s=2.0,
        detect_s=5.0,
    )


def run_cell(settings: SimSettings, fast: int, mode: str, coordinator: bool) -> dict[str, Any]:
    """Every seed of one (fast count, mode): waits, accuracy curve, consensus, steps."""
    runs = [
        run_sim(
            SimSpec(
                protocol="overlap",
                nodes=settings.nodes,
                rounds=settings.periods,
                round_steps=settings.period_steps,
                scenario=scenario(settings, fast),
                seed=seed,
                payload="digits",
                model_bytes=settings.model_bytes,
                learning_rate=settings.learning_rate,
                options={"period_steps": settings.period_steps, "mode": mode},
                coordinator=coordinator,
            )
        )
        for seed in settings.seeds
    ]
    k = len(runs)
    curve = [sum(r.accuracy[i] for r in runs) / k for i in range(len(runs[0].accuracy or []))]
    return {
        "wait_mean": sum(sum(r.wait_fractions) / len(r.wait_fractions) for r in runs) / k,
        "wait_max": max(max(r.wait_fractions) for r in runs),
        "accuracy_end": curve[-1],
        "accuracy_best": max(curve),
        "accuracy_per_seed": [r.accuracy[-1] for r in runs],
        "times_s": runs[0].times_s,
        "accuracy": curve,
        "consensus_error_start": sum(r.consensus_error_start for r in runs) / k,
        "consensus_error_end": sum(r.consensus_error_end for r in runs) / k,
        "steps_per_node": sum(r.steps for r in runs) / (k * settings.nodes),
        "refused": sum(r.refused for r in runs),
        "wall_s": sum(r.wall_s for r in runs),
    }


def run_grid(settings: SimSettings) -> list[dict[str, Any]]:
    rows = []
    for fast in settings.fast_counts:
        for label, mode, coordinator in MODES:
            cell = run_cell(settings, fast, mode, coordinator)
            rows.append({"fast_nodes": fast, "mode": label, **cell})
    return rows
