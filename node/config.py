"""Site configuration: one TOML file per daemon, validated before anything starts.

Every error names the key, the value it got and what would fix it, because the
person reading it is an operator at another site with no access to our logs.
"""

from __future__ import annotations

import difflib
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gossipd.node.errors import ConfigError
from gossipd.node.protocols import DEFAULT_PROTOCOL, PROTOCOLS


def _check_address(value: str) -> str:
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
    protocol: str = Field(
        DEFAULT_PROTOCOL, description="the gossip protocol; every node of a mesh must use the same"
    )
    round_steps: int = Field(
        1, ge=1, description="local steps per gossip round (crossover, shuffle-exchange)"
    )
    average_every_steps: int = Field(50, ge=1, description="persyn: steps between global averages")
    push_probability: float = Field(0.5, ge=0.0, le=1.0)
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

    @field_validator("protocol")
    @classmethod
    def _known_protocol(cls, value: str) -> str:
        if value not in PROTOCOLS:
            raise ValueError(
                f"unknown protocol {value!r}; choose one of {', '.join(sorted(PROTOCOLS))}"
            )
        return value


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
    max_sum_weight: float = Field(
        1e6, gt=0, description="largest sum-weight a payload may carry (a mesh starts at 1/node)"
    )
    max_inbound_pushes: int = Field(
        128, ge=1, description="inbound push streams at once (a push uses up to 4)"
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
        return _check_address(v) if v else None


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


class NodeConfig(_Section):
    mesh_id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    node_id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    listen: str = "127.0.0.1:0"
    advertise: str | None = Field(None, description="address peers dial; default: listen")
    seeds: list[str] = Field(default_factory=list)
    data_dir: Path = Path("gossipd-state")
    join: bool = Field(
        False, description="start at weight 0 and copy a live peer's model before training"
    )
    join_timeout_s: float = Field(60.0, gt=0)
    shutdown_timeout_s: float = Field(10.0, gt=0)
    job: JobConfig = JobConfig()
    gossip: GossipConfig = GossipConfig()
    membership: MembershipConfig = MembershipConfig()
    limits: LimitsConfig = LimitsConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    metrics: MetricsConfig = MetricsConfig()
    # No silent default: a site states how it is secured (certificates, or insecure).
    tls: TlsConfig = Field(default=TlsConfig.model_construct(), validate_default=True)

    @field_validator("listen", "advertise")
    @classmethod
    def _addresses(cls, v: str | None) -> str | None:
        return None if v is None else _check_address(v)

    @field_validator("seeds")
    @classmethod
    def _seed_addresses(cls, v: list[str]) -> list[str]:
        return [_check_address(s) for s in v]


def _known_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def _explain(err: ValidationError, source: str) -> ConfigError:
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            known = _known_keys(NodeConfig, e["loc"])
            close = difflib.get_close_matches(str(e["loc"][-1]), known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
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
        raise _explain(err, source) from None


def load_config(path: str | Path) -> NodeConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"cannot read config {path}: {err.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config {path} is not valid TOML: {err}") from None
    return parse_config(data, str(path))
