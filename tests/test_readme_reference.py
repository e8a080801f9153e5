"""The reference pages are complete: every key a site's or the coordinator's config takes
has a row with its default, and every metric a node or the coordinator exports has a row.

The pages are generated (``docs/gen_reference.py``; ``tests/test_docs.py`` checks they are
current), so these tests guard the generator: a walk that missed a section, or a table
that lost its protocol settings, would still leave a page "up to date". A key or a
metric without its row is one an operator cannot find.
"""

from __future__ import annotations

import json
import typing
from pathlib import Path

from pydantic import BaseModel

from gossipd.coordinator.config import CoordinatorConfig
from gossipd.coordinator.metrics import CoordinatorMetrics
from gossipd.node.net.telemetry.metrics import NodeMetrics
from gossipd.node.protocols import PROTOCOLS, settings_class
from gossipd.node.shared.config import NodeConfig

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "reference"
CONFIG = REFERENCE / "config.md"
METRICS = REFERENCE / "metrics.md"


def _rows(page: Path, after: str = "", before: str = "\0") -> list[str]:
    """Table rows (``| `a` | ...``) of ``page`` between the headings ``after`` and ``before``."""
    text = page.read_text()
    text = text.split(after, 1)[1] if after else text
    text = text.split(before, 1)[0]
    return [line for line in text.splitlines() if line.startswith("| `")]


def _first_cells(rows: list[str]) -> list[str]:
    return [row.split("|")[1].strip() for row in rows]


def _keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted keys of every leaf setting; a field typed by a section descends into it."""
    keys = []
    for name, field in model.model_fields.items():
        sections = [
            t
            for t in (field.annotation, *typing.get_args(field.annotation))
            if isinstance(t, type) and issubclass(t, BaseModel)
        ]
        if sections:
            keys += _keys(sections[0], f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def test_every_site_config_key_has_a_row_in_the_config_reference() -> None:
    cells = _first_cells(_rows(CONFIG, "## Site config", "## Coordinator config"))
    keys = _keys(NodeConfig)
    assert "limits.min_pull_rate_bytes_s" in keys  # the walk reaches the sections
    missing = [key for key in keys if f"`{key}`" not in cells]
    assert not missing, f"config keys without a row in {CONFIG}: {missing}"


def test_every_protocol_setting_has_a_row_with_its_default() -> None:
    text = CONFIG.read_text()
    for protocol in PROTOCOLS:
        for key, value in settings_class(protocol)().model_dump().items():
            # As a TOML config would hold it: a whole number without ".0".
            whole = isinstance(value, float) and value.is_integer()
            shown = str(int(value)) if whole else json.dumps(value)
            assert f"| `gossip.{protocol}.{key}` | `{shown}` |" in text, key


def test_every_coordinator_config_key_has_a_row_in_the_config_reference() -> None:
    cells = _first_cells(_rows(CONFIG, "## Coordinator config"))
    keys = _keys(CoordinatorConfig)
    assert "scheduler.lease_s" in keys and "tls.allow" in keys
    missing = [key for key in keys if f"`{key}`" not in cells]
    assert not missing, f"coordinator keys without a row in {CONFIG}: {missing}"


def _exported(registry_holder: object) -> list[str]:
    families = registry_holder.registry.collect()  # type: ignore[attr-defined]
    return [f.name + ("_total" if f.type == "counter" else "") for f in families]


def test_every_exported_metric_has_a_row_in_the_metrics_reference() -> None:
    cells = _first_cells(_rows(METRICS, "## Site metrics", "## Coordinator metrics"))
    names = _exported(NodeMetrics())
    assert "gossipd_inbound_pull_streams" in names
    missing = [name for name in names if f"`{name}`" not in cells]
    assert not missing, f"metrics without a row in {METRICS}: {missing}"


def test_every_coordinator_metric_has_a_row_in_the_metrics_reference() -> None:
    cells = _first_cells(_rows(METRICS, "## Coordinator metrics"))
    names = _exported(CoordinatorMetrics())
    for metric in ("members", "epoch", "grants_total", "rejected_total", "pairings_total"):
        assert f"gossipd_coordinator_{metric}" in names
    missing = [name for name in names if f"`{name}`" not in cells]
    assert not missing, f"coordinator metrics without a row in {METRICS}: {missing}"
