"""The baselines' one entry point: :data:`gossipd.node.baselines.BASELINES`.

Every place that treats a baseline apart from the gossip protocols asks the registry
(``gossipd node``, ``mesh up``'s --protocol, the local mesh's configs and its runner), and
the config, which may not import the baselines' room, declares the same names with their
sections. These tests hold the two lists together and check that a baseline's local-mesh
config is one the config accepts.
"""

from __future__ import annotations

import tomllib
import typing
from pathlib import Path

import pytest

from gossipd.node.baselines import BASELINES
from gossipd.node.cli.main import build_parser
from gossipd.node.errors import ConfigError, GossipdError
from gossipd.node.launch.launcher import check_spec
from gossipd.node.launch.meshconfigs import node_toml
from gossipd.node.launch.meshspec import MeshSpec
from gossipd.node.protocols import PROTOCOLS
from gossipd.node.shared.config import NodeConfig, parse_config
from gossipd.node.shared.config_ranks import BASELINE_SECTIONS


def test_the_registry_and_the_config_name_the_same_baselines_apart_from_the_protocols() -> None:
    assert set(BASELINES) == set(BASELINE_SECTIONS)
    assert not set(BASELINES) & set(PROTOCOLS)
    for name, section in BASELINE_SECTIONS.items():
        field = NodeConfig.model_fields[name]  # [name]: an optional section of its type
        assert set(typing.get_args(field.annotation)) == {section, type(None)}
        assert field.default is None


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_each_baseline_names_a_site_function_that_exists(name: str) -> None:
    import importlib

    module, _, function = BASELINES[name].site_entry.partition(":")
    assert callable(getattr(importlib.import_module(module), function))


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_a_local_mesh_site_config_of_a_baseline_is_valid_and_names_the_rendezvous(
    tmp_path: Path, name: str
) -> None:
    spec = MeshSpec(nodes=2, protocol=name, insecure=True)
    text = node_toml(spec, "m", 1, [50001, 50002], tmp_path, rendezvous="127.0.0.1:50003")
    config = parse_config(tomllib.loads(text), "node-1")
    assert config.gossip.protocol == name
    assert getattr(config, name).master == "127.0.0.1:50003"
    assert f"[gossip.{name}]" not in text  # no gossip protocol, no protocol table
    with pytest.raises(GossipdError, match="without a rendezvous"):
        node_toml(spec, "m", 1, [50001, 50002], tmp_path)


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_mesh_up_offers_every_baseline_and_refuses_ranks_with_one(name: str) -> None:
    args = build_parser().parse_args(["mesh", "up", "--protocol", name])
    assert args.protocol == name
    with pytest.raises(SystemExit):  # demo runs gossip, alone and with: no baseline
        build_parser().parse_args(["demo", "--protocol", name])
    with pytest.raises(GossipdError, match=f"--ranks with --protocol {name}: the baseline"):
        check_spec(MeshSpec(nodes=2, protocol=name, ranks=2))


def test_an_unknown_protocol_lists_the_protocols_and_the_baselines() -> None:
    config = {"mesh_id": "m", "node_id": "a", "tls": {"insecure": True}}
    with pytest.raises(ConfigError) as err:
        parse_config({**config, "gossip": {"protocol": "ddp"}})
    message = str(err.value)
    assert all(name in message for name in [*PROTOCOLS, *BASELINES])
    assert "(or allreduce, the synchronous baseline, or diloco, the low-communication" in message


def test_gossipd_node_refuses_ranks_for_a_baseline_site(tmp_path: Path) -> None:
    """Before torch: a baseline's site is one process, a rank of the baseline's group."""
    from gossipd.node.cli.main import main

    path = tmp_path / "site.toml"
    path.write_text(
        f'mesh_id = "m"\nnode_id = "a"\ndata_dir = "{tmp_path / "a"}"\n'
        '[gossip]\nprotocol = "allreduce"\n[allreduce]\nmaster = "127.0.0.1:29500"\n'
        "[tls]\ninsecure = true\n"
    )
    assert main(["node", "--config", str(path), "--ranks", "2"]) == 2
