"""The coordinator's configuration: one TOML file, validated before anything listens.

Errors read like a site's (:mod:`gossipd.node.shared.config`): the key, the value, the fix.
The coordinator has no plaintext mode: the node id of every caller comes from its
client certificate, so without certificates it could not tell nodes apart.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gossipd.node.protocols.scheduler import DEFAULT_LEASE_S, DEFAULT_THRESHOLD, MAX_TIME_S
from gossipd.node.shared.config import MetricsConfig, check_address, explain, read_toml

ID_PATTERN = r"^[A-Za-z0-9._-]+$"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SchedulerConfig(_Section):
    threshold: float = Field(
        DEFAULT_THRESHOLD,
        gt=0.0,
        lt=1.0,
        description="a measured transfer more than this (relative) away from c_ij replaces it; "
        "closer ones are averaged in",
    )
    lease_s: float = Field(
        DEFAULT_LEASE_S,
        gt=0.0,
        le=MAX_TIME_S,
        description="a peer handed out and never reported is free again after this long",
    )


class CoordinatorTlsConfig(_Section):
    ca: Path = Field(description="the mesh CA certificate (gossipd certs init)")
    cert: Path = Field(
        description="the coordinator certificate (gossipd certs issue --coordinator)"
    )
    key: Path = Field(description="its private key")
    allow: list[str] | None = Field(
        None, description="node ids admitted; unset: every site certificate of the mesh CA"
    )


class CoordinatorConfig(_Section):
    mesh_id: str = Field(min_length=1, pattern=ID_PATTERN)
    listen: str = Field("127.0.0.1:50050", description="gRPC address nodes dial")
    data_dir: Path = Field(
        Path("gossipd-coordinator-state"), description="state.json: learned c_ij and the epoch"
    )
    heartbeat_interval_s: float = Field(
        2.0, gt=0.0, le=3600.0, description="how often nodes send a heartbeat"
    )
    drop_after_s: float = Field(
        10.0, gt=0.0, le=86_400.0, description="a node silent this long leaves the view"
    )
    max_members: int = Field(256, ge=2, le=65_536, description="nodes in the view at most")
    max_request_bytes: int = Field(
        4096, ge=512, le=1 << 20, description="larger requests are refused before parsing"
    )
    scheduler: SchedulerConfig = SchedulerConfig()
    metrics: MetricsConfig = MetricsConfig()
    tls: CoordinatorTlsConfig

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        return check_address(v)

    @model_validator(mode="after")
    def _drop_after_heartbeats(self) -> CoordinatorConfig:
        if self.drop_after_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"drop_after_s {self.drop_after_s} must be longer than heartbeat_interval_s "
                f"{self.heartbeat_interval_s} (about 5 heartbeats: a node would be dropped "
                "between two of its own heartbeats)"
            )
        return self


def parse_coordinator_config(data: dict[str, object], source: str = "<dict>") -> CoordinatorConfig:
    try:
        return CoordinatorConfig.model_validate(data)
    except ValidationError as err:
        raise explain(err, source, CoordinatorConfig) from None


def load_coordinator_config(path: str | Path) -> CoordinatorConfig:
    return parse_coordinator_config(read_toml(path), str(path))
