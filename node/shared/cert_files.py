"""The names, rules and files every certificate shares: the mesh's fixed DNS names, the
CA's file names and default lifetimes, the node id rule, and reading and writing PEM files.

:mod:`.cert_issuing` makes certificates with these, :mod:`.cert_checks` reads them back;
:mod:`.certs` is the one module callers import.
"""

from __future__ import annotations

import datetime as dt
import os
import re
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from gossipd.node.errors import GossipdError
from gossipd.node.shared.config import NodeConfig

MESH_DNS_NAME = "gossipd-node"
COORDINATOR_DNS_NAME = "gossipd-coordinator"
# The extended key usage of an operator certificate, the only one it carries (no serverAuth,
# no clientAuth, no DNS name): it signs MQTT control commands and nothing else. An OID under
# 2.25 is a UUID written as an integer (ITU-T X.667), unique without registering an arc.
OPERATOR_EKU = x509.ObjectIdentifier("2.25.264150099849790660328065467093392138037")
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
    raise AssertionError("NodeConfig.node_id lost its pattern; cert_files.py reads it from there")


NODE_ID_RE = _node_id_pattern()


class CertificateError(GossipdError):
    """A certificate or key that cannot be made, read, or trusted; the message names the file."""


def now_utc() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def check_id(kind: str, value: str) -> str:
    """``value`` if it follows the node id rule; CertificateError naming ``kind`` if not."""
    if not NODE_ID_RE.fullmatch(value):
        raise CertificateError(
            f"{kind} {value!r} is not valid: use only letters, digits, '.', '_' and '-' "
            "(the same rule as node_id and mesh_id in the config)"
        )
    return value


def write_new(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` with ``mode`` and write ``data``; CertificateError if it exists."""
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


def refuse_existing(*paths: Path, fix: str) -> None:
    for path in paths:
        if path.exists():
            raise CertificateError(f"{path} already exists; {fix}")


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def write_pair(
    cert_path: Path, key_path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> tuple[Path, Path]:
    """Write the key (mode 0600) and then the certificate (0644); returns both paths."""
    write_new(key_path, key_pem(key), 0o600)
    write_new(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return cert_path, key_path


def load_cert(path: Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except OSError as err:
        raise CertificateError(f"cannot read certificate {path}: {err.strerror}") from err
    except ValueError as err:
        raise CertificateError(f"{path} is not a PEM certificate: {err}") from err


def load_key(path: Path) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except OSError as err:
        raise CertificateError(f"cannot read private key {path}: {err.strerror}") from err
    except (ValueError, TypeError) as err:
        raise CertificateError(f"{path} is not an unencrypted PEM private key: {err}") from err
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CertificateError(f"{path} is not an EC private key; gossipd certs writes EC keys")
    return key


def is_ca(cert: x509.Certificate) -> bool:
    try:
        return bool(cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)
    except x509.ExtensionNotFound:
        return False
