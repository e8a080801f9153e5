"""A relay refuses what it must not do, says why, and counts it: a dial to a site not
attached there, a loop, a flood, a forged or replayed take, a site that attaches with a
direct address; and the reach check dials only the asker's own advertised address.

The relay is a real daemon; the other end is a member with a valid certificate making
the calls by hand (tests/relaying.py), so each refusal is met exactly as an insider
would meet it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from gossipd.proto import gossip_pb2 as pb
from tests.daemons import DaemonHandle
from tests.meshes import status_of, stop_all
from tests.relaying import Hand, start_relay
from tests.tls_mesh import Pki

PER_ORIGIN = 2


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[tuple[DaemonHandle, Pki]]:
    handle, pki = start_relay(tmp_path, reach={"max_sessions_per_origin": PER_ORIGIN})
    try:
        yield handle, pki
    finally:
        stop_all([handle])


def rejected(handle: DaemonHandle) -> dict[str, Any]:
    return status_of(handle)["rejected"]


def test_a_dial_to_a_site_not_attached_or_in_a_loop_is_refused_and_counted(
    relay: tuple[DaemonHandle, Pki],
) -> None:
    handle, pki = relay
    member = Hand(pki.creds("m"), handle.address)
    try:
        absent = member.open_stream("Dial", pb.RelayFrame(target="nobody"))
        assert member.code(absent) == grpc.StatusCode.UNAVAILABLE
        for target in ("r", "m"):  # the relay itself, the dialler itself
            loop = member.open_stream("Dial", pb.RelayFrame(target=target))
            assert member.code(loop) == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        member.close()
    counts = rejected(handle)
    assert counts.get("RelayAbsent") == 1 and counts.get("RelayLoop") == 2, counts


def test_a_site_that_attaches_with_a_direct_address_is_refused(
    relay: tuple[DaemonHandle, Pki],
) -> None:
    handle, pki = relay
    site = Hand(pki.creds("c"), handle.address)
    try:
        direct = site.open_stream(
            "Attach", pb.AttachFrame(mesh_id="test-mesh", address="1.2.3.4:5")
        )
        assert site.code(direct) == grpc.StatusCode.FAILED_PRECONDITION
        # Another site's name in the relayed address is not this site's either.
        other = site.open_stream(
            "Attach", pb.AttachFrame(mesh_id="test-mesh", address="relay://m@1.2.3.4:5")
        )
        assert site.code(other) == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        site.close()
    assert rejected(handle).get("NotRelaying") == 2


def test_a_connection_is_joined_only_for_the_site_its_token_was_given_to(
    relay: tuple[DaemonHandle, Pki],
) -> None:
    """The dialler's bytes reach the attached site and back; a token taken by another
    member, or taken twice (a replay), or made up, is refused as forged."""
    handle, pki = relay
    site = Hand(pki.creds("c"), handle.address)
    member = Hand(pki.creds("m"), handle.address)
    try:
        attach = site.open_stream(
            "Attach", pb.AttachFrame(mesh_id="test-mesh", address=f"relay://c@{handle.address}")
        )
        assert site.read(attach).ping  # attached
        dial = member.open_stream("Dial", pb.RelayFrame(target="c"))
        order = site.read(attach)
        while order.ping:
            order = site.read(attach)
        assert order.origin == "m" and len(order.token) == 16
        stolen = member.open_stream("Take", pb.RelayFrame(token=order.token))
        assert member.code(stolen) == grpc.StatusCode.PERMISSION_DENIED
        take = site.open_stream("Take", pb.RelayFrame(token=order.token))
        assert member.read(dial).target == "c"  # joined
        member.write(dial, pb.RelayFrame(data=b"hello from m"))
        assert site.read(take).data == b"hello from m"
        site.write(take, pb.RelayFrame(data=b"hello from c"))
        assert member.read(dial).data == b"hello from c"
        replay = site.open_stream("Take", pb.RelayFrame(token=order.token))
        assert site.code(replay) == grpc.StatusCode.PERMISSION_DENIED
        made_up = site.open_stream("Take", pb.RelayFrame(token=os.urandom(16)))
        assert site.code(made_up) == grpc.StatusCode.PERMISSION_DENIED
        assert status_of(handle)["relay_bytes"] == len(b"hello from m") + len(b"hello from c")
    finally:
        member.close()
        site.close()
    assert rejected(handle).get("RelayForged") == 3


def test_a_flood_through_the_relay_is_refused_past_the_per_dialler_cap(
    relay: tuple[DaemonHandle, Pki],
) -> None:
    """Connections a site has not taken still count: a member cannot hold more than its
    share open, and the site's own attachment is untouched by the refusal."""
    handle, pki = relay
    site = Hand(pki.creds("c"), handle.address)
    member = Hand(pki.creds("m"), handle.address)
    try:
        attach = site.open_stream(
            "Attach", pb.AttachFrame(mesh_id="test-mesh", address=f"relay://c@{handle.address}")
        )
        assert site.read(attach).ping
        held = [member.open_stream("Dial", pb.RelayFrame(target="c")) for _ in range(PER_ORIGIN)]
        for _ in held:  # each is ordered to the site before the next dial is refused
            order = site.read(attach)
            while order.ping:
                order = site.read(attach)
        flood = member.open_stream("Dial", pb.RelayFrame(target="c"))
        assert member.code(flood) == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Never taken: each held dial ends once the relay gives up waiting for the site.
        for call in held:
            assert member.code(call, timeout_s=15.0) == grpc.StatusCode.UNAVAILABLE
        assert site.read(attach).ping  # still attached
    finally:
        member.close()
        site.close()
    counts = rejected(handle)
    assert counts.get("RelayBusy") == 1 and counts.get("RelayAbsent") == PER_ORIGIN, counts


def test_the_reach_check_dials_back_only_the_asker_s_own_address(
    relay: tuple[DaemonHandle, Pki],
) -> None:
    """A member cannot ask for another site's dial-back, a relayed address is not dialled,
    an address where the asker does not answer is reported unreachable, and asking again
    at once is refused."""
    handle, pki = relay
    member = Hand(pki.creds("m"), handle.address)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            member.check_reach(pb.NodeInfo(node_id="c", address=handle.address))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        relayed = member.check_reach(pb.NodeInfo(node_id="m", address="relay://m@1.2.3.4:5"))
        assert not relayed.reachable
        # The relay's own address answers, but as r, not m: the dial-back fails there.
        posing = member.check_reach(pb.NodeInfo(node_id="m", address=handle.address))
        assert not posing.reachable and handle.address in posing.detail
        with pytest.raises(grpc.aio.AioRpcError) as err:
            member.check_reach(pb.NodeInfo(node_id="m", address=handle.address))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        member.close()
