"""A relay that leaves (SIGTERM) tells the sites it relays and the sites that dial through
it, keeps joining connections while they finish their calls, and stops waiting for them
after half its ``shutdown_timeout_s``.

The relay is a real daemon; the attached site and the dialler are members with valid
certificates making the calls by hand (tests/relaying.py). What a real site does with
the notice (its pushes through a leaving relay settle, none is left half-answered) is
tried on real daemons in tests/test_relay_mesh.py.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from gossipd.proto import gossip_pb2 as pb
from tests.daemons import DaemonHandle
from tests.meshes import stop_all
from tests.relaying import Hand, start_relay
from tests.tls_mesh import Pki

EXIT_S = 60.0  # a relay's SIGTERM to its exit, on 2 busy cores


@pytest.fixture
def daemons() -> Iterator[list[DaemonHandle]]:
    handles: list[DaemonHandle] = []
    try:
        yield handles
    finally:
        stop_all(handles)


@pytest.fixture
def hands() -> Iterator[list[Hand]]:
    made: list[Hand] = []
    try:
        yield made
    finally:
        for hand in made:
            hand.close()


def next_order(site: Hand, attach: Any, what: str) -> Any:
    """The attachment's next order that is not a ping, ``what`` it must say on a timeout."""
    for _ in range(20):  # pings come every reach.keepalive_s (2 s); 20 is 40 s
        order = site.read(attach)
        assert order is not grpc.aio.EOF, f"the attachment ended before {what}"
        if not order.ping:
            return order
    raise AssertionError(f"no order but pings before {what}")


def joined(site: Hand, attach: Any, member: Hand) -> tuple[Any, Any]:
    """A connection from ``member`` to the attached site c, taken and joined: (dial, take)."""
    dial = member.open_stream("Dial", pb.RelayFrame(target="c"))
    order = next_order(site, attach, "the order to take m's connection")
    assert order.origin == "m" and order.token, order
    take = site.open_stream("Take", pb.RelayFrame(token=order.token))
    assert member.read(dial).target == "c", "joined"
    return dial, take


def attached(relay: DaemonHandle, pki: Pki, hands: list[Hand]) -> tuple[Hand, Any, Hand]:
    site = Hand(pki.creds("c"), relay.address)
    hands.append(site)
    member = Hand(pki.creds("m"), relay.address)
    hands.append(member)
    attach = site.open_stream(
        "Attach", pb.AttachFrame(mesh_id="test-mesh", address=f"relay://c@{relay.address}")
    )
    assert site.read(attach).ping, "attached"
    return site, attach, member


def test_a_leaving_relay_tells_both_ends_and_joins_until_their_connections_close(
    tmp_path: Path, daemons: list[DaemonHandle], hands: list[Hand]
) -> None:
    """After SIGTERM the attached site gets a leaving order and the dialler a leaving
    frame; bytes still cross, a new dial (a retry, say) is still joined and told at
    once, a new attachment is refused; once both connections are closed the relay
    exits and says that they finished first. Its shutdown_timeout_s of 120 s gives the
    connections a 60 s drain, far longer than the test takes, so nothing here is cut."""
    relay, pki = start_relay(tmp_path, reach={}, shutdown_timeout_s=120.0)
    daemons.append(relay)
    site, attach, member = attached(relay, pki, hands)
    dial, take = joined(site, attach, member)

    relay.proc.send_signal(signal.SIGTERM)
    assert next_order(site, attach, "the leaving order").leaving
    assert member.read(dial).leaving
    member.write(dial, pb.RelayFrame(data=b"an answer still crossing"))
    assert site.read(take).data == b"an answer still crossing"

    again, again_take = joined(site, attach, member)
    assert member.read(again).leaving, "a connection joined while leaving is told at once"
    other = Hand(pki.creds("m"), relay.address)
    hands.append(other)
    refused = other.open_stream(
        "Attach", pb.AttachFrame(mesh_id="test-mesh", address=f"relay://m@{relay.address}")
    )
    assert other.code(refused) == grpc.StatusCode.FAILED_PRECONDITION
    assert relay.proc.poll() is None, "the relay waits for the connections it still joins"

    for call in (dial, again):
        member.run(call.done_writing())
    for call in (take, again_take):
        site.run(call.done_writing())
    assert relay.proc.wait(EXIT_S) == 0
    assert re.search(
        r"relay: 1 connection\(s\) joined here for other sites when leaving; "
        r"all finished their calls first",
        relay.log(),
    ), relay.log()[-3000:]


def test_a_connection_left_open_is_cut_after_half_the_shutdown_timeout(
    tmp_path: Path, daemons: list[DaemonHandle], hands: list[Hand]
) -> None:
    """A dialler that ignores the notice (or one hung) does not hold the relay: after
    half its shutdown_timeout_s it stops, cuts the connection and says so."""
    relay, pki = start_relay(tmp_path, reach={}, shutdown_timeout_s=4.0)
    daemons.append(relay)
    site, attach, member = attached(relay, pki, hands)
    dial, _ = joined(site, attach, member)

    relay.proc.send_signal(signal.SIGTERM)
    assert member.read(dial).leaving
    assert relay.proc.wait(EXIT_S) == 0
    assert "1 still open after 2 s are cut (m -> c)" in relay.log(), relay.log()[-3000:]
    assert member.code(dial) != grpc.StatusCode.OK


def test_a_dialler_told_a_relay_is_leaving_retires_the_channel_and_tries_that_relay_last() -> None:
    """Told on a connection through r1 that r1 is leaving: the address's channel is retired
    (``on_leaving``), r1 is tried after the site's other relays, and only a site whose every
    relay is leaving is cut off (no new push goes to it)."""
    from gossipd.node.net.relay.routes import Routes
    from gossipd.node.shared.relay_address import parse
    from gossipd.node.shared.tls import Credentials

    two, one = "relay://c@10.0.0.1:1,10.0.0.2:1", "relay://d@10.0.0.1:1"
    relayed = parse(two)
    assert relayed is not None
    routes = Routes(Credentials(insecure=True))
    retired: list[str] = []
    routes.on_leaving = retired.append
    leaving = "10.0.0.1:1"
    routes._relay_leaving(two, relayed, leaving)
    assert retired == [two]
    assert routes.order(relayed) == ["10.0.0.2:1", leaving]
    assert not routes.cut_off(two) and routes.cut_off(one) and not routes.cut_off("10.0.0.9:1")
