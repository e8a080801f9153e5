"""``[gossip]``: what every protocol shares, and each protocol's own ``[gossip.<protocol>]``
table, validated by that protocol's settings class; the deprecated flat keys that sat in
``[gossip]`` before each protocol had its table are moved into the selected one's."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import (
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from gossipd.node.protocols import (
    DEFAULT_PROTOCOL,
    PROTOCOLS,
    ProtocolSettings,
    protocol_settings,
    settings_class,
)
from gossipd.node.shared.config_ranks import BASELINE_SECTIONS
from gossipd.node.shared.config_sections import _Section

# The config's logger, whichever of its files warns: operators and tests filter on it.
log = logging.getLogger("gossipd.node.shared.config")

# Protocol settings that sat flat in [gossip] before each protocol had its own table.
# Deprecated: still read for one release, into the selected protocol's table.
DEPRECATED_FLAT_KEYS = ("push_probability", "round_steps", "average_every_steps")


class GossipConfig(_Section):
    """``[gossip]``: what every protocol shares. Each protocol's own settings are in its
    ``[gossip.<protocol>]`` table, validated by its class (:attr:`options`); a table for a
    protocol other than the selected one is allowed, and checked all the same."""

    protocol: str = Field(
        DEFAULT_PROTOCOL, description="the gossip protocol; every node of a mesh must use the same"
    )
    codec: Literal["raw", "fp16", "bf16", "int8", "int4"] = "raw"
    segment_bytes: int = Field(4 << 20, ge=1024)
    chunk_bytes: int = Field(1 << 20, ge=1024, le=4 << 20)
    push_timeout_s: float = Field(
        30.0, gt=0, description="deadline of one push attempt, from open to acknowledgement"
    )
    progress_timeout_s: float = Field(
        10.0,
        gt=0,
        description="a push with no chunk taken and no reply for this long is abandoned and "
        "retried later with the same sequence; the peer counts one failure",
    )
    retry_max_s: float = Field(
        10.0, gt=0, description="longest wait between retries of an unacknowledged push"
    )
    max_pushes_in_flight: int = Field(
        4, ge=1, description="unacknowledged pushes in total (at most one per peer)"
    )
    seed: int = Field(0, description="seed of this node's peer choices")
    weight_balance: bool = Field(
        True,
        description="scale what this site's pushes carry while it has held less weight than "
        "the mesh's weight per site (as its peers' acknowledgements report theirs), so a "
        "site that steps faster than the others is not drained and its data counts alike; "
        "off: every push carries its protocol's share",
    )
    error_feedback: bool = Field(
        False,
        description="send each pushed segment as its difference from a copy this node and "
        "the receiver both hold, and keep what the codec dropped in this node's own model, "
        "so int8 and int4 gossip reach the same consensus as raw; needs a lossy codec",
    )
    feedback_peers: int = Field(
        8,
        ge=1,
        description="peers whose copies a node keeps with error_feedback, sending and "
        "receiving: up to 2 × feedback_peers × the model's bytes of memory; a peer past it "
        "gets whole values",
    )
    cpu_share: float = Field(
        0.03,
        gt=0,
        le=1,
        description="most of the node's cores' time gossip may take while the trainer steps; "
        "pushes wait (and so come less often) while it is in debt; 1: never wait",
    )
    _tables: dict[str, ProtocolSettings] = PrivateAttr(default_factory=dict)

    @property
    def options(self) -> ProtocolSettings:
        """The selected protocol's own settings: its table, defaults filled in."""
        return self.options_for(self.protocol)

    def options_for(self, protocol: str) -> ProtocolSettings:
        """``protocol``'s settings: its ``[gossip.<protocol>]`` table as validated, or defaults."""
        if protocol in BASELINE_SECTIONS:  # a baseline: no gossip, nothing to set
            return ProtocolSettings()
        table = self._tables.get(protocol)
        return table if table is not None else protocol_settings(protocol)

    @model_validator(mode="after")
    def _feedback_needs_a_lossy_codec(self) -> GossipConfig:
        if self.error_feedback and self.codec == "raw":
            raise ValueError(
                "gossip.error_feedback = true needs a lossy gossip.codec (int8, int4, fp16 or "
                "bf16): raw values drop nothing to feed back"
            )
        return self

    @field_validator("protocol")
    @classmethod
    def _known_protocol(cls, value: str) -> str:
        if value not in PROTOCOLS and value not in BASELINE_SECTIONS:
            baselines = ", or ".join(f"{n}, {s.summary}" for n, s in BASELINE_SECTIONS.items())
            raise ValueError(
                f"unknown protocol {value!r}; choose one of {', '.join(sorted(PROTOCOLS))} "
                f"(or {baselines})"
            )
        return value

    @model_validator(mode="wrap")
    @classmethod
    def _protocol_tables(
        cls, data: Any, handler: ModelWrapValidatorHandler[GossipConfig]
    ) -> GossipConfig:
        """Each ``[gossip.<protocol>]`` table through its protocol's class, the deprecated flat
        keys into the selected protocol's table; every error of the section at once."""
        if not isinstance(data, Mapping):
            return handler(data)
        tables = {k: v for k, v in data.items() if k in PROTOCOLS}
        flat = {k: v for k, v in data.items() if k in DEPRECATED_FLAT_KEYS}
        rest = {k: v for k, v in data.items() if k not in tables and k not in flat}
        errors: list[InitErrorDetails] = []
        try:
            gossip: GossipConfig | None = handler(rest)
        except ValidationError as err:
            gossip = None
            errors += [_again(e, e["loc"]) for e in err.errors()]
        selected = rest.get("protocol", DEFAULT_PROTOCOL)
        moved: set[str] = set()
        if flat and selected in PROTOCOLS:
            moved = _move_flat_keys(flat, selected, tables, errors)
        validated: dict[str, ProtocolSettings] = {}
        for name, table in tables.items():
            try:
                validated[name] = protocol_settings(name, table)
            except ValidationError as err:
                for e in err.errors():
                    flat_key = name == selected and bool(e["loc"]) and e["loc"][0] in moved
                    errors.append(_again(e, e["loc"] if flat_key else (name, *e["loc"])))
        if errors or gossip is None:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        gossip._tables = validated
        for key in flat:
            if key in moved:
                log.warning("gossip.%s is deprecated: write it in [gossip.%s]", key, selected)
            else:
                log.warning(
                    "gossip.%s is ignored: protocol %r has no such setting (and protocol "
                    "settings in [gossip] are deprecated: use [gossip.<protocol>] tables)",
                    key,
                    selected,
                )
        return gossip


def _move_flat_keys(
    flat: Mapping[str, Any],
    protocol: str,
    tables: dict[str, Any],
    errors: list[InitErrorDetails],
) -> set[str]:
    """Moves the deprecated flat keys that ``protocol`` has into its table and returns them;
    one also set in the table is refused (which was meant?) with an error in ``errors``."""
    table = tables.get(protocol, {})
    if not isinstance(table, Mapping):
        return set()  # not a table: its own error says so
    table = dict(table)
    takes = settings_class(protocol).model_fields
    moved: set[str] = set()
    for key, value in flat.items():
        if key not in takes:
            continue
        if key in table:
            message = (
                f"set here and in [gossip.{protocol}]; keep only the one in [gossip.{protocol}] "
                "(the flat key is deprecated)"
            )
            error = PydanticCustomError("flat_and_table", message)
            errors.append({"type": error, "loc": (key,), "input": value})
            continue
        table[key] = value
        moved.add(key)
    if moved:
        tables[protocol] = table
    return moved


def _again(error: Any, loc: tuple[Any, ...]) -> InitErrorDetails:
    """A pydantic error, as it was, at ``loc``: to raise it again with others."""
    return {
        "type": PydanticCustomError(error["type"], error["msg"]),
        "loc": loc,
        "input": error["input"],
    }
