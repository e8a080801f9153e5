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
settings: together the :class:`CoreClass` contract. A registered plain function
``f(common) -> core`` is accepted too, for a core with no settings of its own (test
doubles); it is taken to keep sum-weights, as a class does unless it says otherwise.
Drivers read a core only through
:class:`~gossipd.node.protocols.base.GossipProtocol` (``handle``, ``status``,
``state_dict``, ``load_state_dict`` and the class attributes declared there, such as
``keeps_weights`` and ``serves_one_pull``): a core that needs a driver to treat it
differently sets a declared attribute, or declares a new one there first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from pydantic import ValidationError

from gossipd.node.protocols.base import GossipProtocol
from gossipd.node.protocols.crossover import CrossoverGossip
from gossipd.node.protocols.overlap import OverlapGossip
from gossipd.node.protocols.persyn import PerSyn
from gossipd.node.protocols.pushsum_expgraph import PushSumExpGraph
from gossipd.node.protocols.settings import CoreSettings, NoSettings, ProtocolSettings, explain
from gossipd.node.protocols.shuffle_exchange import ShuffleExchange
from gossipd.node.protocols.sumweight import SumWeightGossip

if TYPE_CHECKING:
    from typing_extensions import TypeIs

__all__ = [
    "DEFAULT_PROTOCOL",
    "PROTOCOLS",
    "CoreClass",
    "CoreSettings",
    "ProtocolSettings",
    "build",
    "keeps_weights",
    "protocol_settings",
    "settings_class",
]

DEFAULT_PROTOCOL = "sumweight"

OwnSettings = TypeVar("OwnSettings", bound=ProtocolSettings)


class CoreClass(Protocol[OwnSettings]):
    """What the registry reads of a registered core class (the class itself, not a core)."""

    @property
    def keeps_weights(self) -> bool: ...

    @property
    def Settings(self) -> type[OwnSettings]: ...

    def from_settings(self, common: CoreSettings, own: OwnSettings, /) -> GossipProtocol: ...


CoreFactory = Callable[[CoreSettings], GossipProtocol]

# Each class reads its own settings type; Any is what a registry of many protocols holds.
PROTOCOLS: dict[str, CoreClass[Any] | CoreFactory] = {
    "sumweight": SumWeightGossip,
    "crossover": CrossoverGossip,
    "pushsum-expgraph": PushSumExpGraph,
    "shuffle-exchange": ShuffleExchange,
    "persyn": PerSyn,
    "overlap": OverlapGossip,
}


@dataclass(frozen=True)
class _Registered:
    """A registry entry, class or function, read through one shape."""

    keeps_weights: bool
    settings: type[ProtocolSettings]
    make: Callable[[CoreSettings, ProtocolSettings], GossipProtocol]


def _is_class(entry: CoreClass[Any] | CoreFactory) -> TypeIs[CoreClass[Any]]:
    return isinstance(entry, type)


def _of_class(cls: CoreClass[OwnSettings]) -> _Registered:
    def make(common: CoreSettings, own: ProtocolSettings) -> GossipProtocol:
        if not isinstance(own, cls.Settings):  # protocol_settings made it of this class
            raise TypeError(f"{type(own).__name__} given for {cls.Settings.__name__}")
        return cls.from_settings(common, own)

    return _Registered(cls.keeps_weights, cls.Settings, make)


def _of_function(factory: CoreFactory) -> _Registered:
    return _Registered(True, NoSettings, lambda common, _own: factory(common))


def _entry(protocol: str) -> _Registered:
    try:
        entry = PROTOCOLS[protocol]
    except KeyError:
        raise ValueError(
            f"unknown protocol {protocol!r}; choose one of {', '.join(sorted(PROTOCOLS))}"
        ) from None
    return _of_class(entry) if _is_class(entry) else _of_function(entry)


def keeps_weights(protocol: str) -> bool:
    """Whether ``protocol``'s cores keep sum-weights the mesh conserves (the push
    protocols), so mass checks apply to it."""
    return _entry(protocol).keeps_weights


def settings_class(protocol: str) -> type[ProtocolSettings]:
    """The class that declares and validates ``protocol``'s own settings."""
    return _entry(protocol).settings


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
        raise ValueError(explain(protocol, err, entry.settings.model_fields)) from None
    return entry.make(settings, own)
