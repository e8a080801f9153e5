"""Gossip protocol cores (sans-IO) and the one registry that maps config names to them.

Outside this package nothing names a concrete protocol: drivers build a core
with :func:`build` and talk to it through
:class:`~gossipd.node.protocols.base.GossipProtocol`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gossipd.node.protocols.base import GossipProtocol
from gossipd.node.protocols.crossover import CrossoverGossip
from gossipd.node.protocols.persyn import PerSyn
from gossipd.node.protocols.pushsum_expgraph import PushSumExpGraph
from gossipd.node.protocols.shuffle_exchange import ShuffleExchange
from gossipd.node.protocols.sumweight import SumWeightGossip


@dataclass(frozen=True)
class CoreSettings:
    """What every core may be built from: the protocol-independent part of a config."""

    node_id: str
    num_segments: int
    seed: int = 0
    mesh_seed: int = 0
    initial_weight: float = 1.0
    max_in_flight: int = 4
    max_weight: float = 1e6
    push_probability: float = 0.5
    round_steps: int = 1
    average_every_steps: int = 50


def _ledger(s: CoreSettings) -> dict[str, Any]:
    """What every core's ledger takes, whatever the protocol."""
    return {
        "node_id": s.node_id,
        "num_segments": s.num_segments,
        "rng": random.Random(s.seed),
        "initial_weight": s.initial_weight,
        "max_in_flight": s.max_in_flight,
        "max_weight": s.max_weight,
    }


def _sumweight(s: CoreSettings) -> GossipProtocol:
    return SumWeightGossip(**_ledger(s), push_probability=s.push_probability)


def _crossover(s: CoreSettings) -> GossipProtocol:
    return CrossoverGossip(**_ledger(s), mesh_seed=s.mesh_seed, round_steps=s.round_steps)


def _pushsum_expgraph(s: CoreSettings) -> GossipProtocol:
    return PushSumExpGraph(**_ledger(s), round_steps=s.round_steps)


def _shuffle_exchange(s: CoreSettings) -> GossipProtocol:
    return ShuffleExchange(**_ledger(s), mesh_seed=s.mesh_seed, round_steps=s.round_steps)


def _persyn(s: CoreSettings) -> GossipProtocol:
    return PerSyn(**_ledger(s), average_every_steps=s.average_every_steps)


DEFAULT_PROTOCOL = "sumweight"

PROTOCOLS: dict[str, Callable[[CoreSettings], GossipProtocol]] = {
    "sumweight": _sumweight,
    "crossover": _crossover,
    "pushsum-expgraph": _pushsum_expgraph,
    "shuffle-exchange": _shuffle_exchange,
    "persyn": _persyn,
}


def build(protocol: str, settings: CoreSettings) -> GossipProtocol:
    """The core named ``protocol`` (a ``gossip.protocol`` value)."""
    try:
        factory = PROTOCOLS[protocol]
    except KeyError:
        raise ValueError(
            f"unknown protocol {protocol!r}; choose one of {', '.join(sorted(PROTOCOLS))}"
        ) from None
    return factory(settings)
