"""Mutual TLS on real daemons: real certificates, real sockets, real gRPC.

One mesh CA per module (in a temporary directory, ``tests/tls_mesh.py``), a
certificate per site, and ``operator``: the certificate this test presents to Status
(any certificate of the mesh may ask). The tests share one module mesh of three daemons
gossiping at push probability 1; ``c`` runs with ``tls.allow`` set. That a certificate
speaks only for its own node id is ``tests/test_tls_identity.py`` (on a mesh of its own,
the same); rotations and revocations that change the certificate files run their own
meshes in ``tests/test_tls_rotation.py``.

What the tests rely on (node/shared/tls.py, node/net/serve/servicer.py): a site's identity is the
node id its certificate names; every claim of identity in a request must equal
it (PERMISSION_DENIED, counted as ``IdentityMismatch``); a certificate that TLS
refuses never reaches a handler.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gossipd.node.launch.localmesh import free_ports
from tests.conftest import (
    DaemonHandle,
    check_alive,
    start_daemon,
    status_of,
    stop_all,
    wait_counters_grow,
    wait_until,
)
from tests.outsider import dead_address, node_info
from tests.outsider_tls import handshake_tls, status_tls
from tests.tls_mesh import (
    CLIENT,
    PLAINTEXT,
    FilesTls,
    Pki,
    der_of,
    healthy,
    module_mesh,
    module_pki,
    presented_cert,
    replace_file,
)

CLI_TIMEOUT_S = 60.0


# -- the module's mesh --------------------------------------------------------------------


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


def _cli_status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gossipd.node.cli", "status", *args],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        check=False,
    )


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


# -- 3. a reload by SIGHUP that is refused ---------------------------------------------------


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
