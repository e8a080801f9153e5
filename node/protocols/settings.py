"""What a protocol core is built from: the settings every core shares, and each protocol's own.

A protocol file declares its own settings next to its core: a subclass of
:class:`ProtocolSettings` (typed fields, each with a default and a description),
named by the core's ``Settings`` attribute, and a classmethod
``from_settings(common, own)`` that builds the core. A config gives them in a
``[gossip.<protocol>]`` table; :func:`gossipd.node.protocols.build` validates
them through that class for every driver (daemon, simulator, benchmarks).

This module needs pydantic only, so the config can use it without loading a core.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

# Peers a node keeps a row for in each of its books of peers (credit nets, sink scores,
# weight exchanged); the rest are forgotten as each book says. More than a federation's
# sites, so a daemon's books are exact. A simulated mesh larger than that keeps
# SIM_BOOK_ROWS: its nodes meet a new peer at nearly every push, and the rows were most
# of what a node grew by. Forgetting a net at one end only can get an honest push refused
# where peers meet again and again (101 in 100 sumweight nodes over 600 rounds with 8
# rows), never where they hardly meet twice (none in 4,000 nodes over 20 rounds).
BOOK_ROWS = 1024
SIM_BOOK_ROWS = 8


def overflow(book: Iterable[str], size: int, rows: int, order: Callable[[str], Any]) -> list[str]:
    """The peers a book of ``rows`` forgets as a newcomer arrives: none while it has room,
    else the first half in ``order`` at once (one scan per newcomer cost the simulator a
    tenth of its time)."""
    if size < rows:
        return []
    return sorted(book, key=order)[: size - rows // 2]


# A numbering whose receiver has had no push from this node for this many local steps, and
# none in flight, is closed (Numberings.close): the receiver is told, forgets its window, and
# this node its row. An edge pushed along now and then keeps its numbering, each push
# carrying what settled before it instead of a message of its own: among 4 sites pushing
# to one of 3 peers a step, an edge is idle 16 steps once in 650, where at 2 steps it was
# 4 in 9, and a settle went with 70% of the pushes (through a natted site's relay too:
# the NAT re-attach test then failed in 3 of 4 full runs). In a large crossover mesh, where
# a round is a step and a peer is rarely met twice, nearly every numbering holds one push
# and is closed 16 rounds after it; a simulated mesh larger than a federation closes it 2
# rounds after (SIM_SETTLE_IDLE_STEPS): the same one settle per push either way, and the
# row gone 14 rounds sooner (a 4,000-node crossover node held 31.3 KB after 20 rounds at
# 16, 25.3 KB at 2, 25.1 KB with no settles at all).
SETTLE_IDLE_STEPS = 16
SIM_SETTLE_IDLE_STEPS = 2


class ProtocolSettings(BaseModel):
    """A protocol's own settings, one ``[gossip.<protocol>]`` table: unknown keys are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class NoSettings(ProtocolSettings):
    """The settings of a protocol that has none of its own."""


@dataclass(frozen=True)
class CoreSettings:
    """What every core is built from: the protocol-independent part of a node's config, and
    ``options``, the protocol's own settings (its ``[gossip.<protocol>]`` table as a mapping,
    or already validated by its ``Settings``); :func:`~gossipd.node.protocols.build` checks
    them."""

    node_id: str
    num_segments: int
    seed: int = 0
    mesh_seed: int = 0
    initial_weight: float = 1.0
    max_in_flight: int = 4
    max_weight: float | None = None  # None: the number of founding members (largest view)
    sink_bound: float = 6.0
    sink_allowance: float = 0.5
    peer_credit: float | None = None  # limits.peer_credit; None: the protocol's default
    weight_balance: bool = True
    book_rows: int = BOOK_ROWS  # peers each book of peers keeps a row for
    settle_idle_steps: int = SETTLE_IDLE_STEPS  # steps without a push that close a numbering
    # A coordinator schedules this node's pulls (a core that schedules asks it with
    # AskPeer, and schedules alone while it cannot answer); False: decentralized.
    coordinator: bool = False
    options: Mapping[str, Any] | ProtocolSettings = field(default_factory=dict)

    def ledger(self) -> dict[str, Any]:
        """The arguments of every sum-weight core's ledger, whatever the protocol."""
        return {
            "node_id": self.node_id,
            "num_segments": self.num_segments,
            "seed": self.seed,
            "initial_weight": self.initial_weight,
            "max_in_flight": self.max_in_flight,
            "max_weight": self.max_weight,
            "sink_bound": self.sink_bound,
            "sink_allowance": self.sink_allowance,
            "peer_credit": self.peer_credit,
            "weight_balance": self.weight_balance,
            "book_rows": self.book_rows,
            "settle_idle_steps": self.settle_idle_steps,
        }


def did_you_mean(key: str, known: Iterable[str]) -> str:
    """The hint for an unknown key: the nearest known one, or the list of them all."""
    known = list(known)
    close = difflib.get_close_matches(key, known, n=1)
    if close:
        return f"did you mean {close[0]!r}?"
    return f"known keys: {', '.join(known)}" if known else "this protocol takes no settings"


def explain(protocol: str, err: ValidationError, known: Iterable[str]) -> str:
    """``err`` (from validating ``protocol``'s settings) as one line per wrong key, with a fix."""
    known = list(known)
    lines = [f"invalid settings for protocol {protocol!r}:"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(table)"
        if e["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown setting; {did_you_mean(str(e['loc'][-1]), known)}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"  {key} = {e.get('input')!r}: {msg}")
    return "\n".join(lines)


class RoundSettings(ProtocolSettings):
    """The settings of a protocol that pushes once a round: its own class restates
    ``round_steps`` only to say what a round is there."""

    round_steps: int = Field(1, ge=1, description="local steps per round")
