"""Every driver builds protocol cores through the protocols' own settings: ``build()``, the
simulator and ``gossipd sim``'s flags, ``bench protocols``, a local mesh's node configs;
and the protocol registry and the config load nothing heavy.

The settings' declarations and the config's ``[gossip.<protocol>]`` tables are
``tests/test_protocol_settings.py``.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gossipd.node.errors import ConfigError
from gossipd.node.launch.localmesh import MeshSpec, node_toml
from gossipd.node.protocols import CoreSettings, build, protocol_settings
from gossipd.node.shared.config import load_config
from gossipd.node.sim import SimSpec
from gossipd.node.sim.command import add_arguments, spec_from_args
from gossipd.node.sim.spec import core_settings


# -- build() and the other drivers ----------------------------------------------------------------
def test_build_checks_options_through_the_protocols_class() -> None:
    core = build("persyn", CoreSettings("a", 1, options={"average_every_steps": 4}))
    assert core.average_every_steps == 4  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="did you mean 'average_every_steps'"):
        build("persyn", CoreSettings("a", 1, options={"average_every_step": 4}))
    with pytest.raises(ValueError, match=r"round_steps = 0: .*greater than or equal to 1"):
        build("crossover", CoreSettings("a", 1, options={"round_steps": 0}))
    with pytest.raises(ValueError, match="PerSynSettings given for protocol 'crossover'"):
        build("crossover", CoreSettings("a", 1, options=protocol_settings("persyn")))
    with pytest.raises(ValueError, match="unknown protocol 'nope'"):
        build("nope", CoreSettings("a", 1))


def test_the_simulator_fills_its_round_and_burst_only_where_the_protocol_has_them() -> None:
    def options(**spec: Any) -> Any:
        return core_settings(SimSpec(nodes=8, **spec), "n0", 1, 1.0).options

    assert options(protocol="persyn") == {"average_every_steps": 3}  # ⌈log2 8⌉
    assert options(protocol="persyn", options={"average_every_steps": 5}) == {
        "average_every_steps": 5
    }
    assert options(protocol="crossover", round_steps=2) == {"round_steps": 2}
    assert options(protocol="sumweight", round_steps=2) == {}
    assert options(protocol="sumweight", options={"push_probability": 1.0}) == {
        "push_probability": 1.0
    }


def test_gossipd_sims_deprecated_flags_map_into_the_options() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    spec = spec_from_args(parser.parse_args(["--protocol", "sumweight", "--push-probability", "1"]))
    assert spec.options == {"push_probability": 1.0}
    spec = spec_from_args(parser.parse_args(["--protocol", "crossover", "--push-probability", "1"]))
    assert spec.options == {}  # as before: a flag the protocol does not use does nothing
    with pytest.raises(ConfigError, match="both given"):
        spec_from_args(
            parser.parse_args(
                [
                    "--protocol",
                    "persyn",
                    "--average-every-steps",
                    "4",
                    "--set",
                    "average_every_steps=5",
                ]
            )
        )


def test_bench_protocols_takes_settings_per_protocol() -> None:
    from gossipd.bench.protocols import options_by_protocol

    assert options_by_protocol(
        ["persyn.average_every_steps=8", "sumweight.push_probability=1"]
    ) == {
        "persyn": {"average_every_steps": 8},
        "sumweight": {"push_probability": 1},
    }
    with pytest.raises(ConfigError, match="'persin' is not a protocol"):
        options_by_protocol(["persin.average_every_steps=8"])
    with pytest.raises(ConfigError, match="did you mean 'average_every_steps'"):
        options_by_protocol(["persyn.average_every_step=8"])


@pytest.mark.parametrize(
    ("protocol", "expected"),
    [("crossover", {"round_steps": 3}), ("sumweight", {"push_probability": 1.0})],
)
def test_a_local_mesh_writes_the_protocols_own_table(
    protocol: str, expected: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spec = MeshSpec(protocol=protocol, round_steps=3, push_probability=1.0, insecure=True)
    text = node_toml(spec, "m", 0, [50001, 50002], tmp_path)
    assert f"[gossip.{protocol}]" in text
    path = tmp_path / "node.toml"
    path.write_text(text)
    with caplog.at_level(logging.WARNING, logger="gossipd.node.shared.config"):
        config = load_config(path)
    assert config.gossip.options.model_dump() == expected
    assert caplog.text == ""  # nothing deprecated


@pytest.mark.parametrize(("share", "expected"), [(None, 0.03), (0.25, 0.25), (1.0, 1.0)])
def test_mesh_up_gives_every_node_the_cpu_share_asked_for(
    share: float | None, expected: float, tmp_path: Path
) -> None:
    """`mesh up --cpu-share` (MeshSpec.cpu_share) reaches gossip.cpu_share; none: default."""
    spec = MeshSpec(cpu_share=share, insecure=True)
    path = tmp_path / "node.toml"
    path.write_text(node_toml(spec, "m", 1, [50001, 50002], tmp_path))
    assert load_config(path).gossip.cpu_share == expected


# -- import cost ---------------------------------------------------------------------------
HEAVY = ("grpc", "google.protobuf", "torch")


def _loaded_after(first: str, then: str) -> list[str]:
    """Heavy modules that importing ``then`` loads beyond what ``first`` already loaded."""
    code = f"""
import json, sys
import {first}
before = set(sys.modules)
import {then}
print(json.dumps(sorted(set(sys.modules) - before)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return [m for m in json.loads(out.stdout) if m.startswith(HEAVY)]


def test_the_registry_and_every_core_load_neither_grpc_nor_protobuf_nor_torch() -> None:
    assert _loaded_after("json", "gossipd.node.protocols") == []


def test_the_config_adds_neither_grpc_nor_protobuf_nor_torch_to_what_errors_load() -> None:
    # errors.py imports grpc for status codes (its own layering issue); the config, the
    # protocol registry it validates tables with and pydantic add nothing heavy to it.
    assert _loaded_after("gossipd.node.errors", "gossipd.node.shared.config") == []
