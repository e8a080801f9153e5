"""The broker is never in training's way: a daemon whose broker is down at start trains,
reaches it once it comes up (with username and password), and a SIGKILLed daemon's
presence is cleared by its last will. Real Mosquitto, a real daemon."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gossipd.node.launch.localmesh import free_ports
from tests.conftest import (
    check_alive,
    kill_hard,
    restart_daemon,
    scrape_metrics,
    start_daemon,
    status_of,
    wait_counters_grow,
    wait_until,
)
from tests.mqttbrokers import mosquitto, wait_message

MESH = "test-mesh"
LOGIN = {"username": "site-x", "password": "s3cret-x"}


def test_a_daemon_trains_with_its_broker_down_and_announces_itself_once_it_is_up(
    tmp_path: Path,
) -> None:
    broker_port, node_port = free_ports(2)
    (tmp_path / "mqtt-password").write_text(LOGIN["password"] + "\n")
    mqtt = {
        "broker": f"127.0.0.1:{broker_port}",
        "username": LOGIN["username"],
        "password_file": str(tmp_path / "mqtt-password"),
        "keepalive_s": 2,
        "reconnect_max_s": 1.0,
    }
    x = start_daemon(tmp_path, "x", node_port, mqtt=mqtt)
    try:
        wait_counters_grow([x], ("step",), 50, "steps with no broker")
        metrics_port = x.node_json()["metrics_port"]
        assert scrape_metrics(metrics_port)["gossipd_mqtt_connected"] == 0.0
        assert "training and gossip go on without it" in x.log()

        users = {LOGIN["username"]: LOGIN["password"]}
        with mosquitto(tmp_path / "broker", broker_port, users=users) as port:
            presence = wait_message(
                port, f"gossipd/{MESH}/presence/x", bool, "x's presence", **LOGIN
            )
            assert json.loads(presence)["address"] == x.address
            wait_until(
                lambda: scrape_metrics(metrics_port)["gossipd_mqtt_connected"] == 1.0,
                "x to report the broker connected",
                30.0,
                lambda: check_alive([x]),
            )
            # kill -9: no goodbye; the broker sees the connection drop and fires the will.
            wait_message(
                port,
                f"gossipd/{MESH}/presence/x",
                lambda p: p == b"",
                "x's last will to clear its presence",
                action=lambda: kill_hard(x),
                **LOGIN,
            )
            x = restart_daemon(x)
            topic = f"gossipd/{MESH}/presence/x"
            again = wait_message(port, topic, bool, "x's presence again", **LOGIN)
            assert json.loads(again)["node_id"] == "x"
        wait_counters_grow([x], ("step",), 10, "steps after the broker went away again")
        weights = status_of(x)["sum_weights"]
        assert weights == pytest.approx([1.0] * len(weights))
    finally:
        code = x.stop()
    assert code == 0, x.log()[-3000:]
    final = json.loads((x.data_dir / "summary.json").read_text())["sum_weights"]
    assert final == pytest.approx([1.0] * len(final))  # alone: Σw is its own weight, whole
