"""Mutual TLS on real daemons: real certificates, real sockets, real gRPC.

One mesh CA per module (in a temporary directory), a certificate per site, and
``operator``: the certificate this test presents to Status (any certificate of
the mesh may ask). Tests 1-4 share one module mesh of three daemons gossiping at
push probability 1; ``c`` runs with ``tls.allow`` set. The two rotation tests run
their own meshes (their certificate files change; one ends by stopping every node
to add up the final weights).

What the tests rely on (node/shared/tls.py, node/net/servicer.py): a site's identity is the
node id its certificate names; every claim of identity in a request must equal
it (PERMISSION_DENIED, counted as ``IdentityMismatch``); a certificate that TLS
refuses never reaches a handler.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from gossipd.node.launch.localmesh import free_ports
from gossipd.node.shared import certs
from gossipd.node.shared.certs import MESH_DNS_NAME
from gossipd.node.shared.tls import Credentials
from tests.conftest import (
    DaemonHandle,
    check_alive,
    start_daemon,
    status_of,
    stop_all,
    stop_in_turn,
    wait_counters_grow,
    wait_mesh_live,
    wait_until,
)
from tests.fakepeer import (
    MESH,
    dead_address,
    handshake_tls,
    leave_tls,
    node_info,
    peers_tls,
    push_tls,
    status_tls,
    synthetic_plan,
)

IDS = ["a", "b", "c"]
CLIENT = "operator"  # the certificate the test presents (Status, CLI)
ATTACKER = "x"  # a valid site certificate of the mesh, used to claim other ids
OTHER_SITE = "z"  # a valid site that is not part of the module mesh at first
# c admits its peers, the site that joins in the ghost test, and the test's client;
# "x" and "intruder" hold valid certificates of the same CA but are not listed.
C_ALLOW = ["a", "b", OTHER_SITE, CLIENT]
CONFIG: dict[str, Any] = {
    "gossip": {"push_probability": 1.0, "progress_timeout_s": 2.0},
    "membership": {"anti_entropy_interval_s": 0.5},
}
CLI_TIMEOUT_S = 60.0
TOLERANCE = 1e-9


# -- certificates -------------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    """A mesh CA directory: ``ca.pem``, ``ca.key`` and ``<id>.pem``/``<id>.key`` per site."""

    dir: Path

    @classmethod
    def create(cls, directory: Path, ids: list[str]) -> Pki:
        certs.init_ca(directory, mesh_id=MESH)
        for node_id in ids:
            certs.issue(node_id, directory)
        return cls(directory)

    @property
    def ca(self) -> Path:
        return self.dir / certs.CA_CERT_FILE

    def pem(self, node_id: str) -> Path:
        return self.dir / f"{node_id}.pem"

    def key(self, node_id: str) -> Path:
        return self.dir / f"{node_id}.key"

    def creds(self, node_id: str) -> Credentials:
        return Credentials(ca=self.ca, cert=self.pem(node_id), key=self.key(node_id))

    def tls_config(self, node_id: str, allow: list[str] | None = None) -> dict[str, Any]:
        # conftest's default [tls] is {insecure = true}; it is merged key by key.
        tls: dict[str, Any] = {
            "insecure": False,
            "ca": str(self.ca),
            "cert": str(self.pem(node_id)),
            "key": str(self.key(node_id)),
        }
        if allow is not None:
            tls["allow"] = allow
        return tls


class FilesTls:
    """Presents certificate files as they are, with no check of our own first.

    ``Credentials`` refuses to load an expired certificate or one from another CA
    (``certs.check_pair``); an attacker would not. ``cert``/``key`` None: a TLS
    client with no certificate at all. It trusts ``ca`` for the server.
    """

    def __init__(self, ca: Path, cert: Path | None = None, key: Path | None = None) -> None:
        self.ca = ca.read_bytes()
        self.cert = cert.read_bytes() if cert else None
        self.key = key.read_bytes() if key else None

    def channel(
        self, address: str, options: list[tuple[str, Any]], expected: str | None = None
    ) -> grpc.aio.Channel:
        credentials = grpc.ssl_channel_credentials(self.ca, self.key, self.cert)
        name = expected or MESH_DNS_NAME
        return grpc.aio.secure_channel(
            address, credentials, options=[*options, ("grpc.ssl_target_name_override", name)]
        )


PLAINTEXT = Credentials(insecure=True)


def presented_cert(address: str, pki: Pki, client: str = CLIENT) -> bytes:
    """The DER certificate the server at ``address`` presents to a new TLS connection."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(pki.ca)
    context.load_cert_chain(pki.pem(client), pki.key(client))
    context.set_alpn_protocols(["h2"])
    host, port = address.rsplit(":", 1)
    with (
        socket.create_connection((host, int(port)), timeout=10.0) as sock,
        context.wrap_socket(sock, server_hostname=MESH_DNS_NAME) as conn,
    ):
        der = conn.getpeercert(binary_form=True)
    assert der is not None, f"{address} presented no certificate"
    return der


def der_of(path: Path) -> bytes:
    return x509.load_pem_x509_certificate(path.read_bytes()).public_bytes(
        serialization.Encoding.DER
    )


def replace_file(data: bytes, path: Path) -> None:
    """Write ``data`` next to ``path`` under a temporary name, then rename it over ``path``."""
    tmp = path.with_name(path.name + ".new")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


# -- daemons ------------------------------------------------------------------------------


def start_tls_mesh(
    tmp_path: Path,
    pki: Pki,
    ids: list[str],
    *,
    allow: dict[str, list[str]] | None = None,
    **config: Any,
) -> list[DaemonHandle]:
    """Like conftest's start_mesh, with each node's own certificate (and ``tls.allow``)."""
    allow = allow or {}
    ports = free_ports(len(ids))
    addresses = [f"127.0.0.1:{p}" for p in ports]
    client = pki.creds(CLIENT)

    def start(index: int) -> DaemonHandle:
        node_id = ids[index]
        cfg = dict(config)
        cfg["job"] = {"seed": index, **config.get("job", {})}
        cfg["gossip"] = {"seed": index, **config.get("gossip", {})}
        return start_daemon(
            tmp_path,
            node_id,
            ports[index],
            client_tls=client,
            seeds=[a for i, a in enumerate(addresses) if i != index],
            tls=pki.tls_config(node_id, allow.get(node_id)),
            **cfg,
        )

    handles: list[DaemonHandle] = []
    errors: list[Exception] = []
    with ThreadPoolExecutor(len(ids)) as pool:
        for future in [pool.submit(start, i) for i in range(len(ids))]:
            try:
                handles.append(future.result())
            except Exception as err:
                errors.append(err)
    if errors:
        stop_all(handles)
        raise errors[0]
    try:
        wait_mesh_live(handles, 120.0)
    except BaseException:
        stop_all(handles)
        raise
    return handles


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    root = tmp_path_factory.mktemp("pki")
    pki = Pki.create(root / "ca", [*IDS, CLIENT, ATTACKER, OTHER_SITE, "intruder"])
    now = dt.datetime.now(dt.UTC)
    certs.issue("stale", pki.dir, not_before=now - dt.timedelta(days=10), days=1)
    certs.issue("early", pki.dir, not_before=now + dt.timedelta(days=1), days=30)
    # Another CA for the same mesh id: its "operator" has the right name, the wrong issuer.
    Pki.create(root / "other-ca", [CLIENT])
    return pki


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[list[DaemonHandle]]:
    handles = start_tls_mesh(
        tmp_path_factory.mktemp("mesh"), pki, IDS, allow={"c": C_ALLOW}, **CONFIG
    )
    try:
        yield handles
    finally:
        stop_all(handles)


@pytest.fixture
def healthy_mesh(mesh: list[DaemonHandle]) -> list[DaemonHandle]:
    """The module mesh, checked whole before each test (a test must not inherit a broken one)."""
    check_alive(mesh)
    wait_mesh_live(mesh, 60.0)
    return mesh


def _cli_status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gossipd.node.cli", "status", *args],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        check=False,
    )


def _incarnation(at: DaemonHandle, node_id: str) -> int:
    return next(p["incarnation"] for p in status_of(at)["peers"] if p["node_id"] == node_id)


# -- 1. a TLS mesh works, and Status needs a certificate of the mesh ----------------------


@pytest.mark.timeout(300)
def test_tls_mesh_gossips_and_status_needs_a_certificate_of_the_mesh(
    healthy_mesh: list[DaemonHandle], pki: Pki
) -> None:
    a, b, _ = healthy_mesh
    for h in healthy_mesh:
        assert status_of(h)["transport_security"] == "mtls", h.node_id
    wait_counters_grow(
        healthy_mesh, ("pushes_acked",), 5, "pushes acknowledged on every node", timeout_s=120.0
    )

    code, reply, details = status_tls(pki.creds(CLIENT), a.address)
    assert code == grpc.StatusCode.OK, details
    assert reply is not None and reply.node_id == "a"
    # A plaintext client against the TLS port: the TLS handshake fails before any RPC,
    # which grpc reports as UNAVAILABLE.
    code, _, details = status_tls(PLAINTEXT, a.address)
    assert code == grpc.StatusCode.UNAVAILABLE, details

    # The CLI, with another site's config (its [tls] files) ...
    by_config = _cli_status("--address", a.address, "--config", str(b.config_path), "--json")
    assert by_config.returncode == 0, by_config.stderr
    shown = json.loads(by_config.stdout)
    assert shown["node_id"] == "a" and shown["transport_security"] == "mtls", shown
    # ... with the three files ...
    by_files = _cli_status(
        "--address",
        a.address,
        "--ca",
        str(pki.ca),
        "--cert",
        str(pki.pem(CLIENT)),
        "--key",
        str(pki.key(CLIENT)),
    )
    assert by_files.returncode == 0, by_files.stderr
    assert re.search(r"^node\s+a \(mesh ", by_files.stdout, re.M), by_files.stdout
    # ... and without a certificate: refused, with the hint that says what to pass.
    bare = _cli_status("--address", a.address)
    assert bare.returncode != 0, bare.stdout
    assert "--config" in bare.stderr and "UNAVAILABLE" in bare.stderr, bare.stderr


# -- 2. certificates that are refused -------------------------------------------------------


@pytest.mark.timeout(300)
def test_foreign_expired_unlisted_and_missing_client_certificates_are_refused(
    healthy_mesh: list[DaemonHandle], pki: Pki, tmp_path: Path
) -> None:
    a, _, c = healthy_mesh
    other = Pki(pki.dir.parent / "other-ca")

    # Control: the same path with the files Credentials would load is answered.
    code, _, details = status_tls(FilesTls(pki.ca, pki.pem(CLIENT), pki.key(CLIENT)), a.address)
    assert code == grpc.StatusCode.OK, details

    # Refused by TLS itself (the server ends the handshake; no handler runs), which grpc
    # surfaces to the client as UNAVAILABLE, not as UNAUTHENTICATED.
    refused_by_tls = {
        "another CA, same mesh id and name": FilesTls(pki.ca, other.pem(CLIENT), other.key(CLIENT)),
        "expired": FilesTls(pki.ca, pki.pem("stale"), pki.key("stale")),
        "not yet valid": FilesTls(pki.ca, pki.pem("early"), pki.key("early")),
        "TLS without a client certificate": FilesTls(pki.ca),
        "plaintext": PLAINTEXT,
    }
    for what, tls in refused_by_tls.items():
        for target in (a, c):
            code, _, details = status_tls(tls, target.address)
            assert code == grpc.StatusCode.UNAVAILABLE, (what, target.node_id, code, details)

    # A valid certificate of the mesh CA that c's tls.allow does not list: TLS passes,
    # the servicer refuses every RPC with PERMISSION_DENIED and counts NotAllowed.
    intruder = pki.creds("intruder")
    before = status_of(c)["rejected"].get("NotAllowed", 0)
    code, _, details = status_tls(intruder, c.address)
    assert code == grpc.StatusCode.PERMISSION_DENIED, details
    assert "'intruder'" in details and "tls.allow" in details, details
    code, _, details = handshake_tls(intruder, c.address, node_info("intruder", dead_address(1), 1))
    assert code == grpc.StatusCode.PERMISSION_DENIED, details
    assert status_of(c)["rejected"].get("NotAllowed", 0) >= before + 2
    assert "intruder" not in [p["node_id"] for p in status_of(c)["peers"]]
    # The same certificate at a, which has no allow-list: it is the list that refused it.
    code, _, details = status_tls(intruder, a.address)
    assert code == grpc.StatusCode.OK, details


# -- 3. a certificate speaks only for its own node id ---------------------------------------


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


# -- 4. a relayed peer list cannot name a node after another site's address ---------------


@pytest.mark.timeout(300)
def test_a_relayed_ghost_at_another_sites_address_never_becomes_live_or_relayed(
    healthy_mesh: list[DaemonHandle], pki: Pki, tmp_path: Path
) -> None:
    a, _, _ = healthy_mesh
    x, client = pki.creds(ATTACKER), pki.creds(CLIENT)
    z = start_daemon(
        tmp_path,
        OTHER_SITE,
        free_ports(1)[0],
        client_tls=client,
        tls=pki.tls_config(OTHER_SITE),
        **{**CONFIG, "job": {"seed": 9}},
    )
    everyone = [*healthy_mesh, z]
    try:
        code, reply, details = handshake_tls(
            client, z.address, node_info(CLIENT, dead_address(2), 1)
        )
        assert code == grpc.StatusCode.OK and reply is not None, details
        z_info = reply.node
        assert z_info.node_id == OTHER_SITE
        x_info = node_info(ATTACKER, dead_address(3), 1)

        def no_ghost() -> None:
            for h in everyone:
                seen = status_of(h)
                assert "ghost" not in seen["live_peers"], (h.node_id, seen)
                assert "ghost" not in [p["node_id"] for p in seen["peers"]], (h.node_id, seen)

        # x (a valid site, speaking as itself) relays "ghost" at z's address.
        code, _, details = peers_tls(x, a.address, x_info, [node_info("ghost", z.address, 1)])
        assert code == grpc.StatusCode.OK, details

        # Synchronisation: a keeps one candidate per address and never dials an address
        # twice at once, so x's true claim about z (resent each poll) can only be taken
        # once "ghost"'s claim left the table and its dial ended. z live at a therefore
        # means a has dialled "ghost" at z's address and refused it (z's certificate
        # names z, so the TLS check against "ghost" fails).
        def z_live_at_a() -> bool:
            no_ghost()
            if OTHER_SITE in status_of(a)["live_peers"]:
                return True
            peers_tls(x, a.address, x_info, [z_info])
            return False

        wait_until(
            z_live_at_a,
            "a to verify z after dialling the ghost",
            60.0,
            lambda: check_alive(everyone),
        )
        # A few anti-entropy rounds later (z relayed to b and c in between), still no ghost.
        wait_until(
            lambda: all(OTHER_SITE in status_of(h)["live_peers"] for h in healthy_mesh),
            "z relayed to and verified by every node",
            60.0,
            lambda: (check_alive(everyone), no_ghost()),
        )
        no_ghost()
        for h in everyone:
            code, relayed, details = peers_tls(
                client, h.address, node_info(CLIENT, dead_address(4), 1), []
            )
            assert code == grpc.StatusCode.OK, (h.node_id, details)
            assert "ghost" not in [p.node_id for p in relayed], (h.node_id, relayed)
            z_entries = [p for p in relayed if p.address == z.address]
            assert all(p.node_id == OTHER_SITE for p in z_entries), (h.node_id, z_entries)
    finally:
        stop_all([z])
    wait_until(
        lambda: all(OTHER_SITE not in status_of(h)["live_peers"] for h in healthy_mesh),
        "the mesh to let z go",
        60.0,
        lambda: check_alive(healthy_mesh),
    )


# -- 5. certificate rotation by SIGHUP ------------------------------------------------------


@pytest.mark.timeout(300)
def test_sighup_with_a_mismatched_key_keeps_the_current_certificate_and_serving(
    healthy_mesh: list[DaemonHandle], pki: Pki
) -> None:
    a = healthy_mesh[0]
    key_path = pki.key("a")
    original_key = key_path.read_bytes()
    current = presented_cert(a.address, pki)
    assert current == der_of(pki.pem("a"))
    warnings = a.log().count("kept the current certificate")
    try:
        replace_file(pki.key("b").read_bytes(), key_path)  # a valid key, not a's
        os.kill(a.proc.pid, signal.SIGHUP)
        wait_until(
            lambda: a.log().count("kept the current certificate") > warnings,
            "a to log that it kept its certificate",
            30.0,
            lambda: check_alive([a]),
        )
    finally:
        replace_file(original_key, key_path)
    line = [x for x in a.log().splitlines() if "kept the current certificate" in x][-1]
    assert "WARNING" in line and "does not match" in line, line
    assert "reloaded the TLS files" not in a.log()
    # New connections still get the old certificate, and the mesh keeps gossiping with a.
    assert presented_cert(a.address, pki) == current
    code, _, details = status_tls(pki.creds(CLIENT), a.address)
    assert code == grpc.StatusCode.OK, details
    wait_counters_grow(
        healthy_mesh, ("pushes_acked",), 3, "gossip after the refused reload", timeout_s=120.0
    )


def rotate_by_sighup(tmp_path: Path, pki: Pki, handles: list[DaemonHandle]) -> Pki:
    """Issue new certificates (same CA) elsewhere, rename them over each node's configured
    paths (a reader never sees a half-written file), SIGHUP every node, and check that
    each logs the reload and hands the new certificate to the next connection."""
    renewed = tmp_path / "renewed"
    renewed.mkdir(mode=0o700)
    for name in (certs.CA_CERT_FILE, certs.CA_KEY_FILE):
        shutil.copy2(pki.dir / name, renewed / name)
    fresh = Pki(renewed)
    for h in handles:
        assert presented_cert(h.address, pki) == der_of(pki.pem(h.node_id)), h.node_id
        certs.issue(h.node_id, renewed)
        assert der_of(fresh.pem(h.node_id)) != der_of(pki.pem(h.node_id))
        replace_file(fresh.key(h.node_id).read_bytes(), pki.key(h.node_id))
        replace_file(fresh.pem(h.node_id).read_bytes(), pki.pem(h.node_id))
    for h in handles:
        os.kill(h.proc.pid, signal.SIGHUP)
    for h in handles:
        wait_until(
            lambda h=h: "reloaded the TLS files" in h.log(),
            f"{h.node_id} to reload its TLS files",
            30.0,
            lambda: check_alive(handles),
        )
        assert "kept the current certificate" not in h.log(), h.log()[-3000:]
        assert presented_cert(h.address, pki) == der_of(fresh.pem(h.node_id)), h.node_id
    return fresh


@pytest.mark.timeout(300)
def test_certificates_rotated_by_sighup_are_served_and_gossip_goes_on(tmp_path: Path) -> None:
    pki = Pki.create(tmp_path / "ca", [*IDS, CLIENT])
    handles = start_tls_mesh(tmp_path, pki, IDS, **CONFIG)
    try:
        wait_counters_grow(handles, ("pushes_acked",), 3, "gossip before the rotation", 120.0)
        rotate_by_sighup(tmp_path, pki, handles)
        # Every node dials its peers again, now presenting its new certificate.
        wait_counters_grow(
            handles, ("pushes_acked",), 5, "gossip after the rotation", timeout_s=120.0
        )
        wait_mesh_live(handles, 60.0)
    finally:
        stop_all(handles)


@pytest.mark.timeout(300)
def test_sum_of_weights_is_exactly_n_after_a_certificate_rotation_by_sighup(
    tmp_path: Path,
) -> None:
    """Learning rate 0: only gossip moves the weights, so after a rotation under full
    gossip and a SIGTERM of every node in turn, the final weights add up to N."""
    pki = Pki.create(tmp_path / "ca", [*IDS, CLIENT])
    handles = start_tls_mesh(tmp_path, pki, IDS, **CONFIG)
    try:
        wait_counters_grow(handles, ("pushes_acked",), 3, "gossip before the rotation", 120.0)
        rotate_by_sighup(tmp_path, pki, handles)
        wait_counters_grow(
            handles, ("pushes_acked",), 5, "gossip after the rotation", timeout_s=120.0
        )
        weights = stop_in_turn(handles)
    finally:
        stop_all(handles)
    totals = [sum(w[s] for w in weights) for s in range(len(weights[0]))]
    assert all(abs(t - len(IDS)) <= TOLERANCE for t in totals), (totals, weights)


def test_a_site_whose_seed_has_another_ca_logs_the_tls_failure_at_info(
    tmp_path: Path, mesh: list[DaemonHandle]
) -> None:
    """An operator reads INFO: the no-live-peer line names each seed with its last failure."""
    other = Pki.create(tmp_path / "other-ca", ["stray", CLIENT])
    stray = start_daemon(
        tmp_path,
        "stray",
        free_ports(1)[0],
        client_tls=other.creds(CLIENT),
        seeds=[mesh[0].address],
        tls=other.tls_config("stray"),
    )
    try:
        wait_until(
            lambda: (
                f"seeds tried: {mesh[0].address} (" in stray.log() and "UNAVAILABLE" in stray.log()
            ),
            "the stray site to log why its seed did not answer",
            60.0,
        )
        assert stray.status()["live_peers"] == []
    finally:
        stop_all([stray])


@pytest.mark.timeout(300)
def test_removing_a_site_from_tls_allow_by_sighup_revokes_it_without_a_restart(
    tmp_path: Path,
) -> None:
    """The README's revocation: edit tls.allow, SIGHUP; the site is dropped and refused."""
    import tomllib

    from tests.conftest import write_config

    pki = Pki.create(tmp_path / "ca", ["a", "b", CLIENT])
    handles = start_tls_mesh(tmp_path, pki, ["a", "b"], gossip={"push_probability": 1.0})
    a, b = handles
    try:
        config = tomllib.loads(b.config_path.read_text())
        config["tls"]["allow"] = ["b", CLIENT]
        write_config(b.config_path, config)
        b.proc.send_signal(signal.SIGHUP)
        wait_until(
            lambda: "peer a is not in tls.allow any more; dropped" in b.log(),
            "b to drop a after the reload",
            60.0,
        )
        code, _, details = status_tls(pki.creds("a"), b.address)
        assert code == grpc.StatusCode.PERMISSION_DENIED and "'a'" in details, details
        # a keeps dialling b; each time b refuses to make it a peer again.
        wait_until(
            lambda: (
                status_of(b)["rejected"].get("NotAllowed", 0) > 0
                and b.status()["live_peers"] == []
                and "b" not in a.status()["live_peers"]
            ),
            "a to be refused by b and stop counting b as live",
            120.0,
        )
    finally:
        stop_all(handles)
