"""Site config (gossipd.node.shared.config): defaults, and errors that name key, value and fix."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from gossipd.node.errors import ConfigError, GossipdError
from gossipd.node.protocols import settings_class
from gossipd.node.shared.config import NodeConfig, load_config, parse_config

MINIMAL = {"mesh_id": "test-mesh", "node_id": "site-a", "tls": {"insecure": True}}


def _error(data: dict[str, Any], source: str = "site.toml") -> str:
    """The message parse_config raises for ``data`` (which must be invalid)."""
    with pytest.raises(ConfigError) as info:
        parse_config(data, source)
    return str(info.value)


def _with(**overrides: Any) -> dict[str, Any]:
    return {**MINIMAL, **overrides}


def _write(tmp_path: Path, text: str, name: str = "site.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


# ---------------------------------------------------------------------------
# valid files


def test_minimal_toml_loads_with_defaults(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
        mesh_id = "test-mesh"
        node_id = "site-a"

        [tls]
        insecure = true
        """,
    )
    config = load_config(path)
    assert isinstance(config, NodeConfig)
    assert config.mesh_id == "test-mesh"
    assert config.node_id == "site-a"
    assert config.listen == "127.0.0.1:0"
    assert config.advertise is None
    assert config.seeds == []
    assert config.data_dir == Path("gossipd-state")
    assert config.join is False
    assert config.job.name == "digits"
    assert (config.job.shard_index, config.job.num_shards) == (0, 1)
    assert config.job.learning_rate is None
    assert config.job.options == {}
    assert config.gossip.protocol == "sumweight"
    assert config.gossip.options.push_probability == 0.5  # type: ignore[attr-defined]
    assert config.gossip.codec == "raw"
    assert config.membership.suspect_after_failures == 3
    assert config.membership.drop_after_s == 60.0
    assert config.limits.inbox_size == 16
    assert config.checkpoint.every_steps == 200
    assert config.metrics.listen == "127.0.0.1:0"


def test_load_config_accepts_str_path_and_equals_parse_config(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
        mesh_id = "m.1_x-y"
        node_id = "n"
        listen = "0.0.0.0:50051"
        seeds = ["10.0.0.1:50051", "example.org:65535"]

        [job]
        name = "synthetic"
        shard_index = 2
        num_shards = 3
        learning_rate = 0.0

        [gossip]
        codec = "bf16"

        [gossip.sumweight]
        push_probability = 1.0

        [metrics]
        listen = "127.0.0.1:9100"

        [tls]
        insecure = true
        """,
    )
    config = load_config(str(path))
    assert config.mesh_id == "m.1_x-y"
    assert config.seeds == ["10.0.0.1:50051", "example.org:65535"]
    assert (config.job.shard_index, config.job.num_shards) == (2, 3)
    assert config.job.learning_rate == 0.0
    assert config.gossip.options.push_probability == 1.0  # type: ignore[attr-defined]
    assert config.gossip.codec == "bf16"
    assert config.metrics.listen == "127.0.0.1:9100"
    assert config == parse_config(
        {
            "mesh_id": "m.1_x-y",
            "node_id": "n",
            "listen": "0.0.0.0:50051",
            "seeds": ["10.0.0.1:50051", "example.org:65535"],
            "job": {"name": "synthetic", "shard_index": 2, "num_shards": 3, "learning_rate": 0.0},
            "gossip": {"codec": "bf16", "sumweight": {"push_probability": 1.0}},
            "tls": {"insecure": True},
            "metrics": {"listen": "127.0.0.1:9100"},
        }
    )


def test_config_is_frozen() -> None:
    config = parse_config(MINIMAL)
    with pytest.raises(Exception):  # noqa: B017 - pydantic's frozen-instance error
        config.mesh_id = "other"  # type: ignore[misc]


def test_config_error_is_a_gossipd_error() -> None:
    assert issubclass(ConfigError, GossipdError)


# ---------------------------------------------------------------------------
# unknown keys


def test_unknown_top_level_key_suggests_near_miss() -> None:
    message = _error(_with(gosip={"push_probability": 0.1}))
    assert "site.toml" in message
    assert "gosip" in message
    assert "unknown key" in message
    assert "did you mean 'gossip'?" in message


def test_unknown_nested_key_names_full_path_and_suggests() -> None:
    message = _error(_with(gossip={"push_probabilty": 0.1}))
    assert "gossip.push_probabilty" in message
    assert "unknown key" in message
    # Not the deprecated flat spelling: where the key lives now.
    assert "did you mean 'push_probability'? It lives in the protocol's own table" in message
    assert "[gossip.sumweight] push_probability = ..." in message


def test_unknown_key_without_near_miss_lists_known_keys() -> None:
    message = _error(_with(membership={"zzzzqqqq": 1}))
    assert "membership.zzzzqqqq: unknown key" in message
    assert "known keys:" in message
    for key in ("start_after_peers", "suspect_after_failures", "drop_after_s"):
        assert key in message


# ---------------------------------------------------------------------------
# missing and malformed values


def test_missing_mesh_id_is_required() -> None:
    message = _error({"node_id": "site-a"})
    assert "mesh_id" in message
    assert "required" in message
    assert "mesh_id = ..." in message


@pytest.mark.parametrize("value", ["localhost", "1.2.3.4:99999", ":50051", "host:", "h:-1"])
def test_bad_listen_address(value: str) -> None:
    message = _error(_with(listen=value))
    assert f"listen = {value!r}" in message
    assert "is not HOST:PORT" in message
    assert "127.0.0.1:50051" in message  # the example of a fix


@pytest.mark.parametrize("value", ["localhost", "1.2.3.4:99999"])
def test_bad_seed_address(value: str) -> None:
    message = _error(_with(seeds=["10.0.0.1:50051", value]))
    assert "seeds" in message
    assert repr(value) in message
    assert "is not HOST:PORT" in message


@pytest.mark.parametrize("value", ["localhost", "1.2.3.4:99999"])
def test_bad_metrics_listen_address(value: str) -> None:
    message = _error(_with(metrics={"listen": value}))
    assert f"metrics.listen = {value!r}" in message
    assert "is not HOST:PORT" in message


def test_bad_advertise_address() -> None:
    message = _error(_with(advertise="localhost"))
    assert "advertise = 'localhost'" in message
    assert "is not HOST:PORT" in message


@pytest.mark.parametrize("port", ["0", "65535"])
def test_port_bounds_accepted(port: str) -> None:
    assert parse_config(_with(listen=f"h:{port}")).listen == f"h:{port}"


@pytest.mark.parametrize("value", ["1.2.3.4:\u0663", "1.2.3.4:\u00b2"])
def test_non_ascii_digit_port_is_rejected_as_not_host_port(value: str) -> None:
    # str.isdigit() is true for ARABIC-INDIC DIGIT THREE and SUPERSCRIPT TWO; neither is a port.
    message = _error(_with(listen=value))
    assert "is not HOST:PORT" in message


def test_push_probability_above_one() -> None:
    message = _error(_with(gossip={"sumweight": {"push_probability": 1.5}}))
    assert "gossip.sumweight.push_probability = 1.5" in message
    assert "less than or equal to 1" in message


def test_unknown_codec_lists_choices() -> None:
    message = _error(_with(gossip={"codec": "zstd"}))
    assert "gossip.codec = 'zstd'" in message
    for choice in ("'raw'", "'fp16'", "'bf16'", "'int8'", "'int4'"):
        assert choice in message


@pytest.mark.parametrize(("index", "shards"), [(3, 3), (5, 2), (1, 1)])
def test_shard_index_must_be_below_num_shards(index: int, shards: int) -> None:
    message = _error(_with(job={"shard_index": index, "num_shards": shards}))
    assert f"job.shard_index {index}" in message
    assert f"job.num_shards {shards}" in message
    assert "0..num_shards-1" in message


def test_shard_index_default_num_shards() -> None:
    message = _error(_with(job={"shard_index": 1}))
    assert "job.shard_index 1" in message
    assert "job.num_shards 1" in message


@pytest.mark.parametrize("value", ["a b", "mesh/1", "mesh:1", "méš", ""])
def test_bad_mesh_id_characters(value: str) -> None:
    message = _error(_with(mesh_id=value))
    assert f"mesh_id = {value!r}" in message
    if value:
        assert "A-Za-z0-9._-" in message


def test_negative_learning_rate() -> None:
    message = _error(_with(job={"learning_rate": -0.1}))
    assert "job.learning_rate = -0.1" in message
    assert "greater than or equal to 0" in message


def test_every_error_is_reported_at_once() -> None:
    message = _error(
        {
            "node_id": "n",
            "listen": "localhost",
            "gossip": {"codec": "zstd", "sumweight": {"push_probability": 1.5}},
        }
    )
    assert message.startswith("invalid config site.toml:")
    for key in ("mesh_id", "listen", "gossip.codec", "gossip.sumweight.push_probability", "tls"):
        assert f"  {key}" in message
    assert len(message.splitlines()) == 6


# ---------------------------------------------------------------------------
# files


def test_invalid_toml_names_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, 'mesh_id = "m"\nnode_id = \n', name="broken.toml")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "not valid TOML" in message
    assert str(path) in message


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nowhere" / "site.toml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert str(path) in message
    assert "cannot read config" in message


def test_validation_error_from_file_names_the_file(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
        mesh_id = "m"
        node_id = "n"

        [gossip]
        push_probabilty = 0.1
        """,
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert f"invalid config {path}:" in message
    assert "gossip.push_probabilty" in message
    assert "[gossip.sumweight] push_probability = ..." in message


# ---------------------------------------------------------------------------
# CLI


def test_cli_node_with_bad_config_exits_2(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
        mesh_id = "m"
        node_id = "n"

        [gosip]
        push_probability = 0.1
        """,
        name="bad.toml",
    )
    proc = subprocess.run(
        [sys.executable, "-m", "gossipd.node.cli", "node", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 2, proc.stderr
    assert "gossipd: error:" in proc.stderr
    assert "gosip" in proc.stderr
    assert "did you mean 'gossip'?" in proc.stderr
    assert str(path) in proc.stderr
    assert not (tmp_path / "gossipd-state").exists()


def test_unknown_protocol_names_the_key_and_every_registered_protocol() -> None:
    message = _error(_with(gossip={"protocol": "gossipsub"}))
    assert "gossip.protocol" in message and "'gossipsub'" in message
    for name in ("sumweight", "crossover", "pushsum-expgraph", "shuffle-exchange", "persyn"):
        assert name in message


@pytest.mark.parametrize(
    "protocol", ["sumweight", "crossover", "pushsum-expgraph", "shuffle-exchange", "persyn"]
)
def test_every_protocol_is_a_valid_config(protocol: str) -> None:
    config = parse_config(_with(gossip={"protocol": protocol, protocol: {}}))
    assert config.gossip.protocol == protocol
    assert config.gossip.options == settings_class(protocol)()  # its defaults


def test_a_config_without_tls_is_refused_with_both_ways_out() -> None:
    message = _error({"mesh_id": "m", "node_id": "n"})
    assert "tls.ca, tls.cert, tls.key not set" in message
    assert "gossipd certs" in message and "tls.insecure = true" in message


def test_tls_insecure_with_files_is_refused() -> None:
    message = _error(_with(tls={"insecure": True, "ca": "ca.pem"}))
    assert "tls.insecure = true with tls.ca set" in message
