"""Site configuration: one TOML file per daemon, validated before anything starts.

Every error names the key, the value it got and what would fix it, because the
person reading it is an operator at another site with no access to our logs.
"""

from __future__ import annotations

import logging
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from gossipd.node.config_ranks import ALLREDUCE, AllreduceConfig, RanksConfig
from gossipd.node.errors import ConfigError
from gossipd.node.protocols import (
    DEFAULT_PROTOCOL,
    PROTOCOLS,
    ProtocolSettings,
    protocol_settings,
    settings_class,
)
from gossipd.node.protocols.settings import did_you_mean

log = logging.getLogger(__name__)

# Protocol settings that sat flat in [gossip] before each protocol had its own table.
# Deprecated: still read for one release, into the selected protocol's table.
DEPRECATED_FLAT_KEYS = ("push_probability", "round_steps", "average_every_steps")


def check_address(value: str) -> str:
    """``value`` if it is HOST:PORT with a port in 0..65535 (the coordinator's config and
    requests check addresses the same way); ValueError saying what is wrong if not."""
    host, sep, port = value.rpartition(":")
    if (
        not sep
        or not host
        or not (port.isascii() and port.isdigit())
        or not 0 <= int(port) <= 65535
    ):
        raise ValueError(f"{value!r} is not HOST:PORT (for example 127.0.0.1:50051)")
    return value


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class JobConfig(_Section):
    name: str = Field("digits", description="digits, synthetic, or a plugin module:factory")
    seed: int = 0
    shard_index: int = Field(0, ge=0)
    num_shards: int = Field(1, ge=1)
    learning_rate: float | None = Field(None, ge=0.0)
    batch_size: int | None = Field(None, ge=1)
    max_steps: int = Field(0, ge=0, description="stop training after this many steps; 0: never")
    duration_s: float = Field(0.0, ge=0.0, description="stop training after this long; 0: never")
    eval_every_steps: int = Field(100, ge=0)
    device: str = Field(
        "cpu",
        pattern=r"^(cpu|cuda(:[0-9]+)?)$",
        description="where a built-in job trains: cpu, cuda (cuda:LOCAL_RANK in a multi-rank "
        "site, else cuda:0) or cuda:N",
    )
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _shard_in_range(self) -> JobConfig:
        if self.shard_index >= self.num_shards:
            raise ValueError(
                f"job.shard_index {self.shard_index} must be below job.num_shards "
                f"{self.num_shards}; shards are numbered 0..num_shards-1"
            )
        return self


class GossipConfig(_Section):
    """``[gossip]``: what every protocol shares. Each protocol's own settings are in its
    ``[gossip.<protocol>]`` table, validated by its class (:attr:`options`); a table for a
    protocol other than the selected one is allowed, and checked all the same."""

    protocol: str = Field(
        DEFAULT_PROTOCOL, description="the gossip protocol; every node of a mesh must use the same"
    )
    codec: Literal["raw", "fp16", "bf16"] = "raw"
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
    _tables: dict[str, ProtocolSettings] = PrivateAttr(default_factory=dict)

    @property
    def options(self) -> ProtocolSettings:
        """The selected protocol's own settings: its table, defaults filled in."""
        return self.options_for(self.protocol)

    def options_for(self, protocol: str) -> ProtocolSettings:
        """``protocol``'s settings: its ``[gossip.<protocol>]`` table as validated, or defaults."""
        if protocol == ALLREDUCE:
            return ProtocolSettings()
        table = self._tables.get(protocol)
        return table if table is not None else protocol_settings(protocol)

    @field_validator("protocol")
    @classmethod
    def _known_protocol(cls, value: str) -> str:
        if value not in PROTOCOLS and value != ALLREDUCE:
            raise ValueError(
                f"unknown protocol {value!r}; choose one of {', '.join(sorted(PROTOCOLS))} "
                f"(or {ALLREDUCE}, the synchronous baseline)"
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


class MembershipConfig(_Section):
    start_after_peers: int = Field(
        0, ge=0, description="wait for this many live peers before the first step"
    )
    start_timeout_s: float = Field(120.0, gt=0)
    anti_entropy_interval_s: float = Field(1.0, gt=0)
    suspect_after_failures: int = Field(3, ge=1)
    drop_after_s: float = Field(
        60.0,
        gt=0,
        description="a peer suspected this long is declared dead: its unacknowledged pushes "
        "are folded back and it is forgotten",
    )
    max_peers: int = Field(256, ge=1, description="verified peers remembered")
    max_candidates: int = Field(
        64, ge=1, description="heard-of addresses waiting for this node's own handshake"
    )
    dial_concurrency: int = Field(8, ge=1, description="handshakes to candidates at once")
    max_departed: int = Field(1024, ge=1, description="departed peers remembered")


class LimitsConfig(_Section):
    max_chunk_bytes: int = Field(4 << 20, ge=1024)
    max_segment_bytes: int = Field(1 << 30, ge=1024)
    inbox_size: int = Field(16, ge=1)
    max_sum_weight: float | None = Field(
        None,
        gt=0,
        description="most sum-weight a segment may hold after a merge (a merge over it is "
        "refused: WeightOverCap); unset: the number of founding members, taken as the largest "
        "view this node has seen, itself included",
    )
    sink_score_bound: float = Field(
        6.0,
        gt=0,
        description="a peer whose score of weight taken from this node and not returned "
        "passes this is suspected of sinking weight and gets no more pushes from it",
    )
    sink_allowance: float = Field(
        0.5,
        ge=0,
        lt=1,
        description="drift allowed per exchange in the sink score (higher: slower to suspect)",
    )
    max_inbound_pushes: int = Field(
        128, ge=1, description="inbound push streams at once (a push uses up to 4)"
    )
    max_inbound_pushes_per_peer: int = Field(
        16,
        ge=1,
        description="inbound push streams one peer may hold at once (an honest one holds up "
        "to 4 per push, one push at a time), so one peer never takes the others' slots",
    )
    min_push_rate_bytes_s: float = Field(
        65536.0,
        gt=0,
        description="an inbound push must average this rate while we wait for it, after the "
        "first stream_idle_timeout_s; a slower one is ended (a trickle holds no slot for long)",
    )
    max_payload_distance: float = Field(
        100.0,
        gt=0,
        description="a payload segment whose RMS distance from this node's own exceeds this "
        "many times max(RMS of its own, payload_scale_floor) is refused",
    )
    payload_scale_floor: float = Field(
        1.0,
        gt=0,
        description="the smallest RMS max_payload_distance measures against (a near-zero "
        "segment still accepts honest distances)",
    )
    merge_clip: float | None = Field(
        None,
        gt=0,
        description="opt-in robust merge: an incoming segment is pulled toward ours until its "
        "RMS distance is at most this many times max(RMS of ours, payload_scale_floor)",
    )
    max_inbound_pulls: int = Field(4, ge=1, description="PullModel streams served at once")
    max_pending_bytes: int = Field(
        512 << 20,
        ge=1024,
        description="payload bytes held by unfinished inbound pushes, all streams together",
    )
    stream_idle_timeout_s: float = Field(
        10.0, gt=0, description="an inbound stream silent this long (or a pull not read) is ended"
    )
    merge_wait_s: float = Field(
        5.0, gt=0, description="how long a received push waits for a step boundary before Busy"
    )
    rejection_log_interval_s: float = Field(
        60.0, gt=0, description="a rejection is logged once per peer and reason per interval"
    )


class LinkConfig(_Section):
    """``[link]``: slow this node's sends down, for tests and benchmarks only (off by default).

    Real processes on one machine can then show slow and distant links; see
    :mod:`gossipd.node.shaping` for what is delayed and how. Never for production.
    """

    latency_ms: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="one-way delay before each push stream, pull request and served pull "
        "this node sends; 0: none",
    )
    jitter_ms: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="each delay adds a uniform random 0..jitter_ms (seeded by gossip.seed)",
    )
    rate_mbit: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="cap on this node's payload send rate in Mbit/s, shared by all its pushes "
        "and served pulls; 0: no cap",
    )

    @property
    def enabled(self) -> bool:
        return bool(self.latency_ms or self.jitter_ms or self.rate_mbit)


class CheckpointConfig(_Section):
    every_steps: int = Field(200, ge=0, description="0: only at shutdown")


class MetricsConfig(_Section):
    listen: str | None = Field(
        "127.0.0.1:0",
        description="HOST:PORT of the Prometheus endpoint; port 0 picks a free one; empty: off",
    )

    @field_validator("listen")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        return check_address(v) if v else None


class TlsConfig(_Section):
    ca: Path | None = Field(None, description="the mesh CA certificate (gossipd certs init)")
    cert: Path | None = Field(None, description="this site's certificate (gossipd certs issue)")
    key: Path | None = Field(None, description="this site's private key")
    allow: list[str] | None = Field(
        None, description="node ids admitted; unset: every certificate of the mesh CA"
    )
    insecure: bool = Field(
        False, description="plaintext, no identities: anyone who reaches the port is believed"
    )

    @model_validator(mode="after")
    def _files_or_insecure(self) -> TlsConfig:
        files = {"ca": self.ca, "cert": self.cert, "key": self.key}
        if self.insecure:
            given = [k for k, v in files.items() if v is not None]
            if given:
                raise ValueError(
                    f"tls.insecure = true with tls.{', tls.'.join(given)} set; drop one or the "
                    "other"
                )
            return self
        missing = [k for k, v in files.items() if v is None]
        if missing:
            raise ValueError(
                f"tls.{', tls.'.join(missing)} not set: give the mesh CA, this site's "
                "certificate and key (gossipd certs init / issue), or set tls.insecure = true "
                "to run plaintext"
            )
        return self


class MqttConfig(_Section):
    """``[mqtt]``: find peers through an MQTT broker and take control commands from it.

    Presence messages give candidate addresses only (a peer is still whoever this
    node's own handshake proves); nothing of the model travels over MQTT."""

    broker: str = Field(description="HOST:PORT of the MQTT broker")
    topic_prefix: str = Field("gossipd", description="topics are PREFIX/MESH_ID/...")
    username: str | None = Field(None, min_length=1)
    password: str | None = Field(None, description="broker password (or password_file)")
    password_file: Path | None = Field(None, description="file whose first line is the password")
    tls: bool = Field(False, description="TLS to the broker with the system CAs (or ca)")
    ca: Path | None = Field(None, description="CA certificate of the broker (implies TLS)")
    cert: Path | None = Field(None, description="client certificate for the broker (implies TLS)")
    key: Path | None = Field(None, description="client certificate key for the broker")
    keepalive_s: int = Field(
        15, ge=1, le=65535, description="MQTT keepalive: the broker fires the last will after 1.5x"
    )
    reconnect_max_s: float = Field(
        30.0, gt=0, description="longest wait between attempts to reach the broker"
    )

    @field_validator("broker")
    @classmethod
    def _broker_address(cls, v: str) -> str:
        return check_address(v)

    @field_validator("topic_prefix")
    @classmethod
    def _topic_prefix(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*", v):
            raise ValueError(
                "a topic prefix is one or more levels of [A-Za-z0-9._-] joined by '/', with no "
                "wildcards (+ #) and no empty level; for example gossipd or lab/gossipd"
            )
        return v

    @model_validator(mode="after")
    def _credentials(self) -> MqttConfig:
        if self.password is not None and self.password_file is not None:
            raise ValueError("mqtt.password and mqtt.password_file are both set; keep one")
        if (self.password is not None or self.password_file is not None) and not self.username:
            raise ValueError("mqtt.password without mqtt.username; set the broker user name")
        if (self.cert is None) != (self.key is None):
            raise ValueError("mqtt.cert and mqtt.key go together; set both or neither")
        return self

    @property
    def uses_tls(self) -> bool:
        return self.tls or self.ca is not None or self.cert is not None


class NodeConfig(_Section):
    mesh_id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    node_id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    listen: str = "127.0.0.1:0"
    advertise: str | None = Field(None, description="address peers dial; default: listen")
    seeds: list[str] = Field(default_factory=list)
    coordinator: str | None = Field(
        None,
        description="HOST:PORT of the mesh's coordinator (gossipd coordinator); it schedules "
        "the overlap protocol's pulls and hands out the view; none: decentralized",
    )
    data_dir: Path = Path("gossipd-state")
    join: bool = Field(
        False, description="start at weight 0 and copy a live peer's model before training"
    )
    join_timeout_s: float = Field(60.0, gt=0)
    shutdown_timeout_s: float = Field(10.0, gt=0)
    progress_interval_s: float = Field(
        60.0, ge=0, description="one INFO progress line per interval; 0: none"
    )
    job: JobConfig = JobConfig()
    gossip: GossipConfig = GossipConfig()
    membership: MembershipConfig = MembershipConfig()
    limits: LimitsConfig = LimitsConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    metrics: MetricsConfig = MetricsConfig()
    link: LinkConfig = LinkConfig()
    ranks: RanksConfig = RanksConfig()
    allreduce: AllreduceConfig | None = Field(
        None, description="the DDP baseline's rendezvous; required with gossip.protocol = allreduce"
    )
    # No silent default: a site states how it is secured (certificates, or insecure).
    tls: TlsConfig = Field(default=TlsConfig.model_construct(), validate_default=True)
    mqtt: MqttConfig | None = Field(
        None, description="discovery and control through an MQTT broker; unset: off"
    )

    @field_validator("listen", "advertise", "coordinator")
    @classmethod
    def _addresses(cls, v: str | None) -> str | None:
        return None if v is None else check_address(v)

    @field_validator("seeds")
    @classmethod
    def _seed_addresses(cls, v: list[str]) -> list[str]:
        return [check_address(s) for s in v]

    @model_validator(mode="after")
    def _allreduce_needs_master(self) -> NodeConfig:
        if (self.gossip.protocol == ALLREDUCE) != (self.allreduce is not None):
            raise ValueError(
                "gossip.protocol = allreduce needs an [allreduce] section with master = "
                '"HOST:PORT" (the rendezvous, the same on every site), and [allreduce] '
                "is only for that protocol"
            )
        check_address(self.ranks.master)
        master = self.allreduce.master if self.allreduce is not None else None
        try:
            port_0 = master is not None and int(check_address(master).rpartition(":")[2]) == 0
        except ValueError as err:
            raise ValueError(f"allreduce.master: {err}") from None
        if port_0:
            raise ValueError(
                f"allreduce.master = {master!r}: port 0 cannot work here, every "
                "site must dial the same rendezvous; give a fixed free port, the same on every "
                'site (for example "10.0.0.1:29500")'
            )
        return self

    @model_validator(mode="after")
    def _coordinator_needs_tls(self) -> NodeConfig:
        if self.coordinator is not None and self.tls.insecure:
            raise ValueError(
                f"coordinator = {self.coordinator!r} with tls.insecure = true: the coordinator "
                "speaks mutual TLS only (its certificate and the nodes' come from the mesh's "
                "CA); give [tls] ca, cert and key, or drop coordinator"
            )
        return self

    @model_validator(mode="after")
    def _link_fits_timeouts(self) -> NodeConfig:
        """A shaped link that every push or pull would time out on is refused up front."""
        link, gossip, limits = self.link, self.gossip, self.limits
        bound_s = min(gossip.progress_timeout_s, limits.stream_idle_timeout_s)
        if (link.latency_ms + link.jitter_ms) / 1000 >= bound_s:
            raise ValueError(
                f"link.latency_ms + link.jitter_ms = {link.latency_ms + link.jitter_ms:g} ms "
                f"is not below min(gossip.progress_timeout_s, limits.stream_idle_timeout_s) = "
                f"{bound_s:g} s, so every shaped push would time out; lower the latency or "
                "raise those timeouts"
            )
        rate_bytes_s = link.rate_mbit * 1e6 / 8
        if link.rate_mbit and rate_bytes_s < limits.min_push_rate_bytes_s:
            raise ValueError(
                f"link.rate_mbit = {link.rate_mbit:g} ({rate_bytes_s:g} bytes/s) is below "
                f"limits.min_push_rate_bytes_s = {limits.min_push_rate_bytes_s:g}, so peers "
                "would end this node's pushes as too slow; raise the rate or lower "
                "min_push_rate_bytes_s on every site"
            )
        return self


def _known_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    for part in loc[:-1]:
        if model is GossipConfig and part in PROTOCOLS:
            model = settings_class(str(part))
            continue
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        # An optional section (``X | None``): its keys are X's.
        annotation = next((a for a in get_args(annotation) if a is not type(None)), annotation)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    if model is GossipConfig:
        return [*model.model_fields, *sorted(PROTOCOLS), *DEPRECATED_FLAT_KEYS]
    return list(model.model_fields)


def explain(err: ValidationError, source: str, root: type[BaseModel] | None = None) -> ConfigError:
    """One line per mistake of ``err`` (key, value, fix); ``root`` is the model validated
    (default ``NodeConfig``), whose keys a misspelt one is compared with."""
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            hint = did_you_mean(str(e["loc"][-1]), _known_keys(root or NodeConfig, e["loc"]))
            lines.append(f"  {key}: unknown key; {hint}")
        elif e["type"] == "missing":
            lines.append(f"  {key}: required; add `{e['loc'][-1]} = ...` to the file")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            value = e.get("input")
            shown = "" if isinstance(value, BaseModel | dict) else f" = {value!r}"
            lines.append(f"  {key}{shown}: {msg}")
    return ConfigError("\n".join(lines))


def parse_config(data: dict[str, Any], source: str = "<dict>") -> NodeConfig:
    try:
        return NodeConfig.model_validate(data)
    except ValidationError as err:
        raise explain(err, source) from None


def load_config(path: str | Path) -> NodeConfig:
    return parse_config(read_toml(path), str(path))


def read_toml(path: str | Path) -> dict[str, Any]:
    """A config file's TOML, or a :class:`ConfigError` naming the file and what is wrong."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"cannot read config {path}: {err.strerror}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config {path} is not valid TOML: {err}") from None
