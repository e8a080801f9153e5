"""The sections of a site's config that stand alone: membership, limits, link shaping,
checkpoints, metrics, TLS and MQTT (``NodeConfig`` in :mod:`gossipd.node.shared.config` puts
them together with the job and gossip sections, which depend on the protocols)."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


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
        description="most sum-weight a segment may hold after a merge: a push merges the "
        "part of its weight that fits and the rest is cut (gossipd_sum_weight_cut), one "
        "heavier than this on its own is refused (WeightOverCap); unset: twice the number of "
        "founding members, taken as the largest view this node has seen, itself included",
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
    peer_credit: float | None = Field(
        None,
        gt=0,
        description="the most sum-weight (per segment) one peer may hold of this node's, net: "
        "pushes are cut to it, so a sink takes at most this from each site; a peer may bring "
        "at most what it took plus this plus 1 (a leaving site's own weight), more is refused "
        "(OverCredit); unset: 1/3, or 1/2 for pushsum-expgraph and persyn (their exact "
        "average needs whole half pushes); inf: unbounded",
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
    max_stream_opens_per_s: float = Field(
        20.0,
        gt=0,
        description="push streams one peer may open per second on average (an honest one opens "
        "up to 4 per push and reuses them push after push); a peer over it and "
        "stream_open_burst has its new streams refused for a back-off (TooManyOpens)",
    )
    stream_open_burst: int = Field(
        200, ge=1, description="push streams one peer may open at once before its rate counts"
    )
    open_backoff_s: float = Field(
        1.0,
        gt=0,
        description="the first back-off of a peer over max_stream_opens_per_s; each refusal "
        "waits for its end, or this long at most, before it is answered",
    )
    max_open_backoff_s: float = Field(
        30.0,
        gt=0,
        description="the longest back-off: it doubles from open_backoff_s while the peer goes on "
        "opening too fast, and starts again from open_backoff_s once it stayed within its budget",
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
    clip_factor: float = Field(
        10.0,
        gt=0,
        description="a payload segment farther from ours (RMS) than this many times the upper "
        "median of the other senders' recent distances (each sender's largest of its last 16) "
        "is pulled in to that radius, then merged (ClippedGossip): one member's push moves a "
        "model by at most its weight share times the radius; inf: off (exact averaging of "
        "every payload, where every member is trusted)",
    )
    max_inbound_pulls: int = Field(4, ge=1, description="PullModel streams served at once")
    max_inbound_pulls_per_peer: int = Field(
        2,
        ge=1,
        description="PullModel streams one peer may hold at once (an honest one pulls one "
        "model at a time), so one peer never takes the others' slots",
    )
    min_pull_rate_bytes_s: float = Field(
        65536.0,
        gt=0,
        description="a pull this node serves must be read at this average rate, after the "
        "first stream_idle_timeout_s; a slower one is cut off (PullTooSlow)",
    )
    max_pending_bytes: int = Field(
        512 << 20,
        ge=1024,
        description="payload bytes held by unfinished inbound pushes, all streams together",
    )
    stream_idle_timeout_s: float = Field(
        10.0, gt=0, description="an inbound stream silent this long (or a pull not read) is ended"
    )
    max_push_s: float | None = Field(
        None,
        gt=0,
        description="an inbound push stream still arriving this long after it opened is ended "
        "(PushTooLong); unset: the longer of gossip.push_timeout_s and what the largest "
        "segment needs at min_push_rate_bytes_s after the first stream_idle_timeout_s",
    )
    max_connection_age_s: float = Field(
        600.0,
        gt=0,
        description="an inbound connection this old is asked to reconnect (GOAWAY); calls on "
        "it get the longest an honest call takes, then the connection is closed",
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
    :mod:`gossipd.node.net.wire.shaping` for what is delayed and how. Never for production.
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
    control_requires_signature: bool = Field(
        True,
        description="obey only control commands signed by an operator certificate of the "
        "mesh CA (tls.ca); without TLS there is no CA, so every command is refused. false: "
        "obey unsigned ones, from anyone who can publish on the broker",
    )
    control_window_s: float = Field(
        120.0,
        ge=1,
        le=3600,
        description="a signed command issued further than this from the node's clock is "
        "refused (stale); obeyed nonces are remembered this long against replay",
    )
    revoked_operators: list[str] = Field(
        default_factory=list,
        description="SHA-256 fingerprints of operator certificates whose commands are refused "
        "before they expire (a lost laptop, a colleague who left): the sha256 of gossipd "
        "certs show, or openssl x509 -fingerprint -sha256 (colons and case do not matter)",
    )

    @field_validator("revoked_operators")
    @classmethod
    def _fingerprints(cls, v: list[str]) -> list[str]:
        out = []
        for given in v:
            fingerprint = given.replace(":", "").strip().lower()
            if not re.fullmatch(r"[0-9a-f]{64}", fingerprint):
                raise ValueError(
                    f"{given!r} is not a SHA-256 fingerprint (64 hex digits, colons allowed); "
                    "take the sha256 line of gossipd certs show OPERATOR.pem"
                )
            out.append(fingerprint)
        return out

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
