"""A scripted wall clock and process CPU counter for the CPU budget's tests."""

from __future__ import annotations

from gossipd.node.net.limits.cpu_budget import CpuBudget


class Clocks:
    """A wall clock and a process CPU counter the test moves by hand."""

    def __init__(self) -> None:
        self.wall = 100.0
        self.cpu = 10.0

    def advance(self, wall_s: float, cpu_s: float) -> None:
        self.wall += wall_s
        self.cpu += cpu_s


def budget(share: float, clocks: Clocks) -> CpuBudget:
    return CpuBudget(share, cpus=1.0, process_cpu=lambda: clocks.cpu, clock=lambda: clocks.wall)
