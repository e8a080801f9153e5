"""What a simulation is asked to do (:class:`SimSpec`) and what it reports (:class:`SimResult`).

A *round* is ``round_steps`` steps of the fastest site; the consensus error of
round k is measured at k rounds plus half a step, when, in the homogeneous
scenario, every push of round k has landed and been acknowledged and nothing of
round k + 1 has started. Round 0 is the start.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from gossipd.node.protocols import CoreSettings, settings_class
from gossipd.node.protocols.base import GossipProtocol, Push, shared_seed
from gossipd.node.protocols.settings import (
    BOOK_ROWS,
    SETTLE_IDLE_STEPS,
    SIM_BOOK_ROWS,
    SIM_SETTLE_IDLE_STEPS,
)
from gossipd.node.protocols.topology import ceil_log2
from gossipd.node.sim import memory
from gossipd.node.sim.scenarios import HOMOGENEOUS, Scenario
from gossipd.node.sim.spectral import MAX_TRACKED_N

AUTO_TRACKED_N = 256

if TYPE_CHECKING:
    from gossipd.node.sim.driver import Simulation


@dataclass(frozen=True)
class SimSpec:
    protocol: str = "sumweight"
    nodes: int = 16
    rounds: int = 20  # at most this many; fewer if target_error is reached
    segments: int = 4
    scenario: Scenario = HOMOGENEOUS
    seed: int = 0
    payload: str = "vector"  # "vector" or "digits"
    dim: int = 64  # vector length (vector payload)
    model_bytes: int = 0  # bytes of the whole model on the simulated wire; 0: the payload's own
    round_steps: int = 1  # also the protocol's round_steps, if it has one and options do not
    max_in_flight: int = 0  # 0: enough for one round of any protocol, max(4, S, ⌈√N⌉ + 2)
    weight_balance: bool = True  # pushes scaled so a site's weight does not follow its speed
    # The most of a node's weight one peer may hold; None: the protocol's default.
    peer_credit: float | None = None
    codec: str = "raw"  # how pushed segments travel (gossip.codec)
    error_feedback: bool = False  # differences from shared copies (gossip.error_feedback)
    feedback_peers: int = 8  # peers whose copies a node keeps (gossip.feedback_peers)
    topk_fraction: float = (
        0.01  # of a segment's entries topk2 and topk4 send (gossip.topk_fraction)
    )
    # The protocol's own settings, as in its [gossip.<protocol>] table; unset, the sim's
    # round_steps above and average_every_steps = ⌈log2 N⌉ (one burst right after another)
    # where the protocol has such a setting, else the protocol's defaults.
    options: Mapping[str, Any] = field(default_factory=dict)
    learning_rate: float | None = None  # digits payload; None: the job's default, 0: training off
    target_error: float = 0.0  # > 0: stop once both the error and its prediction are at most this
    predict: bool | None = None  # None: N ≤ 256; True: N ≤ 1024 (vectors, no membership changes)
    check_invariants: bool = False  # Σw and Σw·x at every probe (O(N) status calls each)
    # A coordinator schedules the cores that ask one (overlap): one scheduler for the whole
    # simulated mesh, answering at once; False: every node schedules alone.
    coordinator: bool = False
    # Replaying a real mesh: its node ids and mesh id (the daemon seeds every shared
    # topology with shared_seed(mesh_id)) and its nodes' initial vectors.
    node_ids: tuple[str, ...] = ()
    mesh_id: str = ""
    initial: tuple[tuple[float, ...], ...] = ()

    @property
    def tracks_mixing(self) -> bool:
        """Whether the mixing product is tracked: it costs S·N² memory and, at each round,
        S eigenvalue problems of size N (0.3 s each at N = 1024 on 2 cores), so by
        default only up to N = 256; asked for, up to N = 1024."""
        possible = (
            self.nodes <= MAX_TRACKED_N
            and self.payload == "vector"
            and not self.scenario.has_membership_changes
        )
        if self.predict is None:
            return possible and self.nodes <= AUTO_TRACKED_N
        return self.predict and possible


def core_options(spec: SimSpec) -> dict[str, Any]:
    """The protocol's own settings: ``spec.options`` over the sim's round and burst length."""
    takes = settings_class(spec.protocol).model_fields
    sim_defaults = {
        "round_steps": spec.round_steps,
        "average_every_steps": max(1, ceil_log2(max(spec.nodes, 1))),
    }
    return {**{k: v for k, v in sim_defaults.items() if k in takes}, **spec.options}


def core_settings(
    spec: SimSpec, node_id: str, segments: int, initial_weight: float
) -> CoreSettings:
    """Every node's settings: shared mesh seed, its own seed, the sim's sizing defaults."""
    beyond_a_federation = spec.nodes > BOOK_ROWS  # where the books keep a few rows
    return CoreSettings(
        node_id=node_id,
        num_segments=segments,
        seed=shared_seed("sim-core", spec.seed, node_id),
        mesh_seed=shared_seed(spec.mesh_id) if spec.mesh_id else shared_seed("sim-mesh", spec.seed),
        initial_weight=initial_weight,
        max_in_flight=spec.max_in_flight
        or max(4, segments, math.isqrt(max(spec.nodes - 1, 0)) + 3),
        weight_balance=spec.weight_balance,
        peer_credit=spec.peer_credit,
        book_rows=SIM_BOOK_ROWS if beyond_a_federation else BOOK_ROWS,
        settle_idle_steps=SIM_SETTLE_IDLE_STEPS if beyond_a_federation else SETTLE_IDLE_STEPS,
        coordinator=spec.coordinator,
        options=core_options(spec),
    )


class SimNode:
    """A simulated node: its core and what the driver must remember for it (kept small)."""

    __slots__ = (
        "alive",
        "core",
        "due",
        "flights",
        "handoffs",
        "held",
        "id",
        "index",
        "leaving",
        "serving",
        "site",
        "steps",
        "wait_s",
        "waiting",
    )

    def __init__(self, index: int, node_id: str, core: GossipProtocol, site: int) -> None:
        self.index = index
        self.id = node_id
        self.core = core
        self.site = site
        self.alive = True
        self.leaving = False
        self.steps = 0
        self.handoffs = 0
        self.flights: dict[tuple[str, int], Flight] = {}
        # Pulls to merge at a step's boundary (Pull.merge_at_step), as the replica keeps
        # them: out ((peer, round) -> [step, started]) and landed early (held).
        self.due: dict[tuple[str, int], list[Any]] = {}
        self.held: list[tuple[Any, ...]] = []
        self.serving = 0  # protocol pulls being served (a serves_one_pull core takes one)
        self.wait_s = 0.0  # virtual time the trainer waited for due pulls
        # While waiting at a boundary: (since, whether StepEnded was handled already).
        self.waiting: tuple[float, bool] | None = None


NOTHING_KEPT: frozenset[int] = frozenset()


class Flight:
    """A push from its snapshot to its settle: what fold-backs and retries need."""

    __slots__ = ("attempts", "kept", "merged", "nbytes", "push", "rows", "sender", "sent", "values")

    def __init__(
        self, push: Push, sender: SimNode, values: Mapping[int, Any], rows: Any, nbytes: int
    ) -> None:
        self.push = push
        self.sender = sender
        self.values = values  # the snapshot of each segment, as sent
        self.rows = rows  # the same snapshot in the mixing tracker, or None
        self.nbytes = nbytes
        self.sent: dict[int, Any] | None = None  # each segment as encoded, with a codec
        # Segments the receiver kept as copies (error feedback); one shared empty set until
        # then: an empty set per push in flight was a tenth of a round's peak.
        self.kept: AbstractSet[int] = NOTHING_KEPT
        self.attempts = 0
        self.merged = False  # the receiver merged it (whatever became of the acknowledgement)


def _finite(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else x


@dataclass
class SimResult:
    protocol: str
    nodes: int
    segments: int
    scenario: str
    payload: str
    seed: int
    rounds: int = 0
    errors: list[float] = field(default_factory=list)  # max over nodes, one per round
    rms_errors: list[float] = field(default_factory=list)
    times_s: list[float] = field(default_factory=list)  # virtual time of each measurement
    sigmas: list[float] | None = None  # max over segments of σ₁(P_k − J)
    predicted_errors: list[float] | None = None  # errors[0]·σ_k
    accuracy: list[float] | None = None  # digits: mean test accuracy of the members
    consensus_error_start: float = math.nan
    consensus_error_end: float = math.nan
    virtual_time_s: float = 0.0
    wall_s: float = 0.0
    events: int = 0  # happenings on the virtual clock: steps, deliveries, acks, timers
    # The process's peak resident memory (the simulator, the cores and the interpreter), and
    # what was resident before the nodes were built: the difference is what the run cost.
    peak_memory_bytes: int = 0
    start_memory_bytes: int = 0
    messages: int = 0  # payload transmissions, retries included
    settles: int = 0  # Settle transmissions (a sender closing a numbering), retries included
    acks: int = 0
    retries: int = 0
    refused: int = 0
    bytes: int = 0  # payload bytes sent, retries included (headers and acks not counted)
    bytes_per_node_per_round: float = 0.0
    steps: int = 0
    live_nodes: int = 0
    mass_lost: float = 0.0  # summed over segments
    mass_duplicated: float = 0.0
    invariant_mass_error: float | None = None  # worst relative drift of Σw seen
    invariant_value_error: float | None = None  # worst relative drift of Σw·x seen
    # Per node, the share of virtual time its trainer waited for due pulls (overlap).
    wait_fractions: list[float] = field(default_factory=list)
    # Per node, its sum-weight (mean over segments) at the probes while it was a member:
    # the mean, and the least (None: never a member, or a protocol without weights).
    weight_shares: list[float | None] = field(default_factory=list)
    weight_share_min: list[float | None] = field(default_factory=list)
    _weight_sums: list[float] = field(default_factory=list, repr=False)
    _weight_counts: list[int] = field(default_factory=list, repr=False)

    @classmethod
    def start(cls, spec: SimSpec, segments: int) -> SimResult:
        result = cls(
            spec.protocol, spec.nodes, segments, spec.scenario.name, spec.payload, spec.seed
        )
        if spec.tracks_mixing:
            result.sigmas, result.predicted_errors = [], []
        if spec.payload == "digits":
            result.accuracy = []
        return result

    def record(self, sim: Simulation, err_max: float, err_rms: float, sigma: float | None) -> None:
        self.errors.append(err_max)
        self.rms_errors.append(err_rms)
        self.times_s.append(sim.now)
        if sigma is not None and self.sigmas is not None and self.predicted_errors is not None:
            self.sigmas.append(sigma)
            self.predicted_errors.append(self.errors[0] * sigma)
        if self.accuracy is not None:
            self.accuracy.append(sim.payload.metrics(sim.member_idx).get("accuracy", math.nan))
        self._note_weights(sim)
        if sim.spec.check_invariants:
            self._note_invariants(sim)

    def _note_weights(self, sim: Simulation) -> None:
        """Each member's weight now: what says whether a site's data counts whatever its
        speed (:mod:`gossipd.node.protocols.weight_balance`)."""
        grow = len(sim.nodes) - len(self._weight_sums)
        self._weight_sums += [0.0] * grow
        self._weight_counts += [0] * grow
        self.weight_share_min += [None] * grow
        for i in sim.member_idx:
            weights = sim.nodes[i].core.segment_weights()
            if not weights:
                return  # a protocol without sum-weights
            share = sum(weights) / len(weights)
            self._weight_sums[i] += share
            self._weight_counts[i] += 1
            low = self.weight_share_min[i]
            self.weight_share_min[i] = share if low is None else min(low, share)

    def _note_invariants(self, sim: Simulation) -> None:
        mass, values = sim.invariant_errors()
        self.invariant_mass_error = max(self.invariant_mass_error or 0.0, mass)
        self.invariant_value_error = max(self.invariant_value_error or 0.0, values)

    def finish(self, sim: Simulation, wall_s: float) -> None:
        """After the drain: totals, and the invariants once more with nothing in flight."""
        self.rounds = len(self.errors) - 1
        self.consensus_error_start = self.errors[0]
        self.consensus_error_end = self.errors[-1]
        self.virtual_time_s = self.times_s[-1]
        self.wall_s = wall_s
        self.events = sim.clock.scheduled
        self.peak_memory_bytes = memory.peak_bytes()
        self.start_memory_bytes = sim.start_memory_bytes
        self.messages, self.acks, self.retries = sim.messages, sim.acks, sim.retries
        self.settles = sim.settles
        self.refused, self.bytes = sim.refused, sim.bytes_sent
        self.steps = sum(n.steps for n in sim.nodes)
        self.live_nodes = len(sim.members)
        self.bytes_per_node_per_round = self.bytes / max(1, self.nodes * max(1, self.rounds))
        self.mass_lost = float(sim.book.lost.sum())
        self.mass_duplicated = float(sim.book.duplicated.sum())
        self.wait_fractions = [n.wait_s / sim.now if sim.now > 0 else 0.0 for n in sim.nodes]
        self.weight_shares = [
            total / count if count else None
            for total, count in zip(self._weight_sums, self._weight_counts, strict=True)
        ]
        if sim.spec.check_invariants:
            self._note_invariants(sim)

    @property
    def memory_per_node_bytes(self) -> float:
        """Peak memory over what was resident before the nodes were built, per node."""
        return max(0, self.peak_memory_bytes - self.start_memory_bytes) / max(1, self.nodes)

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (NaN becomes null, so the line parses anywhere)."""
        data = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        data["memory_per_node_bytes"] = self.memory_per_node_bytes
        for key, value in data.items():
            if isinstance(value, float):
                data[key] = _finite(value)
            elif isinstance(value, list):
                data[key] = [_finite(v) if isinstance(v, float) else v for v in value]
        return data
