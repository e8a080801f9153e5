"""Protocols own their settings: each core declares them, the config's [gossip.<protocol>]
table is checked by that declaration, and every driver builds cores the same way.

The proof that a new protocol is its file plus one registry line: a protocol defined in
this file, with a setting of its own, is registered at test time (one dict entry) and
then configured, built by the daemon's replica and run by the simulator, with no other
change anywhere. How the other drivers build cores is ``tests/test_protocol_drivers.py``.
"""

from __future__ import annotations

import argparse
import logging
import textwrap
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import Field

from gossipd.node.errors import ConfigError
from gossipd.node.protocols import (
    PROTOCOLS,
    CoreSettings,
    ProtocolSettings,
    build,
    settings_class,
)
from gossipd.node.protocols.base import Push, StepEnded
from gossipd.node.protocols.ledger import SumWeightLedger
from gossipd.node.shared.config import DEPRECATED_FLAT_KEYS, load_config, parse_config
from gossipd.node.sim import SimSpec, run_sim
from gossipd.node.sim.command import add_arguments, spec_from_args
from gossipd.node.sim.spec import core_settings
from gossipd.node.trainer.replica import Replica

MINIMAL = {"mesh_id": "test-mesh", "node_id": "site-a", "tls": {"insecure": True}}
EXACT = 1e-9


# -- a protocol that exists only in this file ------------------------------------------------
class FanoutSettings(ProtocolSettings):
    """``[gossip.fanout]``"""

    peers_per_step: int = Field(2, ge=1, description="peers that get a share after each step")


class Fanout(SumWeightLedger):
    """Test-only: after each step, an equal share of the weight to ``peers_per_step`` random
    live peers (and one share kept), so the weight stays where it is on average."""

    name = "fanout"
    Settings = FanoutSettings

    def __init__(self, node_id: str, num_segments: int, *, peers_per_step: int, **ledger: Any):
        super().__init__(node_id, num_segments, **ledger)
        self.peers_per_step = peers_per_step

    @classmethod
    def from_settings(cls, common: CoreSettings, own: FanoutSettings) -> Fanout:
        return cls(**common.ledger(), peers_per_step=own.peers_per_step)

    def on_step(self, event: StepEnded) -> Iterable[Push]:
        self.round = event.step
        free = sorted(p for p in self.peers if self.can_push(p))
        chosen = self.rng.sample(free, min(self.peers_per_step, len(free)))
        share = 1.0 / (len(chosen) + 1)
        amounts = {s: self.available(s) * share for s in range(len(self.weights))}
        pushes = [self.push(peer, amounts) for peer in chosen]
        return [p for p in pushes if p is not None]


@pytest.fixture
def fanout(monkeypatch: pytest.MonkeyPatch) -> str:
    """The whole of registering a protocol: one entry in the registry."""
    monkeypatch.setitem(PROTOCOLS, "fanout", Fanout)
    return "fanout"


def _error(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data, "site.toml")
    return str(info.value)


def _gossip(**gossip: Any) -> dict[str, Any]:
    return {**MINIMAL, "gossip": gossip}


def _model() -> torch.nn.Module:
    return torch.nn.Linear(4, 2)


# -- a new protocol: its file and one registry line --------------------------------------------
def test_a_protocol_registered_at_test_time_is_configured_built_and_simulated_by_its_own_class(
    fanout: str, tmp_path: Path
) -> None:
    path = tmp_path / "site.toml"
    path.write_text(
        textwrap.dedent(
            """
            mesh_id = "test-mesh"
            node_id = "site-a"

            [gossip]
            protocol = "fanout"

            [gossip.fanout]
            peers_per_step = 3

            [tls]
            insecure = true
            """
        )
    )
    config = load_config(path)
    assert config.gossip.options == FanoutSettings(peers_per_step=3)
    core = Replica.from_config(config, _model()).core
    assert isinstance(core, Fanout) and core.peers_per_step == 3

    result = run_sim(
        SimSpec(protocol=fanout, nodes=8, rounds=6, options={"peers_per_step": 3}, seed=1)
    )
    assert result.messages == 8 * 3 * 6  # every node, three peers, every round
    assert result.consensus_error_end < result.consensus_error_start
    checked = run_sim(SimSpec(protocol=fanout, nodes=8, rounds=4, check_invariants=True))
    assert checked.invariant_mass_error is not None and checked.invariant_mass_error <= EXACT


def test_a_registered_protocols_table_gets_did_you_mean_and_range_errors(fanout: str) -> None:
    message = _error(_gossip(protocol=fanout, fanout={"peers_per_stp": 3}))
    assert "gossip.fanout.peers_per_stp: unknown key; did you mean 'peers_per_step'?" in message
    message = _error(_gossip(protocol=fanout, fanout={"peers_per_step": 0}))
    assert "gossip.fanout.peers_per_step = 0: Input should be greater than or equal to 1" in message


def test_gossipd_sim_takes_a_registered_protocols_settings_with_set(fanout: str) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--protocol", fanout, "--set", "peers_per_step=4"])
    spec = spec_from_args(args)
    assert spec.options == {"peers_per_step": 4}
    core = build(fanout, core_settings(spec, "n0", 1, 1.0))
    assert isinstance(core, Fanout) and core.peers_per_step == 4
    with pytest.raises(ConfigError, match="did you mean 'peers_per_step'"):
        spec_from_args(parser.parse_args(["--protocol", fanout, "--set", "peers_per_stepz=4"]))


# -- every protocol's declaration -----------------------------------------------------------------
@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_every_setting_of_every_protocol_has_a_type_a_default_and_a_description(
    protocol: str,
) -> None:
    cls = settings_class(protocol)
    assert issubclass(cls, ProtocolSettings)
    for key, field in cls.model_fields.items():
        assert not field.is_required(), f"{protocol}.{key} has no default"
        assert field.description, f"{protocol}.{key} has no description"
        assert field.annotation is not None


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_without_a_table_a_protocol_gets_its_declared_defaults(protocol: str) -> None:
    config = parse_config(_gossip(protocol=protocol))
    assert config.gossip.options == settings_class(protocol)()
    core = Replica.from_config(config, _model()).core
    for key, value in settings_class(protocol)().model_dump().items():
        assert getattr(core, key) == value


def test_a_core_registered_as_a_plain_function_takes_no_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def bare(common: CoreSettings) -> Fanout:
        return Fanout(**common.ledger(), peers_per_step=1)

    monkeypatch.setitem(PROTOCOLS, "bare", bare)
    core = build("bare", CoreSettings("a", 1))
    assert isinstance(core, Fanout)
    assert parse_config(_gossip(protocol="bare", bare={})).gossip.options.model_dump() == {}
    message = _error(_gossip(protocol="bare", bare={"peers_per_step": 2}))
    assert "gossip.bare.peers_per_step: unknown key; this protocol takes no settings" in message


# -- the config's tables ---------------------------------------------------------------------------
def test_a_table_reaches_the_core_the_daemon_builds() -> None:
    config = parse_config(_gossip(protocol="persyn", persyn={"average_every_steps": 7}))
    core = Replica.from_config(config, _model()).core
    assert core.average_every_steps == 7  # type: ignore[attr-defined]


def test_a_table_for_another_protocol_is_kept_and_checked_but_not_used() -> None:
    config = parse_config(
        _gossip(
            protocol="sumweight",
            sumweight={"push_probability": 0.25},
            persyn={"average_every_steps": 7},
        )
    )
    assert config.gossip.options.push_probability == 0.25  # type: ignore[attr-defined]
    assert config.gossip.options_for("persyn").average_every_steps == 7  # type: ignore[attr-defined]
    assert config.gossip.options_for("crossover").round_steps == 1  # type: ignore[attr-defined]
    message = _error(_gossip(protocol="sumweight", persyn={"average_every_steps": 0}))
    assert "gossip.persyn.average_every_steps = 0" in message


def test_misspelt_table_and_keys_get_did_you_mean() -> None:
    message = _error(_gossip(persin={"average_every_steps": 7}))
    assert "gossip.persin: unknown key; did you mean 'persyn'?" in message
    message = _error(_gossip(protocol="persyn", persyn={"average_every_step": 7}))
    assert "gossip.persyn.average_every_step: unknown key" in message
    assert "did you mean 'average_every_steps'?" in message
    # a key of another protocol: nothing close, so the keys this one knows
    message = _error(_gossip(sumweight={"round_steps": 2}))
    assert "gossip.sumweight.round_steps: unknown key; known keys: push_probability" in message


def test_a_table_that_is_not_a_table_is_refused() -> None:
    message = _error(_gossip(protocol="persyn", persyn=5))
    assert "gossip.persyn = 5" in message and "valid dictionary" in message


def test_errors_in_tables_and_in_the_section_are_reported_together() -> None:
    message = _error(
        _gossip(codec="zstd", persin={}, sumweight={"push_probability": 2}, crossover={"x": 1})
    )
    for key in ("gossip.codec", "gossip.persin", "gossip.sumweight.push_probability"):
        assert f"  {key}" in message
    assert "  gossip.crossover.x: unknown key" in message
    assert len(message.splitlines()) == 5


# -- the deprecated flat keys ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("protocol", "key", "value"),
    [
        ("sumweight", "push_probability", 0.0),
        ("crossover", "round_steps", 3),
        ("pushsum-expgraph", "round_steps", 3),
        ("shuffle-exchange", "round_steps", 3),
        ("persyn", "average_every_steps", 9),
    ],
)
def test_a_deprecated_flat_key_still_reaches_the_selected_protocol_and_says_so(
    protocol: str, key: str, value: float, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="gossipd.node.shared.config"):
        config = parse_config(_gossip(protocol=protocol, **{key: value}))
    assert getattr(config.gossip.options, key) == value
    assert getattr(Replica.from_config(config, _model()).core, key) == value
    assert f"gossip.{key} is deprecated: write it in [gossip.{protocol}]" in caplog.text
    assert config == parse_config(_gossip(protocol=protocol, **{protocol: {key: value}}))


def test_a_flat_key_the_selected_protocol_lacks_is_ignored_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="gossipd.node.shared.config"):
        config = parse_config(
            _gossip(protocol="crossover", push_probability=0.1, average_every_steps=5)
        )
    assert config.gossip.options == settings_class("crossover")()
    assert "gossip.push_probability is ignored: protocol 'crossover'" in caplog.text
    assert "gossip.average_every_steps is ignored" in caplog.text


def test_a_setting_given_flat_and_in_its_table_is_refused_naming_both() -> None:
    message = _error(_gossip(push_probability=0.1, sumweight={"push_probability": 0.9}))
    assert "gossip.push_probability = 0.1: set here and in [gossip.sumweight]" in message
    assert "keep only the one in [gossip.sumweight]" in message


def test_a_bad_flat_value_is_named_by_the_key_as_written() -> None:
    message = _error(_gossip(push_probability=1.5))
    assert "gossip.push_probability = 1.5: Input should be less than or equal to 1" in message


def test_flat_keys_stay_known_to_did_you_mean() -> None:
    assert set(DEPRECATED_FLAT_KEYS) == {"push_probability", "round_steps", "average_every_steps"}
    message = _error(_gossip(round_step=2))
    assert "gossip.round_step: unknown key; did you mean 'round_steps'?" in message


def test_no_warning_without_flat_keys(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="gossipd.node.shared.config"):
        parse_config(_gossip(protocol="crossover", crossover={"round_steps": 2}))
    assert caplog.text == ""
