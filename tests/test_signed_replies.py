"""Signed replies to control commands without a network: the canonical bytes, a site's
signature and every reason ``gossipd control`` does not believe a reply, with real
certificates of real CAs. The real broker and real sites are in test_mqtt.py."""

from __future__ import annotations

import base64
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from gossipd.node.shared import certs
from gossipd.node.shared.cert_files import load_cert
from gossipd.node.shared.control_signing import (
    ReplyClaim,
    ReplyUnverified,
    ReplyVerifier,
    sign_reply,
)

MESH = "m1"
NONCE = "0123456789abcdef0123456789abcdef"
# When the certificates were issued (valid for a year from then): set by ``ca_dir``, since
# the suite may collect this module minutes before the fixture runs.
NOW = time.time()


@pytest.fixture(scope="module")
def ca_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    global NOW
    directory = tmp_path_factory.mktemp("replies") / "ca"
    certs.init_ca(directory, mesh_id=MESH)
    for site in ("site-a", "site-b"):
        certs.issue(site, directory)
    certs.issue("alice", directory, operator=True)
    other = directory.parent / "other"
    certs.init_ca(other, mesh_id=MESH)
    certs.issue("site-a", other)  # the same name from another CA
    NOW = time.time()
    return directory


def _claim(**change: Any) -> ReplyClaim:
    fields: dict[str, Any] = {
        "mesh_id": MESH,
        "node_id": "site-a",
        "command": "pause",
        "request_id": "r1",
        "nonce": NONCE,
        "ok": True,
        "detail": "training pauses",
    }
    return ReplyClaim(**{**fields, **change})


def _signed(pem: Path, claim: ReplyClaim | None = None) -> dict[str, Any]:
    return sign_reply(claim or _claim(), pem.read_bytes(), pem.with_suffix(".key").read_bytes())


def _verifier(ca_dir: Path, **change: str) -> ReplyVerifier:
    fields = {"mesh_id": MESH, "command": "pause", "request_id": "r1", "nonce": NONCE}
    return ReplyVerifier(load_cert(ca_dir / "ca.pem"), **{**fields, **change})


def _unverified(ca_dir: Path, data: dict[str, Any], topic: str, at: float) -> str:
    with pytest.raises(ReplyUnverified) as unverified:
        _verifier(ca_dir).check(topic, data, at)
    assert str(unverified.value).startswith(f"unverified ({unverified.value.reason}): ")
    return unverified.value.reason


def test_the_canonical_form_is_the_eight_documented_lines() -> None:
    """The detail comes last and alone may hold a line feed: the seven lines before it
    cannot, so one set of bytes names one reply."""
    claim = _claim(ok=False, detail="refused (stale): issued\n200 s ago")
    assert claim.canonical() == (
        b"gossipd-control-reply-v1\nm1\nsite-a\npause\nr1\n"
        b"0123456789abcdef0123456789abcdef\nrefused\nrefused (stale): issued\n200 s ago\n"
    )


def test_a_reply_the_site_signed_as_its_answer_to_this_command_is_believed(
    ca_dir: Path,
) -> None:
    data = _signed(ca_dir / "site-a.pem")
    assert set(data) == {
        "mesh_id",
        "node_id",
        "command",
        "request_id",
        "nonce",
        "ok",
        "detail",
        "cert",
        "signature",
    }
    assert _verifier(ca_dir).check("site-a", data, NOW) == _claim()


def test_a_signature_made_by_openssl_over_the_documented_bytes_verifies(
    ca_dir: Path, tmp_path: Path
) -> None:
    openssl = shutil.which("openssl")
    assert openssl is not None, "openssl is needed to show another tool can sign"
    message = tmp_path / "reply.txt"
    message.write_bytes(_claim().canonical())
    der = subprocess.run(
        [openssl, "dgst", "-sha256", "-sign", str(ca_dir / "site-a.key"), str(message)],
        capture_output=True,
        check=True,
        timeout=30,
    ).stdout
    data = {**_signed(ca_dir / "site-a.pem"), "signature": base64.b64encode(der).decode()}
    assert _verifier(ca_dir).check("site-a", data, NOW) == _claim()


def test_each_reply_that_is_not_this_sites_answer_to_this_command_is_not_believed(
    ca_dir: Path,
) -> None:
    """Whoever can publish on the broker can write ``reply/site-a``: a reply without a
    signature, one by another site, by the operator, by another CA, one altered on the
    way, and a genuine reply of site-a's to another command are all refused belief."""
    site_a = ca_dir / "site-a.pem"
    good = _signed(site_a)
    earlier = _signed(site_a, _claim(request_id="r0", nonce="e" * 32, ok=False))
    unsigned = {k: v for k, v in good.items() if k not in ("cert", "signature")}
    cases: list[tuple[str, dict[str, Any], str, float]] = [
        ("unsigned", unsigned, "site-a", NOW),
        ("bad_field", {**good, "signature": "not base64!"}, "site-a", NOW),
        ("bad_field", {**good, "cert": "-----BEGIN CERTIFICATE-----\nxx"}, "site-a", NOW),
        ("bad_field", {**good, "ok": "yes"}, "site-a", NOW),
        ("bad_field", {**good, "nonce": "a\nb"}, "site-a", NOW),
        ("bad_signature", {**good, "ok": False}, "site-a", NOW),
        ("bad_signature", {**good, "detail": "training resumes"}, "site-a", NOW),
        # site-a's earlier "refused", passed off as its answer to this command
        ("bad_signature", {**earlier, "request_id": "r1", "nonce": NONCE}, "site-a", NOW),
        ("other_command", earlier, "site-a", NOW),
        ("other_command", _signed(site_a, _claim(mesh_id="m2")), "site-a", NOW),
        ("other_command", _signed(site_a, _claim(command="leave")), "site-a", NOW),
        ("wrong_node", _signed(ca_dir / "site-b.pem"), "site-a", NOW),
        ("wrong_node", _signed(ca_dir / "site-b.pem", _claim(node_id="site-b")), "site-a", NOW),
        ("wrong_node", good, "site-b", NOW),
        ("not_a_site", _signed(ca_dir / "alice.pem"), "site-a", NOW),
        ("not_a_site", _signed(ca_dir / "ca.pem"), "site-a", NOW),
        ("other_ca", _signed(ca_dir.parent / "other" / "site-a.pem"), "site-a", NOW),
        ("cert_expired", good, "site-a", NOW + 2 * 365 * 86400),  # valid for a year
    ]
    for reason, data, topic, at in cases:
        assert _unverified(ca_dir, data, topic, at) == reason, (reason, topic)


def test_no_reply_is_signed_whose_bytes_could_be_cut_into_another(ca_dir: Path) -> None:
    """A site answers junk commands too, and the request id is the sender's. One holding
    line feeds would put a refusal's signature over bytes that also read as an "ok" to
    another command (its request id, its nonce): a reply that verifies. Nodes take no
    such request id (test_mqtt_messages.py), and a reply cannot be built with one."""
    refusal = {**_claim().payload(), "ok": False, "detail": "refused (unsigned): ..."}
    recut = {**refusal, "request_id": f"r1\n{NONCE}\nok\ntraining pauses", "nonce": ""}
    with pytest.raises(ValueError, match="line feed"):
        ReplyClaim(**recut)
    # What the signature would have covered, read as another reply: the same bytes.
    forged = _claim(detail="training pauses\n\nrefused\nrefused (unsigned): ...")
    assert forged.canonical() == (
        b"gossipd-control-reply-v1\nm1\nsite-a\npause\n"
        + recut["request_id"].encode()
        + b"\n\nrefused\nrefused (unsigned): ...\n"
    )
