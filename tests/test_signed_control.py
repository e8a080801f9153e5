"""Signed control commands without a network: the canonical bytes, signing and every
refusal of :class:`ControlVerifier`, with real certificates of real CAs, and the bounded
memory of obeyed nonces. The daemon's side (a real broker, real sites) is in test_mqtt.py."""

from __future__ import annotations

import base64
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from pydantic import ValidationError

from gossipd.node.shared import certs
from gossipd.node.shared.cert_files import load_cert, load_key
from gossipd.node.shared.config import MqttConfig
from gossipd.node.shared.control_signing import (
    ControlClaim,
    ControlRefused,
    ControlVerifier,
    NonceWindow,
    sign,
)

MESH = "m1"
# When the certificates were issued (valid for a year from then): set by ``ca_dir``, since
# the suite may collect this module minutes before the fixture runs.
NOW = int(time.time())
WINDOW_S = 120.0
NONCE = "0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def ca_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    global NOW
    directory = tmp_path_factory.mktemp("control") / "ca"
    certs.init_ca(directory, mesh_id=MESH)
    certs.issue("alice", directory, operator=True)
    certs.issue("site-a", directory)
    other = directory.parent / "other"
    certs.init_ca(other, mesh_id=MESH)
    certs.issue("mallory", other, operator=True)
    NOW = int(time.time())
    return directory


def _claim(**change: Any) -> ControlClaim:
    fields: dict[str, Any] = {
        "mesh_id": MESH,
        "target": "site-a",
        "command": "pause",
        "request_id": "r1",
        "issued_at": NOW,
        "nonce": NONCE,
    }
    return ControlClaim(**{**fields, **change})


def _signed(pem: Path, claim: ControlClaim | None = None) -> dict[str, Any]:
    return sign(claim or _claim(), load_cert(pem), load_key(pem.with_suffix(".key")))


def _verifier(ca_dir: Path, ca: x509.Certificate | None = None, **kw: Any) -> ControlVerifier:
    return ControlVerifier(
        ca or load_cert(ca_dir / "ca.pem"),
        mesh_id=MESH,
        node_id="site-a",
        window_s=WINDOW_S,
        **kw,
    )


def _refusal(verifier: ControlVerifier, data: dict[str, Any], now_s: float | None = None) -> str:
    with pytest.raises(ControlRefused) as refused:
        verifier.check(data, NOW if now_s is None else now_s)
    assert str(refused.value).startswith(f"refused ({refused.value.reason}): ")
    return refused.value.reason


def test_the_canonical_form_is_the_seven_documented_lines() -> None:
    assert _claim(target="*", issued_at=1_700_000_000).canonical() == (
        b"gossipd-control-v1\nm1\n*\npause\nr1\n1700000000\n0123456789abcdef0123456789abcdef\n"
    )


@pytest.mark.parametrize(
    "change",
    [
        {"mesh_id": "m1\nsite-b"},  # a line feed would let one field pose as two
        {"target": "a b"},
        {"command": "reboot"},
        {"request_id": "r\n1"},
        {"request_id": ""},
        {"issued_at": "1700000000"},
        {"issued_at": True},
        {"nonce": "short"},
    ],
)
def test_a_claim_with_a_field_outside_its_alphabet_is_refused_as_bad_field(
    change: dict[str, Any],
) -> None:
    with pytest.raises(ControlRefused) as refused:
        _claim(**change)
    assert refused.value.reason == "bad_field"


def test_a_command_signed_by_an_operator_of_the_mesh_ca_is_obeyed_once(ca_dir: Path) -> None:
    verifier = _verifier(ca_dir)
    data = _signed(ca_dir / "alice.pem")
    assert set(data) == {
        "mesh_id",
        "target",
        "command",
        "request_id",
        "issued_at",
        "nonce",
        "cert",
        "signature",
    }
    assert verifier.check(data, NOW + WINDOW_S) == "alice"  # at the edge of the window
    assert _refusal(verifier, data, NOW + 1) == "replay"
    to_all = _signed(ca_dir / "alice.pem", _claim(target="*", nonce="f" * 32))
    assert verifier.check(to_all, NOW) == "alice"


def test_a_signature_made_by_openssl_over_the_documented_bytes_verifies(
    ca_dir: Path, tmp_path: Path
) -> None:
    openssl = shutil.which("openssl")
    assert openssl is not None, "openssl is needed to show another tool can sign"
    claim = _claim()
    message = tmp_path / "command.txt"
    message.write_bytes(claim.canonical())
    der = subprocess.run(
        [openssl, "dgst", "-sha256", "-sign", str(ca_dir / "alice.key"), str(message)],
        capture_output=True,
        check=True,
        timeout=30,
    ).stdout
    data = {
        **_signed(ca_dir / "alice.pem", claim),
        "signature": base64.b64encode(der).decode(),
    }
    assert _verifier(ca_dir).check(data, NOW) == "alice"


def test_each_command_no_operator_of_this_mesh_signed_for_this_node_now_is_refused(
    ca_dir: Path,
) -> None:
    verifier = _verifier(ca_dir)
    alice = ca_dir / "alice.pem"
    good = _signed(alice)
    cases: list[tuple[str, dict[str, Any], float]] = [
        ("unsigned", {"command": "pause", "request_id": "r1"}, NOW),
        ("bad_field", {**good, "signature": "not base64!"}, NOW),
        ("bad_field", {**good, "cert": "-----BEGIN CERTIFICATE-----\nxx"}, NOW),
        ("bad_field", {**good, "issued_at": None}, NOW),
        ("bad_signature", {**good, "command": "leave"}, NOW),
        (
            "bad_signature",
            {**good, "signature": _signed(alice, _claim(nonce="e" * 32))["signature"]},
            NOW,
        ),
        ("not_operator", _signed(ca_dir / "site-a.pem"), NOW),
        ("other_ca", _signed(ca_dir.parent / "other" / "mallory.pem"), NOW),
        ("cert_expired", good, NOW + 2 * 365 * 86400),  # alice's is valid for a year
        ("wrong_mesh", _signed(alice, _claim(mesh_id="m2")), NOW),
        ("wrong_node", _signed(alice, _claim(target="site-b")), NOW),
        ("stale", good, NOW + WINDOW_S + 1),
        ("stale", good, NOW - WINDOW_S - 1),  # from the future
    ]
    for reason, data, at in cases:
        assert _refusal(verifier, data, at) == reason, reason
    assert len(verifier.nonces) == 0  # nothing refused was remembered


def test_a_revoked_operator_certificate_is_refused_and_the_others_still_obeyed(
    ca_dir: Path,
) -> None:
    """An operator certificate cannot be made to expire early: a lost laptop's key could
    pause the mesh for the rest of its year. mqtt.revoked_operators lists it by its
    SHA-256 fingerprint, in either form an operator copies it in."""
    certs.issue("bob", ca_dir, operator=True)
    bob = load_cert(ca_dir / "bob.pem")
    openssl_form = ":".join(f"{b:02X}" for b in bob.fingerprint(hashes.SHA256()))
    config = MqttConfig(broker="127.0.0.1:1883", revoked_operators=[openssl_form])
    verifier = _verifier(ca_dir, revoked=config.revoked_operators)
    with pytest.raises(ControlRefused, match=r"'bob'.*mqtt\.revoked_operators") as refused:
        verifier.check(_signed(ca_dir / "bob.pem"), NOW)
    assert refused.value.reason == "revoked"
    assert verifier.check(_signed(ca_dir / "alice.pem"), NOW) == "alice"  # not revoked
    with pytest.raises(ValidationError, match="SHA-256 fingerprint"):
        MqttConfig(broker="127.0.0.1:1883", revoked_operators=["not-a-fingerprint"])


def test_a_mesh_without_a_ca_refuses_every_command(ca_dir: Path) -> None:
    verifier = ControlVerifier(None, mesh_id=MESH, node_id="site-a", window_s=WINDOW_S)
    assert _refusal(verifier, _signed(ca_dir / "alice.pem")) == "no_ca"
    assert _refusal(verifier, {"command": "pause", "request_id": "r1"}) == "no_ca"


def test_the_nonce_memory_is_bounded_and_never_lets_a_replay_through() -> None:
    window = NonceWindow(window_s=100.0, capacity=3)
    for i in range(3):
        assert window.admit(f"n{i}", NOW + i, NOW)
    assert window.admit("n3", NOW + 3, NOW)  # full: n0 (the oldest) is forgotten
    assert len(window) == 3
    assert not window.admit("n0", NOW, NOW)  # forgotten, but at or below the floor
    assert not window.admit("never-seen", NOW, NOW)  # the price: an old unseen one too
    assert not window.admit("n2", NOW + 2, NOW)
    assert window.admit("n4", NOW + 4, NOW)
    # Once older than the window, a nonce is forgotten (its command would be stale).
    assert window.admit("n5", NOW + 200, NOW + 190)
    assert len(window) == 1  # n5: n1 to n4 were issued over 100 s before NOW + 190
