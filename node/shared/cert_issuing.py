"""Making certificates: the mesh CA (:func:`init_ca`) and, signed by it, a site's, the
coordinator's or an operator's key and certificate (:func:`issue`). What each certificate
names is set out in :mod:`.certs`.
"""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gossipd.node.shared.cert_files import (
    CA_CERT_FILE,
    CA_DAYS,
    CA_KEY_FILE,
    CLOCK_SKEW,
    COORDINATOR_DNS_NAME,
    MESH_DNS_NAME,
    OPERATOR_EKU,
    SITE_DAYS,
    CertificateError,
    check_id,
    load_cert,
    load_key,
    now_utc,
    refuse_existing,
    write_pair,
)


def _validity(not_before: dt.datetime | None, days: float) -> tuple[dt.datetime, dt.datetime]:
    if days <= 0:
        raise CertificateError(f"days={days} is not valid: a certificate must last > 0 days")
    start = now_utc() - CLOCK_SKEW if not_before is None else not_before
    if start.tzinfo is None:
        raise CertificateError("not_before must be timezone-aware (e.g. datetime.UTC)")
    return start, start + dt.timedelta(days=days)


def _key_usage(*, signs_certificates: bool, enciphers_keys: bool = True) -> x509.KeyUsage:
    """A CA signs certificates and CRLs; a site signs handshakes and enciphers keys; an
    operator only signs (its control commands)."""
    return x509.KeyUsage(
        digital_signature=not signs_certificates,
        content_commitment=False,
        key_encipherment=not signs_certificates and enciphers_keys,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=signs_certificates,
        crl_sign=signs_certificates,
        encipher_only=False,
        decipher_only=False,
    )


def init_ca(directory: str | Path, *, mesh_id: str, days: float = CA_DAYS) -> tuple[Path, Path]:
    """Create the mesh CA in ``directory``: ``ca.pem`` to share, ``ca.key`` to keep."""
    check_id("mesh id", mesh_id)
    directory = Path(directory)
    cert_path, key_path = directory / CA_CERT_FILE, directory / CA_KEY_FILE
    refuse_existing(
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
        .add_extension(_key_usage(signs_certificates=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return write_pair(cert_path, key_path, cert, key)


def _issuable_paths(
    node_id: str, directory: Path, *, renew: bool = False
) -> tuple[Path, Path, Path, Path]:
    """The CA's certificate and key and the new pair's paths, once ``node_id`` may be issued
    in ``directory``: a valid, unreserved name, a CA there, no pair of that name yet (with
    ``renew``: that pair, which the new one replaces)."""
    check_id("node id", node_id)
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
    ca_cert_path, ca_key_path = directory / CA_CERT_FILE, directory / CA_KEY_FILE
    if not ca_cert_path.exists() or not ca_key_path.exists():
        raise CertificateError(
            f"no mesh CA in {directory} (need {CA_CERT_FILE} and {CA_KEY_FILE}); "
            f"create one with: gossipd certs init --dir {directory} --mesh-id MESH_ID"
        )
    cert_path, key_path = directory / f"{node_id}.pem", directory / f"{node_id}.key"
    if renew:
        missing = [p.name for p in (cert_path, key_path) if not p.exists()]
        if missing:
            raise CertificateError(
                f"--renew replaces {node_id!r}'s certificate and key, but {directory} has no "
                f"{' or '.join(missing)}; issue one without --renew"
            )
    else:
        refuse_existing(
            cert_path,
            key_path,
            fix=f"node {node_id!r} already has a certificate; to rotate it, issue a new one "
            "with --renew (the old pair is replaced), then send the site SIGHUP",
        )
    return ca_cert_path, ca_key_path, cert_path, key_path


def _signed_leaf(
    node_id: str,
    key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    validity: tuple[dt.datetime, dt.datetime],
    *,
    coordinator: bool,
    operator: bool,
) -> x509.Certificate:
    """``key``'s certificate, signed by the CA: a site's names ``node_id`` and the mesh name,
    the coordinator's only the coordinator name; both serve and dial TLS. An operator's
    names no DNS name and carries only the operator usage (:data:`OPERATOR_EKU`, marked
    critical), so TLS refuses it as a server or client and it names no site."""
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(validity[0])
        .not_valid_after(validity[1])
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            _key_usage(signs_certificates=False, enciphers_keys=not operator), critical=True
        )
    )
    if operator:
        builder = builder.add_extension(x509.ExtendedKeyUsage([OPERATOR_EKU]), critical=True)
    else:
        names = (
            [x509.DNSName(COORDINATOR_DNS_NAME)]
            if coordinator
            else [x509.DNSName(node_id), x509.DNSName(MESH_DNS_NAME)]
        )
        uses = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        builder = builder.add_extension(
            x509.SubjectAlternativeName(names), critical=False
        ).add_extension(x509.ExtendedKeyUsage(uses), critical=False)
    return builder.add_extension(
        x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
        critical=False,
    ).sign(ca_key, hashes.SHA256())


def issue(
    node_id: str,
    directory: str | Path,
    *,
    days: float = SITE_DAYS,
    not_before: dt.datetime | None = None,
    coordinator: bool = False,
    operator: bool = False,
    renew: bool = False,
) -> tuple[Path, Path]:
    """Write ``<node_id>.pem`` and ``<node_id>.key``, signed by the CA in ``directory``:
    a site's certificate, with ``coordinator`` the mesh coordinator's, with ``operator``
    an operator's, who signs MQTT control commands (each named ``node_id``).

    The certificate is valid from ``not_before`` (default: now, less a few minutes of clock
    skew) for ``days``. Tests pass a ``not_before`` in the past with a short ``days`` for an
    expired certificate, or one in the future for a not-yet-valid one. ``renew`` replaces
    the pair ``node_id`` has (rotation); without it an existing pair is refused.
    """
    if coordinator and operator:
        raise CertificateError(
            "a certificate is for the coordinator or for an operator, not both; issue two"
        )
    ca_cert_path, ca_key_path, cert_path, key_path = _issuable_paths(
        node_id, Path(directory), renew=renew
    )
    ca_cert, ca_key = load_cert(ca_cert_path), load_key(ca_key_path)
    if ca_cert.public_key() != ca_key.public_key():
        raise CertificateError(f"{ca_key_path} is not the key of {ca_cert_path}")
    validity = _validity(not_before, days)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _signed_leaf(
        node_id, key, ca_cert, ca_key, validity, coordinator=coordinator, operator=operator
    )
    if not renew:
        return write_pair(cert_path, key_path, cert, key)
    # Written whole beside the old pair, then renamed over it: a site reading the files
    # (at SIGHUP) sees the old pair or the new one, never a half-written file.
    fresh_cert, fresh_key = cert_path.with_suffix(".pem.new"), key_path.with_suffix(".key.new")
    for stale in (fresh_cert, fresh_key):
        stale.unlink(missing_ok=True)
    write_pair(fresh_cert, fresh_key, cert, key)
    os.replace(fresh_key, key_path)
    os.replace(fresh_cert, cert_path)
    return cert_path, key_path
