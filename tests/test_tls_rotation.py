"""Certificate rotation and revocation on running TLS daemons, by SIGHUP.

New certificates (same CA) renamed over each node's configured files and a SIGHUP: each
node serves its new certificate to the next connection and gossip goes on, with the sum
of weights exactly N after every node stops. An edit of ``tls.allow`` and a SIGHUP drop a
site and refuse it from then on, without a restart. Each test runs its own mesh (its
certificate files change). A reload refused for a mismatched key is in
``tests/test_tls.py``, on that module's mesh.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import grpc
import pytest

from gossipd.node.shared import certs
from tests.conftest import (
    DaemonHandle,
    check_alive,
    status_of,
    stop_all,
    stop_in_turn,
    wait_counters_grow,
    wait_mesh_live,
    wait_until,
)
from tests.outsider_tls import status_tls
from tests.tls_mesh import (
    CLIENT,
    CONFIG,
    IDS,
    Pki,
    der_of,
    presented_cert,
    replace_file,
    start_tls_mesh,
)

TOLERANCE = 1e-9


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
