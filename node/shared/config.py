"""Site configuration: one TOML file per daemon, validated before anything starts.

Every error names the key, the value it got and what would fix it, because the
person reading it is an operator at another site with no access to our logs.
"""

from __future__ import annotations

import difflib
import tomllib
from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from gossipd.node.errors import ConfigError
from gossipd.node.protocols import PROTOCOLS, settings_class
from gossipd.node.protocols.settings import did_you_mean
from gossipd.node.shared.config_gossip import DEPRECATED_FLAT_KEYS, GossipConfig
from gossipd.node.shared.config_ranks import (
    BASELINE_SECTIONS,
    AllreduceConfig,
    DilocoConfig,
    RanksConfig,
)
from gossipd.node.shared.config_reach import ReachConfig
from gossipd.node.shared.config_sections import (
    CheckpointConfig,
    LimitsConfig,
    LinkConfig,
    MembershipConfig,
    MetricsConfig,
    MqttConfig,
    TlsConfig,
    _Section,
    check_address,
)

__all__ = [
    "DEPRECATED_FLAT_KEYS",
    "CheckpointConfig",
    "GossipConfig",
    "JobConfig",
    "LimitsConfig",
    "LinkConfig",
    "MembershipConfig",
    "MetricsConfig",
    "MqttConfig",
    "NodeConfig",
    "TlsConfig",
    "check_address",
    "explain",
    "load_config",
    "parse_config",
    "read_toml",
]


class JobConfig(_Section):
    name: str = Field(
        "digits",
        description="a built-in job (digits, mnist1d, shakespeare, synthetic) or a plugin "
        "module:factory",
    )
    seed: int = 0
    shard_index: int = Field(0, ge=0)
    num_shards: int = Field(1, ge=1)
    learning_rate: float | None = Field(None, ge=0.0)
    batch_size: int | None = Field(None, ge=1)
    max_steps: int = Field(0, ge=0, description="stop training after this many steps; 0: never")
    duration_s: float = Field(0.0, ge=0.0, description="stop training after this long; 0: never")
    max_steps_per_s: float = Field(
        0.0,
        ge=0.0,
        description="pace the trainer to at most this many steps a second, merging gossip "
        "while it waits; 0: as fast as it goes",
    )
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


class NodeConfig(_Section):
    mesh_id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    node_id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    listen: str = "127.0.0.1:0"
    advertise: str | None = Field(None, description="address peers dial; default: listen")
    bulk: bool = Field(
        True,
        description="serve and use the bulk lane: payloads of large pushes and pulls as raw "
        "bytes on a second TCP port (TLS as the gRPC port), not in gRPC frames",
    )
    bulk_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="the bulk lane's port on listen's host (0: any free port); peers dial it "
        "on the host of this node's advertised address, so map it unchanged",
    )
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
    reach: ReachConfig = ReachConfig()
    ranks: RanksConfig = RanksConfig()
    allreduce: AllreduceConfig | None = Field(
        None, description="the DDP baseline's rendezvous; required with gossip.protocol = allreduce"
    )
    diloco: DilocoConfig | None = Field(
        None,
        description="the DiLoCo baseline's rendezvous and outer step; required with "
        "gossip.protocol = diloco",
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
    def _baseline_has_its_section(self) -> NodeConfig:
        for name in BASELINE_SECTIONS:
            if (self.gossip.protocol == name) != (getattr(self, name) is not None):
                raise ValueError(
                    f"gossip.protocol = {name} needs an [{name}] section with master = "
                    f'"HOST:PORT" (the rendezvous, the same on every site), and [{name}] '
                    "is only for that protocol"
                )
        return self

    @model_validator(mode="after")
    def _outbound_only_advertises_nothing(self) -> NodeConfig:
        if self.reach.reachable is False and self.advertise is not None:
            raise ValueError(
                f"reach.reachable = false with advertise = {self.advertise!r}: a site that "
                "cannot be dialled advertises its relays, not an address; drop advertise, or "
                "set reach.reachable = auto (or true) if peers can dial it there"
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
        for key, outcome in (
            ("min_push_rate_bytes_s", "peers would end this node's pushes as too slow"),
            ("min_pull_rate_bytes_s", "this node would cut off the pulls it serves"),
        ):
            floor = getattr(limits, key)
            if link.rate_mbit and rate_bytes_s < floor:
                raise ValueError(
                    f"link.rate_mbit = {link.rate_mbit:g} ({rate_bytes_s:g} bytes/s) is below "
                    f"limits.{key} = {floor:g}, so {outcome}; raise the rate or lower "
                    f"{key} on every site"
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
        return [*model.model_fields, *sorted(PROTOCOLS)]
    return list(model.model_fields)


def _moved_key(name: str, loc: tuple[Any, ...]) -> str | None:
    """The hint for a near miss of a ``[gossip]`` key that moved to the protocols' tables:
    point at where it lives now, not at its deprecated spelling."""
    if tuple(str(p) for p in loc[:-1]) != ("gossip",):
        return None
    close = difflib.get_close_matches(name, DEPRECATED_FLAT_KEYS, n=1)
    if not close:
        return None
    return (
        f"did you mean {close[0]!r}? It lives in the protocol's own table now, for example "
        f"[gossip.sumweight] {close[0]} = ..."
    )


def explain(err: ValidationError, source: str, root: type[BaseModel] | None = None) -> ConfigError:
    """One line per mistake of ``err`` (key, value, fix); ``root`` is the model validated
    (default ``NodeConfig``), whose keys a misspelt one is compared with."""
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            name = str(e["loc"][-1])
            hint = _moved_key(name, e["loc"]) or did_you_mean(
                name, _known_keys(root or NodeConfig, e["loc"])
            )
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
