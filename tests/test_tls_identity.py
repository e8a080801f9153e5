"""Mutual TLS on real daemons: a certificate speaks only for the node id it names.

A valid certificate of the mesh CA for ``x`` cannot claim to be ``b`` in any request
(PERMISSION_DENIED, counted as ``IdentityMismatch``), and ``b`` keeps its standing; a
peer list relayed by ``x`` that names a "ghost" at another site's address never makes
the ghost live or relayed. The module mesh and its CA are ``tests/tls_mesh.py``'s, as in
``tests/test_tls.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from gossipd.node.launch.localmesh import free_ports
from gossipd.node.shared.tls import Credentials
from gossipd.proto import gossip_pb2 as pb
from tests.conftest import (
    DaemonHandle,
    check_alive,
    start_daemon,
    status_of,
    stop_all,
    wait_counters_grow,
    wait_until,
)
from tests.outsider import dead_address, node_info, synthetic_plan
from tests.outsider_tls import handshake_tls, leave_tls, peers_tls, push_tls
from tests.tls_mesh import (
    ATTACKER,
    CLIENT,
    CONFIG,
    OTHER_SITE,
    Pki,
    healthy,
    module_mesh,
    module_pki,
)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return module_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[list[DaemonHandle]]:
    with module_mesh(tmp_path_factory.mktemp("mesh"), pki) as handles:
        yield handles


@pytest.fixture
def healthy_mesh(mesh: list[DaemonHandle]) -> list[DaemonHandle]:
    """The module mesh, checked whole before each test."""
    return healthy(mesh)


def _incarnation(at: DaemonHandle, node_id: str) -> int:
    return next(p["incarnation"] for p in status_of(at)["peers"] if p["node_id"] == node_id)


# -- a certificate speaks only for its own node id ------------------------------------------


@pytest.mark.timeout(300)
def test_a_certificate_for_x_cannot_speak_for_b_and_b_keeps_its_standing(
    healthy_mesh: list[DaemonHandle], pki: Pki
) -> None:
    a, b, _ = healthy_mesh
    x = pki.creds(ATTACKER)
    b_incarnation = _incarnation(a, "b")
    before = status_of(a)["rejected"].get("IdentityMismatch", 0)

    def refused(what: str, code: grpc.StatusCode, details: str) -> None:
        assert code == grpc.StatusCode.PERMISSION_DENIED, (what, code, details)
        assert "'b'" in details and f"'{ATTACKER}'" in details, (what, details)

    code, _, details = handshake_tls(x, a.address, node_info("b", b.address, b_incarnation))
    refused("Handshake as b", code, details)
    numel = synthetic_plan().segments[0].numel
    outcome = push_tls(
        x,
        a.address,
        sender="b",
        incarnation=b_incarnation,
        sequence=2**62,
        weight=0.5,
        values=torch.full((numel,), 1e6, dtype=torch.float32),
    )
    refused("push as b", outcome.code, outcome.details)
    code, details = leave_tls(x, a.address, "b", b_incarnation)
    refused("Leave for b", code, details)
    code, _, details = peers_tls(x, a.address, node_info("b", b.address, b_incarnation), [])
    refused("peer list as b", code, details)

    # Counted before each answer was sent, so already there.
    assert status_of(a)["rejected"].get("IdentityMismatch", 0) >= before + 4

    def b_standing() -> None:
        seen = status_of(a)
        assert "b" in seen["live_peers"], seen
        assert _incarnation(a, "b") == b_incarnation
        assert ATTACKER not in [p["node_id"] for p in seen["peers"]]

    # b stays live at a, its incarnation unchanged, and its pushes keep being
    # acknowledged (merged) while a keeps merging pushes.
    wait_counters_grow(
        [a, b],
        ("pushes_acked", "pushes_merged"),
        5,
        "b's pushes acknowledged and a merging after the attack",
        timeout_s=120.0,
        every=b_standing,
    )
    b_standing()


# -- a relayed peer list cannot name a node after another site's address ------------------


def _start_other_site(tmp_path: Path, pki: Pki) -> DaemonHandle:
    """z: a valid site of the mesh, not one of the module mesh's seeds."""
    return start_daemon(
        tmp_path,
        OTHER_SITE,
        free_ports(1)[0],
        client_tls=pki.creds(CLIENT),
        tls=pki.tls_config(OTHER_SITE),
        **{**CONFIG, "job": {"seed": 9}},
    )


def _no_ghost(everyone: list[DaemonHandle]) -> None:
    for h in everyone:
        seen = status_of(h)
        assert "ghost" not in seen["live_peers"], (h.node_id, seen)
        assert "ghost" not in [p["node_id"] for p in seen["peers"]], (h.node_id, seen)


def _relay_the_ghost_until_z_is_verified(
    a: DaemonHandle,
    x: Credentials,
    z: DaemonHandle,
    z_info: pb.NodeInfo,
    everyone: list[DaemonHandle],
) -> None:
    """x (a valid site, speaking as itself) relays "ghost" at z's address to a, then the
    truth about z, until a has verified z; no node takes the ghost meanwhile.

    Synchronisation: a keeps one candidate per address and never dials an address twice
    at once, so x's true claim about z (resent each poll) can only be taken once
    "ghost"'s claim left the table and its dial ended. z live at a therefore means a has
    dialled "ghost" at z's address and refused it (z's certificate names z, so the TLS
    check against "ghost" fails)."""
    x_info = node_info(ATTACKER, dead_address(3), 1)
    code, _, details = peers_tls(x, a.address, x_info, [node_info("ghost", z.address, 1)])
    assert code == grpc.StatusCode.OK, details

    def z_live_at_a() -> bool:
        _no_ghost(everyone)
        if OTHER_SITE in status_of(a)["live_peers"]:
            return True
        peers_tls(x, a.address, x_info, [z_info])
        return False

    wait_until(
        z_live_at_a, "a to verify z after dialling the ghost", 60.0, lambda: check_alive(everyone)
    )


def _nobody_relays_the_ghost(
    everyone: list[DaemonHandle], client: Credentials, z: DaemonHandle
) -> None:
    """Every node's peer list names z (and only z) at z's address, and no ghost."""
    for h in everyone:
        code, relayed, details = peers_tls(
            client, h.address, node_info(CLIENT, dead_address(4), 1), []
        )
        assert code == grpc.StatusCode.OK, (h.node_id, details)
        assert "ghost" not in [p.node_id for p in relayed], (h.node_id, relayed)
        z_entries = [p for p in relayed if p.address == z.address]
        assert all(p.node_id == OTHER_SITE for p in z_entries), (h.node_id, z_entries)


@pytest.mark.timeout(300)
def test_a_relayed_ghost_at_another_sites_address_never_becomes_live_or_relayed(
    healthy_mesh: list[DaemonHandle], pki: Pki, tmp_path: Path
) -> None:
    a, _, _ = healthy_mesh
    client = pki.creds(CLIENT)
    z = _start_other_site(tmp_path, pki)
    everyone = [*healthy_mesh, z]
    try:
        code, reply, details = handshake_tls(
            client, z.address, node_info(CLIENT, dead_address(2), 1)
        )
        assert code == grpc.StatusCode.OK and reply is not None, details
        assert reply.node.node_id == OTHER_SITE

        _relay_the_ghost_until_z_is_verified(a, pki.creds(ATTACKER), z, reply.node, everyone)

        # A few anti-entropy rounds later (z relayed to b and c in between), still no ghost.
        wait_until(
            lambda: all(OTHER_SITE in status_of(h)["live_peers"] for h in healthy_mesh),
            "z relayed to and verified by every node",
            60.0,
            lambda: (check_alive(everyone), _no_ghost(everyone)),
        )
        _no_ghost(everyone)
        _nobody_relays_the_ghost(everyone, client, z)
    finally:
        stop_all([z])
    wait_until(
        lambda: all(OTHER_SITE not in status_of(h)["live_peers"] for h in healthy_mesh),
        "the mesh to let z go",
        60.0,
        lambda: check_alive(healthy_mesh),
    )
