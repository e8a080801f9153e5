"""Certificates for mutual TLS between sites: one CA per mesh, one key and certificate per site.

A mesh trusts exactly one CA (``ca.pem``); its key (``ca.key``) stays with whoever admits
sites and never travels to them. Each site gets ``<node_id>.pem`` and ``<node_id>.key``,
signed by that CA, usable both as a TLS server and as a TLS client, because every site
both dials and is dialed.

A site certificate names two DNS names:

- ``<node_id>``: who the site is. The server reads it from the peer certificate gRPC
  reports (``node_id_of``), so a peer cannot claim another site's id.
- ``gossipd-node`` (``MESH_DNS_NAME``): a name every site shares. A dialer that only has
  an address (a seed, a gossiped advertise address) does not yet know which node it will
  reach, so it checks the server against this name (gRPC channel option
  ``grpc.ssl_target_name_override``) and learns the node id from the certificate. Any
  certificate from the mesh CA passes that check: trust comes from the CA, the node id
  from the certificate.

A coordinator certificate (``issue(..., coordinator=True)``) names only
``gossipd-coordinator`` (``COORDINATOR_DNS_NAME``), its name in the common name. Nodes dial
the coordinator checking that name, so a site certificate cannot pose as the coordinator;
it carries no node id, so the coordinator's certificate cannot pose as a site either.

Keys are EC P-256, written with mode 0600 from the moment the file exists. Nothing here
shells out to openssl.
"""

from __future__ import annotations

import datetime as dt
import os
import re
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gossipd.node.errors import GossipdError
from gossipd.node.shared.config import NodeConfig

MESH_DNS_NAME = "gossipd-node"
COORDINATOR_DNS_NAME = "gossipd-coordinator"
CA_CERT_FILE = "ca.pem"
CA_KEY_FILE = "ca.key"
CA_DAYS = 3650
SITE_DAYS = 365
# Certificates start a few minutes in the past, so a site whose clock is slightly behind
# the issuer's does not refuse a certificate issued a moment ago.
CLOCK_SKEW = dt.timedelta(minutes=5)


def _node_id_pattern() -> re.Pattern[str]:
    # The one rule for node ids lives on NodeConfig; read it from there so a certificate
    # can never name a node id the config would refuse (or the other way round).
    for meta in NodeConfig.model_fields["node_id"].metadata:
        pattern = getattr(meta, "pattern", None)
        if pattern:
            return re.compile(pattern)
    raise AssertionError("NodeConfig.node_id lost its pattern; certs.py reads it from there")


NODE_ID_RE = _node_id_pattern()


class CertificateError(GossipdError):
    """A certificate or key that cannot be made, read, or trusted; the message names the file."""


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _check_id(kind: str, value: str) -> str:
    if not NODE_ID_RE.fullmatch(value):
        raise CertificateError(
            f"{kind} {value!r} is not valid: use only letters, digits, '.', '_' and '-' "
            "(the same rule as node_id and mesh_id in the config)"
        )
    return value


def _validity(not_before: dt.datetime | None, days: float) -> tuple[dt.datetime, dt.datetime]:
    if days <= 0:
        raise CertificateError(f"days={days} is not valid: a certificate must last > 0 days")
    start = _now() - CLOCK_SKEW if not_before is None else not_before
    if start.tzinfo is None:
        raise CertificateError("not_before must be timezone-aware (e.g. datetime.UTC)")
    return start, start + dt.timedelta(days=days)


def _write_new(path: Path, data: bytes, mode: int) -> None:
    # O_EXCL: never replace a key or certificate in place; the mode is set by open itself,
    # so a private key is never readable by others, not even for an instant.
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        raise CertificateError(
            f"{path} already exists; delete it first or pick another --dir"
        ) from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _refuse_existing(*paths: Path, fix: str) -> None:
    for path in paths:
        if path.exists():
            raise CertificateError(f"{path} already exists; {fix}")


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _load_cert(path: Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except OSError as err:
        raise CertificateError(f"cannot read certificate {path}: {err.strerror}") from err
    except ValueError as err:
        raise CertificateError(f"{path} is not a PEM certificate: {err}") from err


def _load_key(path: Path) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except OSError as err:
        raise CertificateError(f"cannot read private key {path}: {err.strerror}") from err
    except (ValueError, TypeError) as err:
        raise CertificateError(f"{path} is not an unencrypted PEM private key: {err}") from err
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CertificateError(f"{path} is not an EC private key; gossipd certs writes EC keys")
    return key


def _is_ca(cert: x509.Certificate) -> bool:
    try:
        return bool(cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)
    except x509.ExtensionNotFound:
        return False


def init_ca(directory: str | Path, *, mesh_id: str, days: float = CA_DAYS) -> tuple[Path, Path]:
    """Create the mesh CA in ``directory``: ``ca.pem`` to share, ``ca.key`` to keep."""
    _check_id("mesh id", mesh_id)
    directory = Path(directory)
    cert_path, key_path = directory / CA_CERT_FILE, directory / CA_KEY_FILE
    _refuse_existing(
        cert_path,
        key_path,
        fix="a mesh CA is never overwritten (every site certificate it issued would stop "
        "being trusted); pick another --dir, or delete ca.pem and ca.key there yourself",
    )
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    start, end = _validity(None, days)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"gossipd mesh CA {mesh_id}")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_new(key_path, _key_pem(key), 0o600)
    _write_new(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return cert_path, key_path


def issue(
    node_id: str,
    directory: str | Path,
    *,
    days: float = SITE_DAYS,
    not_before: dt.datetime | None = None,
    coordinator: bool = False,
) -> tuple[Path, Path]:
    """Write ``<node_id>.pem`` and ``<node_id>.key``, signed by the CA in ``directory``:
    a site's certificate, or with ``coordinator`` the mesh coordinator's (named ``node_id``).

    The certificate is valid from ``not_before`` (default: now, less a few minutes of clock
    skew) for ``days``. Tests pass a ``not_before`` in the past with a short ``days`` for an
    expired certificate, or one in the future for a not-yet-valid one.
    """
    _check_id("node id", node_id)
    if node_id == Path(CA_CERT_FILE).stem:
        raise CertificateError(
            f"node id {node_id!r} is reserved: its files would be the CA's {CA_CERT_FILE} and "
            f"{CA_KEY_FILE}; pick another node id"
        )
    if node_id in (MESH_DNS_NAME, COORDINATOR_DNS_NAME):
        raise CertificateError(
            f"name {node_id!r} is reserved: every certificate of its kind carries it, so it "
            "names no one; pick another name"
        )
    directory = Path(directory)
    ca_cert_path, ca_key_path = directory / CA_CERT_FILE, directory / CA_KEY_FILE
    if not ca_cert_path.exists() or not ca_key_path.exists():
        raise CertificateError(
            f"no mesh CA in {directory} (need {CA_CERT_FILE} and {CA_KEY_FILE}); "
            f"create one with: gossipd certs init --dir {directory} --mesh-id MESH_ID"
        )
    cert_path, key_path = directory / f"{node_id}.pem", directory / f"{node_id}.key"
    _refuse_existing(
        cert_path,
        key_path,
        fix=f"node {node_id!r} already has a certificate; delete {cert_path.name} and "
        f"{key_path.name} to issue a new one",
    )
    ca_cert, ca_key = _load_cert(ca_cert_path), _load_key(ca_key_path)
    if ca_cert.public_key() != ca_key.public_key():
        raise CertificateError(f"{ca_key_path} is not the key of {ca_cert_path}")
    start, end = _validity(not_before, days)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName(COORDINATOR_DNS_NAME)]
                if coordinator
                else [x509.DNSName(node_id), x509.DNSName(MESH_DNS_NAME)]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=True,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write_new(key_path, _key_pem(key), 0o600)
    _write_new(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return cert_path, key_path


def _dns_names(cert: x509.Certificate) -> list[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return list(san.get_values_for_type(x509.DNSName))


def _common_names(cert: x509.Certificate) -> list[str]:
    return [str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]


def _coordinator_name_of_cert(cert: x509.Certificate) -> str | None:
    dns = _dns_names(cert)
    if COORDINATOR_DNS_NAME not in dns or MESH_DNS_NAME in dns or _is_ca(cert):
        return None
    return next((n for n in _common_names(cert) if NODE_ID_RE.fullmatch(n)), None)


def _node_id_of_cert(cert: x509.Certificate) -> str | None:
    dns = _dns_names(cert)
    if COORDINATOR_DNS_NAME in dns:
        return None  # the coordinator's certificate never speaks for a site
    names = [n for n in dns if n != MESH_DNS_NAME] or _common_names(cert)
    # Only a name the config would accept as a node_id counts: a CA's CN has spaces.
    return next((n for n in names if NODE_ID_RE.fullmatch(n)), None)


def node_id_of(cert_pem: bytes) -> str | None:
    """The node id a site certificate names, or None if it names none (a CA, say).

    The server calls this on the peer certificate gRPC reports in
    ``context.auth_context()["x509_pem_cert"][0]``; TLS has already checked the CA.
    """
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as err:
        raise CertificateError(f"peer certificate is not PEM: {err}") from err
    return _node_id_of_cert(cert)


def describe(path: str | Path) -> dict[str, Any]:
    """What ``gossipd certs show`` prints: enough to tell which site, which mesh, until when."""
    path = Path(path)
    cert = _load_cert(path)
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        dns_names = san.get_values_for_type(x509.DNSName)
    except x509.ExtensionNotFound:
        dns_names = []
    return {
        "file": str(path),
        "subject": cert.subject.rfc4514_string(),
        "issuer": cert.issuer.rfc4514_string(),
        "node_id": None if _is_ca(cert) else _node_id_of_cert(cert),
        "coordinator": _coordinator_name_of_cert(cert),
        "dns_names": dns_names,
        "serial": f"{cert.serial_number:x}",
        "not_before": start.isoformat(),
        "not_after": end.isoformat(),
        "valid_now": start <= _now() <= end,
        "is_ca": _is_ca(cert),
        "sha256": cert.fingerprint(hashes.SHA256()).hex(),
    }


def _check_time(cert: x509.Certificate, path: Path, now: dt.datetime) -> None:
    if now < cert.not_valid_before_utc:
        raise CertificateError(
            f"{path} is not yet valid until {cert.not_valid_before_utc.isoformat()}; "
            "check this machine's clock, or issue a new certificate"
        )
    if now > cert.not_valid_after_utc:
        raise CertificateError(
            f"{path} expired on {cert.not_valid_after_utc.isoformat()}; "
            "issue a new one with: gossipd certs issue NODE_ID --dir CA_DIR"
        )


def coordinator_name_of(cert_pem: bytes) -> str | None:
    """The coordinator name a coordinator certificate carries; None for any other certificate."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as err:
        raise CertificateError(f"peer certificate is not PEM: {err}") from err
    return _coordinator_name_of_cert(cert)


def check_pair(
    ca: str | Path,
    cert: str | Path,
    key: str | Path,
    *,
    now: dt.datetime | None = None,
    coordinator: bool = False,
) -> str | None:
    """Check a site's files before it listens, so a bad file fails at start, not at a handshake.

    Verifies that ``cert`` is signed by ``ca``, that both are valid at ``now``, and that
    ``key`` is the certificate's key. Returns the node id the certificate names (with
    ``coordinator``, the coordinator name; None when it is not that kind of certificate).
    """
    ca_path, cert_path, key_path = Path(ca), Path(cert), Path(key)
    now = _now() if now is None else now
    ca_cert, site_cert, site_key = _load_cert(ca_path), _load_cert(cert_path), _load_key(key_path)
    if not _is_ca(ca_cert):
        raise CertificateError(f"{ca_path} is not a CA certificate (use the mesh's ca.pem)")
    try:
        site_cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature) as err:
        reason = str(err) or "signature does not verify"
        raise CertificateError(
            f"{cert_path} is not signed by the CA in {ca_path} (wrong CA: {reason}; issuer "
            f"{site_cert.issuer.rfc4514_string()!r}); use the ca.pem of the mesh that issued it"
        ) from None
    _check_time(ca_cert, ca_path, now)
    _check_time(site_cert, cert_path, now)
    if site_cert.public_key() != site_key.public_key():
        raise CertificateError(
            f"{key_path} does not match {cert_path} (key does not match the certificate); "
            "use the .key written next to that .pem"
        )
    return (_coordinator_name_of_cert if coordinator else _node_id_of_cert)(site_cert)
