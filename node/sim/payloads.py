"""What simulated nodes hold and blend: plain vectors (consensus studies) or real torch models.

The driver only ever asks a payload for four things, the same ones the
daemon's replica does with a :class:`~gossipd.node.model.segments.FlatModel`:
snapshot some segments (before a push leaves), blend received or returned
values into a segment (x ← (1 − α)·x + α·y), take a local step, and measure.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from gossipd.node.errors import GossipdError
from gossipd.node.protocols.base import shared_seed

if TYPE_CHECKING:
    from gossipd.node.model.segments import FlatModel
    from gossipd.node.sim.spec import SimSpec


# Rows of the vector payload measured at once (VectorPayload.errors).
ERROR_BLOCK_ROWS = 65_536


class Payload(Protocol):
    num_segments: int
    segment_nbytes: list[int]  # bytes one segment occupies on the simulated wire

    def add_node(self, index: int, bootstrap_from: int | None) -> None: ...

    def snapshot(self, index: int, segments: Sequence[int]) -> Mapping[int, Any]: ...

    def blend(self, index: int, segment: int, values: Any, alpha: float) -> bool: ...

    def correct(self, index: int, segment: int, delta: Any, alpha: float) -> None: ...

    def load(self, index: int, segment: int, values: np.ndarray) -> None: ...

    def step(self, index: int) -> None: ...

    def values(self, index: int, segment: int) -> np.ndarray: ...

    def errors(self, members: np.ndarray) -> tuple[float, float]: ...

    def metrics(self, members: np.ndarray) -> dict[str, float]: ...


class RowSnapshot(Mapping[int, np.ndarray]):
    """Some segments of one node's vector as they were: one copy of the row, each segment
    a view of it. An array per segment and a dict cost 1.2 KB a node at the peak of a
    homogeneous round, when every node's pushes are in flight at once; this, 0.7 KB."""

    __slots__ = ("_row", "_segments", "_slices")

    def __init__(self, row: np.ndarray, slices: list[slice], segments: Sequence[int]) -> None:
        self._row = row.copy()
        self._slices = slices
        self._segments = tuple(segments)

    def __getitem__(self, segment: int) -> np.ndarray:
        if segment not in self._segments:
            raise KeyError(segment)
        return self._row[self._slices[segment]]

    def __iter__(self) -> Iterator[int]:
        return iter(self._segments)

    def __len__(self) -> int:
        return len(self._segments)


class VectorPayload:
    """One float64 vector per node, cut into ``segments`` contiguous slices.

    Node i starts at 1 + z_i with z_i standard normal from its own seed, so the
    mean x̄ is about the all-ones vector and the initial relative error about 1.
    All vectors live in one (capacity × dim) array: a consensus measurement over
    10,000 nodes is one vectorised reduction, and a node costs dim·8 bytes.
    """

    def __init__(
        self, nodes: int, capacity: int, dim: int, segments: int, seed: int, wire_bytes: int = 0
    ) -> None:
        if not 1 <= segments <= dim:
            raise GossipdError(f"--segments {segments} must be between 1 and --dim {dim}")
        bounds = np.linspace(0, dim, segments + 1).round().astype(int)
        self.slices = [slice(int(a), int(b)) for a, b in itertools.pairwise(bounds)]
        self.num_segments = segments
        total = wire_bytes or dim * 8
        self.segment_nbytes = [max(1, total * (s.stop - s.start) // dim) for s in self.slices]
        self.x = np.zeros((capacity, dim))
        for i in range(nodes):
            rng = np.random.default_rng(shared_seed("sim-vector", seed, i))
            self.x[i] = 1.0 + rng.standard_normal(dim)
        self.nodes = nodes  # the founders, whose first vectors x̄ is the mean of
        self.mean0 = self.x[:nodes].mean(axis=0)
        self.norm0 = float(np.linalg.norm(self.mean0))

    def start_from(self, initial: np.ndarray) -> None:
        """Given initial vectors (one row per node) instead of seeded ones."""
        nodes, dim = self.nodes, self.x.shape[1]
        if initial.shape != (nodes, dim):
            raise GossipdError(f"initial vectors have shape {initial.shape}, need {(nodes, dim)}")
        self.x[:nodes] = initial
        self.mean0 = initial.mean(axis=0)
        self.norm0 = float(np.linalg.norm(self.mean0))

    def add_node(self, index: int, bootstrap_from: int | None) -> None:
        """A joiner pulls a live node's model before it trains (it holds weight 0)."""
        if bootstrap_from is not None:
            self.x[index] = self.x[bootstrap_from]

    def snapshot(self, index: int, segments: Sequence[int]) -> RowSnapshot:
        return RowSnapshot(self.x[index], self.slices, segments)

    def blend(self, index: int, segment: int, values: np.ndarray, alpha: float) -> bool:
        part = self.x[index, self.slices[segment]]
        part *= 1.0 - alpha
        part += alpha * values
        return True

    def correct(self, index: int, segment: int, delta: np.ndarray, alpha: float) -> None:
        """x ← x + α·delta: what a lossy codec dropped from a merged push, kept at home."""
        self.x[index, self.slices[segment]] += alpha * np.asarray(delta)

    def load(self, index: int, segment: int, values: np.ndarray) -> None:
        self.x[index, self.slices[segment]] = values

    def step(self, index: int) -> None:
        """Training off: a step leaves the vector as it is."""

    def values(self, index: int, segment: int) -> np.ndarray:
        return self.x[index, self.slices[segment]]

    def errors(self, members: np.ndarray) -> tuple[float, float]:
        """(max, root-mean-square) over members of ‖xᵢ − x̄‖/‖x̄‖, x̄ the initial mean.

        A block of rows at a time: the members' rows at once were two copies of every
        vector, a gigabyte on top of the peak at a million nodes."""
        dev = np.concatenate(
            [
                np.linalg.norm(self.x[block] - self.mean0, axis=1)
                for block in np.array_split(members, max(1, len(members) // ERROR_BLOCK_ROWS))
            ]
        )
        dev /= self.norm0
        return float(dev.max()), float(np.sqrt(np.mean(dev * dev)))

    def metrics(self, members: np.ndarray) -> dict[str, float]:
        return {}


class DigitsPayload:
    """A real :class:`~gossipd.node.jobs.registry.DigitsJob` per node (shard i of N), one thread.

    Models start from different seeds and train on their own shard; gossip blends
    the job's :class:`~gossipd.node.model.segments.FlatModel` segments exactly as the
    replica does. With training on the mean moves, so the consensus error here is
    measured against the current mean of the members' models, not the initial one.
    """

    def __init__(
        self,
        nodes: int,
        capacity: int,
        segments: int,
        seed: int,
        learning_rate: float | None,
        options: dict[str, object] | None = None,
        wire_bytes: int = 0,
    ) -> None:
        import torch

        from gossipd.node.jobs.registry import JobSpec, build_job
        from gossipd.node.model.segments import FlatModel, shareable_tensors

        torch.set_num_threads(1)
        self._torch = torch
        self.jobs: list[Any] = [None] * capacity
        self.flats: dict[int, FlatModel] = {}  # by node index, as each is built

        def make(i: int) -> None:
            spec = JobSpec(
                "digits",
                seed=shared_seed("sim-digits", seed, i) % (1 << 31),
                shard_index=i % nodes,
                num_shards=nodes,
                learning_rate=learning_rate,
                options=dict(options or {}),
            )
            job = build_job(spec)
            if i == 0:
                total = sum(t.numel() * t.element_size() for _, t in shareable_tensors(job.model))
                self._segment_bytes = max(1, -(-total // segments))
            self.jobs[i] = job
            self.flats[i] = FlatModel(job.model, self._segment_bytes)

        self._make = make
        for i in range(nodes):
            make(i)
        plan = self.flats[0].plan
        self.num_segments = len(plan)
        self.segment_nbytes = [seg.nbytes for seg in plan.segments]
        if wire_bytes:  # the wire sees a model of wire_bytes, cut as the MLP is
            own = sum(self.segment_nbytes)
            self.segment_nbytes = [max(1, wire_bytes * n // own) for n in self.segment_nbytes]

    def add_node(self, index: int, bootstrap_from: int | None) -> None:
        self._make(index)
        if bootstrap_from is not None:
            for s, values in self.flats[bootstrap_from].snapshot().items():
                self.flats[index].load_segment(s, values)

    def snapshot(self, index: int, segments: Sequence[int]) -> dict[int, Any]:
        return self.flats[index].snapshot(segments)

    def blend(self, index: int, segment: int, values: Any, alpha: float) -> bool:
        """False (nothing changed) if the blend would be non-finite, as the replica refuses."""
        return bool(self.flats[index].merge_segment(segment, values, alpha))

    def correct(self, index: int, segment: int, delta: Any, alpha: float) -> None:
        self.flats[index].add_delta(segment, delta, alpha)

    def load(self, index: int, segment: int, values: np.ndarray) -> None:
        self.flats[index].load_segment(segment, self._torch.from_numpy(np.asarray(values)))

    def step(self, index: int) -> None:
        self.jobs[index].train_step()

    def values(self, index: int, segment: int) -> np.ndarray:
        return self.flats[index].buffers[segment].double().numpy()

    def _flat(self, index: int) -> np.ndarray:
        return self._torch.cat(self.flats[index].buffers).double().numpy()

    def errors(self, members: np.ndarray) -> tuple[float, float]:
        x = np.stack([self._flat(int(i)) for i in members])
        mean = x.mean(axis=0)
        dev = np.linalg.norm(x - mean, axis=1) / max(float(np.linalg.norm(mean)), 1e-300)
        return float(dev.max()), float(np.sqrt(np.mean(dev * dev)))

    def metrics(self, members: np.ndarray) -> dict[str, float]:
        accuracy = [
            self.jobs[int(i)].evaluate().get("test_accuracy", float("nan")) for i in members
        ]
        return {"accuracy": float(np.mean(accuracy))}


def make_payload(spec: SimSpec, capacity: int) -> Payload:
    """The payload ``spec`` names, with room for ``capacity`` nodes (joiners included)."""
    if spec.payload == "vector":
        payload = VectorPayload(
            spec.nodes, capacity, spec.dim, spec.segments, spec.seed, spec.model_bytes
        )
        if spec.initial:
            payload.start_from(np.array(spec.initial, dtype=np.float64))
        return payload
    if spec.payload == "digits":
        return DigitsPayload(
            spec.nodes,
            capacity,
            spec.segments,
            spec.seed,
            spec.learning_rate,
            wire_bytes=spec.model_bytes,
        )
    raise GossipdError(f"payload must be 'vector' or 'digits', got {spec.payload!r}")
