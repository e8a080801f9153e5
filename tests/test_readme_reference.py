"""The README's references are complete: every key a site's config takes has a row in the
config reference, and every metric a node exports has a row in the metrics table.

A key or a metric added without its row is one an operator cannot find (the protocol
tables have their own check, with defaults, in test_protocol_settings).
"""

from __future__ import annotations

import typing
from pathlib import Path

from pydantic import BaseModel

from gossipd.node.net.metrics import NodeMetrics
from gossipd.node.shared.config import NodeConfig

README = Path(__file__).resolve().parents[1] / "README.md"


def _first_cells() -> list[str]:
    """The first cell of every table row (``| `a`, `b` | ...``)."""
    lines = README.read_text().splitlines()
    return [line.split("|")[1] for line in lines if line.startswith("| `")]


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


def test_every_config_key_has_a_row_in_the_config_reference() -> None:
    cells = _first_cells()
    keys = _keys(NodeConfig)
    assert "limits.min_pull_rate_bytes_s" in keys  # the walk reaches the sections
    missing = [key for key in keys if not any(f"`{key}`" in cell for cell in cells)]
    assert not missing, f"config keys without a README row: {missing}"


def test_every_exported_metric_has_a_row_in_the_metrics_table() -> None:
    cells = _first_cells()
    families = NodeMetrics().registry.collect()
    names = [f.name + ("_total" if f.type == "counter" else "") for f in families]
    assert "gossipd_inbound_pull_streams" in names
    missing = [name for name in names if not any(f"`{name}`" in cell for cell in cells)]
    assert not missing, f"metrics without a README row: {missing}"
