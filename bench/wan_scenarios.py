"""Wide-area scenarios: each site's bandwidth and latency, read from a small TOML file.

A scenario does not fix the number of sites, so one file serves a 3-site test and an
8-site benchmark: it gives a default ``rate_mbit`` and ``latency_ms`` for every site and
optional overrides for listed sites (``bench/wan_scenarios.toml`` has the format and the
shipped scenarios). The testbed (:mod:`gossipd.bench.wan_net`) shapes each site's
bandwidth with ``tc``; the latency goes into the site's ``[link] latency_ms``.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gossipd.node.errors import ConfigError

DEFAULT_PATH = Path(__file__).with_name("wan_scenarios.toml")
SCENARIO_KEYS = ("description", "rate_mbit", "latency_ms", "override")
OVERRIDE_KEYS = ("sites", "rate_mbit", "latency_ms")
MAX_RATE_MBIT = 1_000_000.0  # 1 Tbit/s: far above any link, far below what tc can count


@dataclass(frozen=True)
class SiteLink:
    """One site's access link: its bandwidth in both directions and its one-way latency."""

    rate_mbit: float
    latency_ms: float

    def __post_init__(self) -> None:
        # tc takes a negative rate as 0 bit/s (a link that sends nothing) without a word.
        if _number(self.rate_mbit) is None or not 0 < self.rate_mbit <= MAX_RATE_MBIT:
            raise ConfigError(
                f"a site's rate_mbit must be a number above 0 and at most {MAX_RATE_MBIT:.0f}, "
                f"got {self.rate_mbit!r}; give e.g. SiteLink(rate_mbit=100, latency_ms=5)"
            )
        if _number(self.latency_ms) is None or self.latency_ms < 0:
            raise ConfigError(
                f"a site's latency_ms must be a number of milliseconds, 0 or more, got "
                f"{self.latency_ms!r}; give e.g. SiteLink(rate_mbit=100, latency_ms=5)"
            )


@dataclass(frozen=True)
class Override:
    """Other link values for the sites listed (``None``: the scenario's default)."""

    sites: tuple[int, ...]
    rate_mbit: float | None
    latency_ms: float | None


@dataclass(frozen=True)
class Scenario:
    """A named assignment of links to sites, for any number of sites."""

    name: str
    description: str
    rate_mbit: float
    latency_ms: float
    overrides: tuple[Override, ...] = ()

    def links(self, n_sites: int) -> list[SiteLink]:
        """Site 0's link first; overrides naming sites past ``n_sites`` are ignored, so
        ``two-fast-six-slow`` with 4 sites has 2 fast and 2 slow ones."""
        if isinstance(n_sites, bool) or not isinstance(n_sites, int) or n_sites < 1:
            raise ConfigError(
                f"scenario {self.name!r}: the number of sites must be an integer of at "
                f"least 1, got {n_sites!r}"
            )
        links = [SiteLink(self.rate_mbit, self.latency_ms) for _ in range(n_sites)]
        for override in self.overrides:
            for site in override.sites:
                if site < n_sites:
                    links[site] = SiteLink(
                        override.rate_mbit if override.rate_mbit is not None else self.rate_mbit,
                        override.latency_ms if override.latency_ms is not None else self.latency_ms,
                    )
        return links


def load_scenarios(path: Path | str | None = None) -> dict[str, Scenario]:
    """Every scenario in ``path`` (default: the file shipped beside this module), checked
    whole: a wrong key or value raises :class:`ConfigError` naming the file, the key and
    the fix, before any network is built."""
    path = Path(path) if path is not None else DEFAULT_PATH
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(
            f"cannot read the scenario file {path}: {err.strerror or err}; give the path "
            f"of a TOML file of scenarios (the format is in {DEFAULT_PATH})"
        ) from err
    try:
        tables = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path} is not valid TOML: {err}; fix the syntax there") from err
    if not tables:
        raise ConfigError(f"{path} holds no scenario; add a table such as [uniform-100mbit-5ms]")
    return {name: _scenario(path, name, table) for name, table in tables.items()}


def scenario(name: str, path: Path | str | None = None) -> Scenario:
    """The scenario called ``name``; an unknown name raises :class:`ConfigError` listing
    the known ones."""
    scenarios = load_scenarios(path)
    if name not in scenarios:
        where = path if path is not None else DEFAULT_PATH
        raise ConfigError(
            f"no scenario {name!r} in {where}; use one of {', '.join(sorted(scenarios))} "
            f"or add a [{name}] table there"
        )
    return scenarios[name]


def _scenario(path: Path, name: str, table: Any) -> Scenario:
    if not isinstance(table, dict):
        raise ConfigError(
            f"{path}: {name!r} must be a table ([{name}] with rate_mbit and latency_ms), "
            f"got {table!r}"
        )
    _known_keys(path, f"[{name}]", table, SCENARIO_KEYS)
    for key in ("rate_mbit", "latency_ms"):
        if key not in table:
            raise ConfigError(f"{path}: [{name}] has no {key}; add {key} = <number> there")
    description = table.get("description", "")
    if not isinstance(description, str):
        raise ConfigError(f"{path}: [{name}] description must be a string, got {description!r}")
    raw_overrides = table.get("override", [])
    if not isinstance(raw_overrides, list) or not all(isinstance(o, dict) for o in raw_overrides):
        raise ConfigError(
            f"{path}: [{name}] override must be an array of tables ([[{name}.override]] "
            f"with sites and rate_mbit and/or latency_ms), got {raw_overrides!r}"
        )
    overrides = tuple(
        _override(path, f"[[{name}.override]] #{k + 1}", raw) for k, raw in enumerate(raw_overrides)
    )
    seen: set[int] = set()
    for override in overrides:
        twice = seen.intersection(override.sites)
        if twice:
            raise ConfigError(
                f"{path}: [{name}] overrides site {min(twice)} twice; list each site in "
                f"one [[{name}.override]] only"
            )
        seen.update(override.sites)
    return Scenario(
        name=name,
        description=description,
        rate_mbit=_rate(path, f"[{name}] rate_mbit", table["rate_mbit"]),
        latency_ms=_latency(path, f"[{name}] latency_ms", table["latency_ms"]),
        overrides=overrides,
    )


def _override(path: Path, where: str, raw: dict[str, Any]) -> Override:
    _known_keys(path, where, raw, OVERRIDE_KEYS)
    sites = raw.get("sites")
    if (
        not isinstance(sites, list)
        or not sites
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in sites)
    ):
        raise ConfigError(
            f"{path}: {where} sites must be a non-empty list of site indices (0, 1, ...), "
            f"got {sites!r}; write sites = [0, 1]"
        )
    if "rate_mbit" not in raw and "latency_ms" not in raw:
        raise ConfigError(f"{path}: {where} changes nothing; give it rate_mbit and/or latency_ms")
    return Override(
        sites=tuple(sites),
        rate_mbit=_rate(path, f"{where} rate_mbit", raw["rate_mbit"])
        if "rate_mbit" in raw
        else None,
        latency_ms=_latency(path, f"{where} latency_ms", raw["latency_ms"])
        if "latency_ms" in raw
        else None,
    )


def _known_keys(path: Path, where: str, table: dict[str, Any], known: tuple[str, ...]) -> None:
    for key in table:
        if key not in known:
            raise ConfigError(
                f"{path}: {where} has an unknown key {key!r}; the keys are {', '.join(known)}"
            )


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _rate(path: Path, where: str, value: Any) -> float:
    rate = _number(value)
    if rate is None or not 0 < rate <= MAX_RATE_MBIT:
        raise ConfigError(
            f"{path}: {where} must be a number of Mbit/s above 0 and at most "
            f"{MAX_RATE_MBIT:.0f}, got {value!r}; "
            f"write e.g. rate_mbit = 100"
        )
    return rate


def _latency(path: Path, where: str, value: Any) -> float:
    latency = _number(value)
    if latency is None or latency < 0:
        raise ConfigError(
            f"{path}: {where} must be a number of milliseconds, 0 or more, got {value!r}; "
            f"write e.g. latency_ms = 50"
        )
    return latency
