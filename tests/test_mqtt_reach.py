"""An outbound-only site's MQTT presence follows its relays: real daemons with mutual TLS,
a real Mosquitto broker.

A site found through MQTT is dialled at the address its retained presence names; for a
site behind NAT that is ``relay://SITE@RELAYS``, which changes whenever a relay is lost
and another attached. A presence left naming the lost relay would send every site that
joins later to a relay that no longer carries it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gossipd.node.launch.localmesh import free_ports
from tests.conftest import DaemonHandle, kill_hard, stop_all
from tests.mqttbrokers import mosquitto, wait_message
from tests.relay_meshes import LIVE_TIMEOUT_S, relays_of, start_sites, wait_reach

PRESENCE = "gossipd/test-mesh/presence/c"


@pytest.fixture
def sites() -> Iterator[list[DaemonHandle]]:
    handles: list[DaemonHandle] = []
    try:
        yield handles
    finally:
        stop_all(handles)


def names(address: str) -> Callable[[bytes], bool]:
    """Whether a presence payload names ``address`` (a retained one that is cleared: no)."""
    return lambda payload: bool(payload) and json.loads(payload)["address"] == address


def test_the_presence_names_the_relay_that_replaced_a_lost_one(
    tmp_path: Path, sites: list[DaemonHandle]
) -> None:
    """c keeps one relay; it is killed, c attaches to the other direct site, and c's
    retained presence on the broker names the new relay (a new subscriber reads it)."""
    (port,) = free_ports(1)
    with mosquitto(tmp_path / "mosquitto", port):
        mqtt = {"broker": f"127.0.0.1:{port}", "keepalive_s": 5}
        by_id = start_sites(
            tmp_path,
            sites,
            ["a", "b"],
            ["c"],
            relayed_reach={"relays": 1},
            relayed_config={"mqtt": mqtt},
        )
        c = by_id["c"]
        wait_reach([c], "c to attach to a relay")
        (first,) = relays_of(c)
        wait_message(
            port,
            PRESENCE,
            names(f"relay://c@{first}"),
            "c's presence naming its relay",
            timeout_s=LIVE_TIMEOUT_S,
        )
        lost = next(h for h in sites if h.address == first)
        other = next(h for h in sites if h.node_id in "ab" and h is not lost)
        kill_hard(lost)
        wait_message(
            port,
            PRESENCE,
            names(f"relay://c@{other.address}"),
            f"c's presence to name {other.node_id}, its relay after {lost.node_id} was killed",
            timeout_s=LIVE_TIMEOUT_S,
        )
