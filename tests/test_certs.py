"""Certificate tooling: real keys, real certificates, a real mutual-TLS gRPC handshake."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gossipd.node.errors import GossipdError
from gossipd.node.shared import certs
from gossipd.node.shared.certs import MESH_DNS_NAME, CertificateError

RPC_TIMEOUT_S = 10.0
CLI_TIMEOUT_S = 60.0
WHOAMI = "/gossipd.test.Peer/WhoAmI"


@pytest.fixture
def ca_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "ca"
    certs.init_ca(directory, mesh_id="m1")
    return directory


def _load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_init_and_issue_write_keys_0600_from_the_start(tmp_path: Path) -> None:
    directory = tmp_path / "new" / "ca"
    ca_pem, ca_key = certs.init_ca(directory, mesh_id="m1")
    site_pem, site_key = certs.issue("site-a", directory)
    assert (ca_pem.name, ca_key.name) == ("ca.pem", "ca.key")
    assert (site_pem.name, site_key.name) == ("site-a.pem", "site-a.key")
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for key in (ca_key, site_key):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    ca = _load(ca_pem)
    assert ca.subject.rfc4514_string() == "CN=gossipd mesh CA m1"
    constraints = ca.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert constraints.ca and constraints.path_length == 0
    usage = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.key_cert_sign and usage.crl_sign
    ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)


def test_init_refuses_to_overwrite_an_existing_ca(ca_dir: Path) -> None:
    before = (ca_dir / "ca.pem").read_bytes()
    with pytest.raises(CertificateError, match=r"ca\.pem already exists.*another --dir"):
        certs.init_ca(ca_dir, mesh_id="m1")
    assert (ca_dir / "ca.pem").read_bytes() == before


def test_issued_cert_verifies_against_ca_with_both_sans_and_both_ekus(ca_dir: Path) -> None:
    site_pem, _ = certs.issue("site-a", ca_dir)
    cert, ca = _load(site_pem), _load(ca_dir / "ca.pem")
    cert.verify_directly_issued_by(ca)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["site-a", MESH_DNS_NAME]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.digital_signature and usage.key_encipherment and not usage.key_cert_sign
    aki = cert.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    assert aki.key_identifier == ski.digest
    assert certs.node_id_of(site_pem.read_bytes()) == "site-a"
    assert certs.node_id_of((ca_dir / "ca.pem").read_bytes()) is None
    assert certs.check_pair(ca_dir / "ca.pem", site_pem, ca_dir / "site-a.key") == "site-a"


def test_describe_reports_site_and_ca(ca_dir: Path) -> None:
    site_pem, _ = certs.issue("site-a", ca_dir, days=30)
    info = certs.describe(site_pem)
    assert info["node_id"] == "site-a" and info["subject"] == "CN=site-a"
    assert info["issuer"] == "CN=gossipd mesh CA m1"
    assert info["valid_now"] is True and info["is_ca"] is False
    span = dt.datetime.fromisoformat(info["not_after"]) - dt.datetime.fromisoformat(
        info["not_before"]
    )
    assert span == dt.timedelta(days=30)
    assert int(info["serial"], 16) == _load(site_pem).serial_number
    ca_info = certs.describe(ca_dir / "ca.pem")
    assert ca_info["is_ca"] is True and ca_info["node_id"] is None


@pytest.mark.parametrize("bad", ["", "a b", "a/b", "../x", "ä", "x\n"])
def test_bad_node_id_is_refused_before_anything_is_written(ca_dir: Path, bad: str) -> None:
    before = sorted(os.listdir(ca_dir))
    with pytest.raises(CertificateError, match="letters, digits"):
        certs.issue(bad, ca_dir)
    assert sorted(os.listdir(ca_dir)) == before


def test_issue_refuses_to_replace_a_site_key_and_reserves_ca(ca_dir: Path) -> None:
    certs.issue("site-a", ca_dir)
    with pytest.raises(CertificateError, match=r"site-a\.pem already exists"):
        certs.issue("site-a", ca_dir)
    with pytest.raises(CertificateError, match="reserved"):
        certs.issue("ca", ca_dir)


def test_renew_replaces_the_pair_with_a_new_key_and_needs_one_to_replace(ca_dir: Path) -> None:
    with pytest.raises(CertificateError, match="issue one without --renew"):
        certs.issue("site-a", ca_dir, renew=True)
    pem, key = certs.issue("site-a", ca_dir)
    old_pem, old_key = pem.read_bytes(), key.read_bytes()
    with pytest.raises(CertificateError, match="with --renew"):
        certs.issue("site-a", ca_dir)
    assert certs.issue("site-a", ca_dir, renew=True, days=30) == (pem, key)
    assert pem.read_bytes() != old_pem and key.read_bytes() != old_key
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    certs.check_pair(ca_dir / "ca.pem", pem, key)  # the new key is the new certificate's
    assert sorted(p.name for p in ca_dir.iterdir() if p.name.endswith(".new")) == []


def test_issue_without_a_ca_says_how_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(CertificateError, match="gossipd certs init --dir"):
        certs.issue("site-a", tmp_path)


def test_check_pair_refuses_a_cert_from_another_ca(ca_dir: Path, tmp_path: Path) -> None:
    # Same mesh id, so the issuer names match and only the signature tells them apart.
    other = tmp_path / "other"
    certs.init_ca(other, mesh_id="m1")
    pem, key = certs.issue("site-a", other)
    with pytest.raises(CertificateError, match="wrong CA") as err:
        certs.check_pair(ca_dir / "ca.pem", pem, key)
    assert str(pem) in str(err.value)
    assert isinstance(err.value, GossipdError)


def test_check_pair_refuses_an_expired_cert_naming_the_date(ca_dir: Path) -> None:
    start = dt.datetime.now(dt.UTC) - dt.timedelta(days=10)
    pem, key = certs.issue("old", ca_dir, not_before=start, days=1)
    expiry = (start + dt.timedelta(days=1)).replace(microsecond=0)
    with pytest.raises(CertificateError, match="expired on") as err:
        certs.check_pair(ca_dir / "ca.pem", pem, key)
    assert expiry.isoformat() in str(err.value) and str(pem) in str(err.value)
    assert certs.describe(pem)["valid_now"] is False


def test_check_pair_refuses_a_not_yet_valid_cert_naming_the_date(ca_dir: Path) -> None:
    start = dt.datetime.now(dt.UTC) + dt.timedelta(days=2)
    pem, key = certs.issue("future", ca_dir, not_before=start)
    with pytest.raises(CertificateError, match="not yet valid until") as err:
        certs.check_pair(ca_dir / "ca.pem", pem, key)
    assert start.replace(microsecond=0).isoformat() in str(err.value)


def test_check_pair_refuses_a_key_that_is_not_the_certs(ca_dir: Path) -> None:
    pem_a, _ = certs.issue("site-a", ca_dir)
    _, key_b = certs.issue("site-b", ca_dir)
    with pytest.raises(CertificateError, match="key does not match") as err:
        certs.check_pair(ca_dir / "ca.pem", pem_a, key_b)
    assert str(key_b) in str(err.value)


def test_validity_must_be_positive(ca_dir: Path) -> None:
    with pytest.raises(CertificateError, match="days=0"):
        certs.issue("site-a", ca_dir, days=0)


# --- a real mutual-TLS handshake -------------------------------------------------------


async def _whoami(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    # What the daemon's servicer will do: the peer's node id comes from its certificate.
    auth = context.auth_context()
    node_id = certs.node_id_of(auth["x509_pem_cert"][0])
    return (node_id or "").encode()


def _site_files(directory: Path, node_id: str) -> tuple[bytes, bytes]:
    return (directory / f"{node_id}.key").read_bytes(), (directory / f"{node_id}.pem").read_bytes()


async def _mtls_calls(ca_dir: Path, client_dir: Path, client_id: str) -> tuple[object, str]:
    ca = (ca_dir / "ca.pem").read_bytes()
    server = grpc.aio.server()
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "gossipd.test.Peer", {"WhoAmI": grpc.unary_unary_rpc_method_handler(_whoami)}
            )
        ]
    )
    creds = grpc.ssl_server_credentials(
        [_site_files(ca_dir, "server")], root_certificates=ca, require_client_auth=True
    )
    port = server.add_secure_port("127.0.0.1:0", creds)
    await server.start()
    try:
        key, chain = _site_files(client_dir, client_id)
        channel_creds = grpc.ssl_channel_credentials(ca, key, chain)
        options = [("grpc.ssl_target_name_override", MESH_DNS_NAME)]
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", channel_creds, options) as ch:
            reply = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT_S
            )
            who = await ch.unary_unary(WHOAMI)(b"", timeout=RPC_TIMEOUT_S)
        return reply.status, who.decode()
    finally:
        await server.stop(grace=None)


def test_mtls_handshake_serves_health_and_server_sees_client_node_id(ca_dir: Path) -> None:
    certs.issue("server", ca_dir)
    certs.issue("site-b", ca_dir)
    status, who = asyncio.run(_mtls_calls(ca_dir, ca_dir, "site-b"))
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert who == "site-b"


def test_mtls_refuses_a_client_from_another_ca(ca_dir: Path, tmp_path: Path) -> None:
    certs.issue("server", ca_dir)
    other = tmp_path / "other"
    certs.init_ca(other, mesh_id="m1")
    certs.issue("intruder", other)
    # The intruder trusts the real CA (so it accepts the server), but its own
    # certificate is from another CA: the server must end the handshake.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(_mtls_calls(ca_dir, other, "intruder"))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


# --- CLI ---------------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gossipd.node.cli", "certs", *args],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        check=False,
    )


def test_cli_init_issue_show_print_files_and_next_step(tmp_path: Path) -> None:
    d = tmp_path / "ca"
    init = _cli("init", "--dir", str(d), "--mesh-id", "m1")
    assert init.returncode == 0, init.stderr
    assert str(d / "ca.pem") in init.stdout and str(d / "ca.key") in init.stdout
    assert "gossipd certs issue NODE_ID --dir" in init.stdout
    issued = _cli("issue", "site-a", "--dir", str(d), "--days", "7")
    assert issued.returncode == 0, issued.stderr
    assert str(d / "site-a.pem") in issued.stdout and str(d / "site-a.key") in issued.stdout
    assert stat.S_IMODE((d / "site-a.key").stat().st_mode) == 0o600
    shown = _cli("show", str(d / "site-a.pem"))
    assert shown.returncode == 0, shown.stderr
    assert "site-a" in shown.stdout and "gossipd mesh CA m1" in shown.stdout
    as_json = _cli("show", str(d / "site-a.pem"), "--json")
    assert as_json.returncode == 0, as_json.stderr
    info = json.loads(as_json.stdout)
    assert info["node_id"] == "site-a" and info["valid_now"] is True


def test_cli_bad_node_id_exits_2_with_one_line(tmp_path: Path) -> None:
    d = tmp_path / "ca"
    certs.init_ca(d, mesh_id="m1")
    bad = _cli("issue", "no/slashes", "--dir", str(d))
    assert bad.returncode == 2
    assert bad.stdout == ""
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "'no/slashes'" in lines[0], bad.stderr


# --- operator certificates ------------------------------------------------------------


def test_an_operator_cert_signs_only_and_names_no_site_nor_coordinator(ca_dir: Path) -> None:
    pem, key = certs.issue("alice", ca_dir, operator=True)
    cert = _load(pem)
    cert.verify_directly_issued_by(_load(ca_dir / "ca.pem"))
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage)
    assert list(eku.value) == [certs.OPERATOR_EKU] and eku.critical
    usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.digital_signature and not usage.key_encipherment and not usage.key_cert_sign
    with pytest.raises(x509.ExtensionNotFound):
        cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert certs.operator_name_of(cert) == "alice"
    assert certs.node_id_of(pem.read_bytes()) is None  # the servicer refuses it as a peer
    assert certs.coordinator_name_of(pem.read_bytes()) is None
    assert certs.check_pair(ca_dir / "ca.pem", pem, key) is None  # a site cannot start with it
    info = certs.describe(pem)
    assert (info["role"], info["node_id"], info["subject"]) == ("operator", None, "CN=alice")
    site_pem, _ = certs.issue("site-a", ca_dir)
    coordinator_pem, _ = certs.issue("coord", ca_dir, coordinator=True)
    assert certs.operator_name_of(_load(site_pem)) is None  # a site cannot sign control
    roles = [certs.describe(p)["role"] for p in (site_pem, coordinator_pem, ca_dir / "ca.pem")]
    assert roles == ["site", "coordinator", "ca"]
    with pytest.raises(CertificateError, match="coordinator or for an operator, not both"):
        certs.issue("bob", ca_dir, operator=True, coordinator=True)


def test_mtls_refuses_an_operator_cert_as_a_client(ca_dir: Path) -> None:
    certs.issue("server", ca_dir)
    certs.issue("alice", ca_dir, operator=True)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(_mtls_calls(ca_dir, ca_dir, "alice"))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_cli_issue_operator_and_show_its_role(
    ca_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gossipd.node.cli.main import main

    assert main(["certs", "issue", "--operator", "alice", "--dir", str(ca_dir)]) == 0
    out = capsys.readouterr().out
    assert "operator alice" in out and "gossipd control --broker" in out, out
    assert main(["certs", "show", str(ca_dir / "alice.pem"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["role"] == "operator"
    assert main(["certs", "show", str(ca_dir / "alice.pem")]) == 0
    assert "       role: operator" in capsys.readouterr().out
