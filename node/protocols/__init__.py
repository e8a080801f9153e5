"""Gossip protocol cores (sans-IO) and the one registry that maps config names to them.

Outside this package nothing names a concrete protocol: drivers build a core
with :func:`build` and talk to it through
:class:`~gossipd.node.protocols.base.GossipProtocol`.

Adding a protocol is its file, one line in :data:`PROTOCOLS`, and a script in the
contract suite (``SCRIPTS`` in tests/contract_scripts.py: the suite fails for a
registered protocol without one). The file holds the core class, with ``name``,
``Settings`` (a :class:`~gossipd.node.protocols.settings.ProtocolSettings` subclass:
the protocol's own settings, typed, with defaults and descriptions; a config gives
them in a ``[gossip.<name>]`` table) and a classmethod ``from_settings(common, own)``
that builds the core from the :class:`CoreSettings` every core shares and its own
settings. A registered plain function ``f(common) -> core`` is accepted too, for a
core with no settings of its own (test doubles). Drivers read a core only through
:class:`~gossipd.node.protocols.base.GossipProtocol` (``handle``, ``status``,
``state_dict``, ``load_state_dict`` and the class attributes declared there, such as
``keeps_weights`` and ``serves_one_pull``): a core that needs a driver to treat it
differently sets a declared attribute, or declares a new one there first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ValidationError

from gossipd.node.protocols.base import GossipProtocol
from gossipd.node.protocols.crossover import CrossoverGossip
from gossipd.node.protocols.overlap import OverlapGossip
from gossipd.node.protocols.persyn import PerSyn
from gossipd.node.protocols.pushsum_expgraph import PushSumExpGraph
from gossipd.node.protocols.settings import CoreSettings, NoSettings, ProtocolSettings, explain
from gossipd.node.protocols.shuffle_exchange import ShuffleExchange
from gossipd.node.protocols.sumweight import SumWeightGossip

__all__ = [
    "DEFAULT_PROTOCOL",
    "PROTOCOLS",
    "CoreSettings",
    "ProtocolSettings",
    "build",
    "keeps_weights",
    "protocol_settings",
    "settings_class",
]

DEFAULT_PROTOCOL = "sumweight"

PROTOCOLS: dict[str, type[GossipProtocol] | Callable[[CoreSettings], GossipProtocol]] = {
    "sumweight": SumWeightGossip,
    "crossover": CrossoverGossip,
    "pushsum-expgraph": PushSumExpGraph,
    "shuffle-exchange": ShuffleExchange,
    "persyn": PerSyn,
    "overlap": OverlapGossip,
}


def _entry(protocol: str) -> Any:
    try:
        return PROTOCOLS[protocol]
    except KeyError:
        raise ValueError(
            f"unknown protocol {protocol!r}; choose one of {', '.join(sorted(PROTOCOLS))}"
        ) from None


def keeps_weights(protocol: str) -> bool:
    """Whether ``protocol``'s cores keep sum-weights the mesh conserves (the push
    protocols), so mass checks apply to it."""
    return bool(getattr(_entry(protocol), "keeps_weights", True))


def settings_class(protocol: str) -> type[ProtocolSettings]:
    """The class that declares and validates ``protocol``'s own settings."""
    settings: type[ProtocolSettings] = getattr(_entry(protocol), "Settings", NoSettings)
    return settings


def protocol_settings(
    protocol: str, options: Mapping[str, Any] | ProtocolSettings | None = None
) -> ProtocolSettings:
    """``options`` (a ``[gossip.<protocol>]`` table) validated by ``protocol``'s class,
    defaults filled in; raises pydantic's ``ValidationError`` if they are wrong."""
    cls = settings_class(protocol)
    if isinstance(options, cls):
        return options
    if isinstance(options, ProtocolSettings):
        raise ValueError(f"{type(options).__name__} given for protocol {protocol!r}")
    if isinstance(options, Mapping):
        options = dict(options)
    return cls.model_validate({} if options is None else options)


def build(protocol: str, settings: CoreSettings) -> GossipProtocol:
    """The core named ``protocol`` (a ``gossip.protocol`` value), built from ``settings``;
    ``settings.options`` are checked by the protocol's own class (ValueError if wrong)."""
    entry = _entry(protocol)
    try:
        own = protocol_settings(protocol, settings.options)
    except ValidationError as err:
        raise ValueError(explain(protocol, err, settings_class(protocol).model_fields)) from None
    from_settings = getattr(entry, "from_settings", None)
    core: GossipProtocol = (
        entry(settings) if from_settings is None else from_settings(settings, own)
    )
    return core
