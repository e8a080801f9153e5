"""Reading certificates back: which site, coordinator or operator one names
(:func:`node_id_of`, :func:`coordinator_name_of`, :func:`operator_name_of`), what
``gossipd certs show`` prints (:func:`describe`), and whether a site's CA, certificate and
key fit together and are valid now (:func:`check_pair`).
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.x509.oid import NameOID

from gossipd.node.shared.cert_files import (
    COORDINATOR_DNS_NAME,
    MESH_DNS_NAME,
    NODE_ID_RE,
    OPERATOR_EKU,
    CertificateError,
    is_ca,
    load_cert,
    load_key,
    now_utc,
)


def _dns_names(cert: x509.Certificate) -> list[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return list(san.get_values_for_type(x509.DNSName))


def _common_names(cert: x509.Certificate) -> list[str]:
    return [str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]


def operator_name_of(cert: x509.Certificate) -> str | None:
    """The operator a certificate names (its common name) when it carries the operator usage
    and is no CA; None for any other certificate, a site's included."""
    try:
        uses = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return None
    if OPERATOR_EKU not in uses or is_ca(cert):
        return None
    return next((n for n in _common_names(cert) if NODE_ID_RE.fullmatch(n)), None)


def _coordinator_name_of_cert(cert: x509.Certificate) -> str | None:
    dns = _dns_names(cert)
    if COORDINATOR_DNS_NAME not in dns or MESH_DNS_NAME in dns or is_ca(cert):
        return None
    return next((n for n in _common_names(cert) if NODE_ID_RE.fullmatch(n)), None)


def node_id_of_cert(cert: x509.Certificate) -> str | None:
    """The node id a site certificate names; None for an operator's or the coordinator's
    (they never speak for a site) and for one that names no valid node id (a CA's)."""
    dns = _dns_names(cert)
    if COORDINATOR_DNS_NAME in dns or operator_name_of(cert) is not None:
        return None  # the coordinator's and operators' certificates never speak for a site
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
    return node_id_of_cert(cert)


def describe(path: str | Path) -> dict[str, Any]:
    """What ``gossipd certs show`` prints: enough to tell which site, which mesh, until when."""
    path = Path(path)
    cert = load_cert(path)
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
        "node_id": None if is_ca(cert) else node_id_of_cert(cert),
        "coordinator": _coordinator_name_of_cert(cert),
        "role": _role(cert),
        "dns_names": dns_names,
        "serial": f"{cert.serial_number:x}",
        "not_before": start.isoformat(),
        "not_after": end.isoformat(),
        "valid_now": start <= now_utc() <= end,
        "is_ca": is_ca(cert),
        "sha256": cert.fingerprint(hashes.SHA256()).hex(),
    }


def _role(cert: x509.Certificate) -> str | None:
    """ca, site, coordinator or operator: what the certificate may do in a mesh."""
    if is_ca(cert):
        return "ca"
    if operator_name_of(cert) is not None:
        return "operator"
    if _coordinator_name_of_cert(cert) is not None:
        return "coordinator"
    return "site" if node_id_of_cert(cert) is not None else None


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
    now = now_utc() if now is None else now
    ca_cert, site_cert, site_key = load_cert(ca_path), load_cert(cert_path), load_key(key_path)
    if not is_ca(ca_cert):
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
    return (_coordinator_name_of_cert if coordinator else node_id_of_cert)(site_cert)
