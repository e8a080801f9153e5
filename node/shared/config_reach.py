"""The ``[reach]`` section: whether a site can be dialled, and what it does as a relay
for the sites that cannot (docs/nat.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ReachConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    reachable: Literal["auto"] | bool = Field(
        "auto",
        description="auto: at start a peer (a seed) dials this site back at its advertised "
        "address, and a site it cannot reach runs outbound-only through relays; false: "
        "outbound-only without asking; true: direct without asking",
    )
    relay: bool = Field(
        True,
        description="relay for sites that cannot be dialled, when this site can be; what it "
        "forwards is capped by max_sites, max_sessions and rate_mbit",
    )
    relays: int = Field(
        2, ge=1, le=8, description="relays an outbound-only site keeps attached at once"
    )
    keepalive_s: float = Field(
        2.0,
        ge=0.2,
        le=30.0,
        description="a relay and an attached site ping each other this often, and give the "
        "other up after 3x of silence (a lost relay is replaced within about 3x + a dial)",
    )
    max_sites: int = Field(32, ge=1, description="sites this relay serves at once")
    max_sessions: int = Field(64, ge=1, description="connections this relay joins at once")
    max_sessions_per_origin: int = Field(
        8, ge=1, description="of those, connections one dialling site may hold"
    )
    rate_mbit: float = Field(
        0.0,
        ge=0.0,
        description="bytes this relay forwards, both directions together, paced to this rate "
        "(Mbit/s; 0: no cap); the CPU it spends grows with it",
    )
