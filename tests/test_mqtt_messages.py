"""The checks on what a node hears over MQTT, and the [mqtt] config's errors: no broker needed."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gossipd.node.errors import ConfigError
from gossipd.node.net.peers.mqtt_messages import Junk, Topics, parse_command, parse_presence
from gossipd.node.shared.config import parse_config

TOPICS = Topics("gossipd", "m1", "a")
GOOD = {
    "node_id": "b",
    "address": "10.0.0.2:50051",
    "incarnation": 7,
    "fingerprint": "ab" * 32,
    "mesh_id": "m1",
    "version": "0.1.0",
}


def test_a_well_formed_presence_is_read_and_an_empty_one_is_a_clear() -> None:
    presence = parse_presence(TOPICS, "b", json.dumps(GOOD).encode())
    assert presence is not None
    assert presence.address == "10.0.0.2:50051" and presence.incarnation == 7
    assert parse_presence(TOPICS, "b", b"") is None
    assert TOPICS.presence_of("gossipd/m1/presence/b") == "b"
    assert TOPICS.presence_of("gossipd/m2/presence/b") is None


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"node_id": "c"}, "topic_mismatch"),
        ({"mesh_id": "m2"}, "wrong_mesh"),
        ({"incarnation": -1}, "bad_field"),
        ({"incarnation": "7"}, "bad_field"),
        ({"address": "no-port"}, "bad_field"),
        ({"fingerprint": "zz"}, "bad_field"),
        ({"version": 3}, "bad_field"),
        ({"address": "x" * 5000}, "oversize"),
    ],
)
def test_a_bad_presence_is_junk_with_its_reason(change: dict[str, Any], reason: str) -> None:
    with pytest.raises(Junk) as caught:
        parse_presence(TOPICS, "b", json.dumps({**GOOD, **change}).encode())
    assert caught.value.reason == reason


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"{", "bad_json"),
        (b"[]", "bad_json"),
        (b"\xff\xfe", "bad_json"),
        (json.dumps({"command": "pause"}).encode(), "bad_field"),
        (json.dumps({"command": ["pause"], "request_id": "r"}).encode(), "bad_field"),
        (json.dumps({"command": "pause", "request_id": "r" * 200}).encode(), "bad_field"),
        # It goes back in a signed reply's one-line field (test_signed_replies.py).
        (json.dumps({"command": "pause", "request_id": "r1\nn\nok\nd"}).encode(), "bad_field"),
        (json.dumps({"command": "pause", "request_id": "r 1"}).encode(), "bad_field"),
        (json.dumps({"command": "format-disk", "request_id": "r"}).encode(), "unknown_command"),
    ],
)
def test_a_bad_command_is_junk_with_its_reason(payload: bytes, reason: str) -> None:
    with pytest.raises(Junk) as caught:
        parse_command(payload)
    assert caught.value.reason == reason
    if reason == "bad_field":
        assert caught.value.request_id is None  # not answered: no reply to carry it


def test_an_unknown_command_can_still_be_answered() -> None:
    with pytest.raises(Junk) as caught:
        parse_command(json.dumps({"command": "reboot", "request_id": "r9"}).encode())
    assert caught.value.request_id == "r9"
    assert parse_command(b'{"command": "leave", "request_id": ""}').command == "leave"


@pytest.mark.parametrize(
    ("mqtt", "says"),
    [
        ({}, "mqtt.broker: required"),
        ({"broker": "nowhere"}, "is not HOST:PORT"),
        ({"broker": "h:1883", "password": "p"}, "without mqtt.username"),
        ({"broker": "h:1883", "username": "u", "password": "p", "password_file": "f"}, "keep one"),
        ({"broker": "h:1883", "cert": "c.pem"}, "go together"),
        ({"broker": "h:1883", "topic_prefix": "a/+/b"}, "no wildcards"),
        ({"broker": "h:1883", "brokr": "x"}, "did you mean 'broker'"),
    ],
)
def test_mqtt_config_mistakes_are_named(mqtt: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError, match=says.replace("+", r"\+")):
        parse_config({"mesh_id": "m1", "node_id": "a", "tls": {"insecure": True}, "mqtt": mqtt})
