"""Where and how fast simulated nodes run: sites, links, step times, faults (named or from JSON).

A scenario places node i at site ``i % len(step_time_s)`` and gives every pair of
sites a one-way latency and a bandwidth, so a message of b bytes sent at t
arrives at t + latency + b / bandwidth (no contention: links are modelled as
independent pipes, which overstates what a shared uplink delivers). Faults are
entries at chosen virtual times, never random draws, so a test can say exactly
when a node fails (docs/contributing.md, "Faults").

``homogeneous`` is the textbook setting: equal step times, no jitter, no faults,
and latency plus transfer far below one step, so every push of a round lands
before the next round starts and one round is one synchronous mixing step.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from gossipd.node.errors import GossipdError

EventKind = Literal["fail", "leave", "join"]
EVENT_KINDS: tuple[str, ...] = ("fail", "leave", "join")


class ScenarioError(GossipdError):
    """A scenario name, file or fault entry that cannot be simulated."""


@dataclass(frozen=True)
class FaultEntry:
    """At ``at_s``: ``fail`` crashes node ``node`` (its state is lost), ``leave`` hands its
    weight off and goes, ``join`` adds a fresh node that starts at weight 0 (``node`` unused)."""

    at_s: float
    kind: EventKind
    node: int = 0


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    step_time_s: tuple[float, ...] = (1.0,)  # compute time of one local step, per site
    jitter: float = 0.0  # each step takes step_time_s · lognormal(0, jitter)
    latency_s: tuple[tuple[float, ...], ...] = ((0.005,),)  # one-way, site × site
    bandwidth_bytes_per_s: tuple[tuple[float, ...], ...] = ((1.25e9,),)  # site × site
    loss: float = 0.0  # each payload and each acknowledgement is lost with this probability
    timeout_s: float = 0.2  # an attempt that got no answer is retried this long after
    detect_s: float = 1.5  # a crashed node leaves every view this long after it died
    events: tuple[FaultEntry, ...] = field(default_factory=tuple)

    @property
    def sites(self) -> int:
        return len(self.step_time_s)

    @property
    def has_membership_changes(self) -> bool:
        return bool(self.events)

    def check(self, nodes: int) -> None:
        """Refuse what the driver cannot run, naming the field and the fix."""
        n = self.sites
        if n < 1 or any(not (math.isfinite(t) and t > 0) for t in self.step_time_s):
            raise ScenarioError(f"scenario {self.name!r}: step_time_s must be positive numbers")
        for key in ("latency_s", "bandwidth_bytes_per_s"):
            matrix = getattr(self, key)
            if len(matrix) != n or any(len(row) != n for row in matrix):
                raise ScenarioError(
                    f"scenario {self.name!r}: {key} must be a {n}x{n} matrix (one row and "
                    f"column per site of step_time_s)"
                )
        if any(v < 0 for row in self.latency_s for v in row):
            raise ScenarioError(f"scenario {self.name!r}: latency_s must be >= 0")
        if any(not v > 0 for row in self.bandwidth_bytes_per_s for v in row):
            raise ScenarioError(f"scenario {self.name!r}: bandwidth_bytes_per_s must be > 0")
        if not 0.0 <= self.loss < 1.0:
            raise ScenarioError(f"scenario {self.name!r}: loss must be in [0, 1), got {self.loss}")
        if self.jitter < 0 or self.timeout_s <= 0 or self.detect_s < 0:
            raise ScenarioError(
                f"scenario {self.name!r}: jitter and detect_s must be >= 0, timeout_s > 0"
            )
        for e in self.events:
            if e.kind not in EVENT_KINDS:
                raise ScenarioError(f"fault entry {e}: kind must be one of {EVENT_KINDS}")
            if e.kind != "join" and not 0 <= e.node < nodes:
                raise ScenarioError(
                    f"fault entry {e.kind} of node {e.node}: there are only {nodes} nodes "
                    f"(0..{nodes - 1})"
                )
            if not e.at_s > 0:
                raise ScenarioError(f"fault entry {e}: at_s must be > 0")

    def with_faults(self, extra: tuple[FaultEntry, ...], loss: float | None) -> Scenario:
        events = tuple(sorted((*self.events, *extra), key=lambda e: e.at_s))
        return replace(self, events=events, loss=self.loss if loss is None else loss)


def _wan8() -> Scenario:
    """8 sites; 0 and 1 share a 10 Gb/s metro link, every other pair crosses a 100 Mb/s WAN."""
    fast, wan, lan = 1.25e9, 12.5e6, 1.25e9
    lat = [[0.0] * 8 for _ in range(8)]
    bw = [[0.0] * 8 for _ in range(8)]
    for a in range(8):
        for b in range(8):
            if a == b:
                lat[a][b], bw[a][b] = 0.0002, lan
            elif {a, b} == {0, 1}:
                lat[a][b], bw[a][b] = 0.002, fast
            else:  # sites on a line, 15 ms further apart per hop, at least 20 ms
                lat[a][b], bw[a][b] = 0.02 + 0.015 * abs(a - b), wan
    return Scenario(
        name="wan8",
        description="8 sites (node i at site i % 8); sites 0-1 on a 10 Gb/s 2 ms link, other "
        "pairs 100 Mb/s at 35-125 ms; step times 0.8-2.0 s per site, 10% jitter",
        step_time_s=(1.0, 1.0, 1.2, 0.9, 1.5, 1.1, 2.0, 1.3),
        jitter=0.1,
        latency_s=tuple(tuple(r) for r in lat),
        bandwidth_bytes_per_s=tuple(tuple(r) for r in bw),
        timeout_s=2.0,
        detect_s=5.0,
    )


HOMOGENEOUS = Scenario(
    name="homogeneous",
    description="one site, 1 s steps, no jitter, 5 ms latency, 10 Gb/s links, no faults: "
    "one round is one synchronous mixing step",
)

SCENARIOS: dict[str, Scenario] = {
    "homogeneous": HOMOGENEOUS,
    "wan8": _wan8(),
    "lossy": replace(
        HOMOGENEOUS,
        name="lossy",
        description="homogeneous, but 5% of payloads and of acknowledgements are lost; "
        "senders retry 0.2 s later with the same sequence",
        loss=0.05,
    ),
    "churn": replace(
        HOMOGENEOUS,
        name="churn",
        description="homogeneous; node 1 crashes at 5.003 s (its round-5 pushes in flight), "
        "node 2 leaves gracefully at 8.5 s, a new node joins at 10.5 s",
        events=(
            FaultEntry(5.003, "fail", 1),
            FaultEntry(8.5, "leave", 2),
            FaultEntry(10.5, "join"),
        ),
    ),
    "straggler": replace(
        HOMOGENEOUS,
        name="straggler",
        description="homogeneous with 4 sites, but nodes of site 3 (i % 4 == 3) take 3 s a step",
        step_time_s=(1.0, 1.0, 1.0, 3.0),
        latency_s=((0.005,) * 4,) * 4,
        bandwidth_bytes_per_s=((1.25e9,) * 4,) * 4,
    ),
}


def _matrix(value: Any, key: str) -> tuple[tuple[float, ...], ...]:
    if not isinstance(value, list) or not all(isinstance(r, list) for r in value):
        raise ScenarioError(f"scenario file: {key} must be a list of lists of numbers")
    return tuple(tuple(float(v) for v in row) for row in value)


def load_scenario(name_or_path: str) -> Scenario:
    """A named scenario, or a JSON file with the fields of :class:`Scenario`."""
    if name_or_path in SCENARIOS:
        return SCENARIOS[name_or_path]
    path = Path(name_or_path)
    if not path.suffix == ".json" or not path.exists():
        raise ScenarioError(
            f"unknown scenario {name_or_path!r}: use one of {', '.join(SCENARIOS)} or the path "
            "of a .json file with step_time_s, latency_s, bandwidth_bytes_per_s, ..."
        )
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ScenarioError(f"cannot read scenario file {path}: {err}") from None
    known = set(Scenario.__dataclass_fields__)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ScenarioError(f"scenario file {path}: unknown keys {unknown}; known: {sorted(known)}")
    fields: dict[str, Any] = {"name": path.stem, "description": f"from {path}", **raw}
    if "step_time_s" in raw:
        fields["step_time_s"] = tuple(float(v) for v in raw["step_time_s"])
    for key in ("latency_s", "bandwidth_bytes_per_s"):
        if key in raw:
            fields[key] = _matrix(raw[key], key)
    fields["events"] = tuple(FaultEntry(**e) for e in raw.get("events", ()))
    return Scenario(**fields)


def parse_fault(kind: EventKind, text: str) -> FaultEntry:
    """``NODE@TIME`` for fail and leave, ``TIME`` for join (the CLI's --fail/--leave/--join)."""
    try:
        if kind == "join":
            return FaultEntry(float(text), "join")
        node, _, at = text.partition("@")
        return FaultEntry(float(at), kind, int(node))
    except ValueError:
        form = "TIME" if kind == "join" else "NODE@TIME"
        raise ScenarioError(f"--{kind} {text!r}: write it as {form}, e.g. 3@5.5") from None
