"""The signature checks signed control commands and signed replies share: the signed bytes
(one field a line), the certificate and signature a message carries, and whether that
certificate's key signed them, its CA issued it, and it was valid at a time.

No I/O and no clock: the caller gives the time.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from gossipd.node.errors import GossipdError

MAX_CERT_CHARS = 3000


def signed_lines(lines: Iterable[str]) -> bytes:
    """The signed bytes of a command or a reply: each field on its own line."""
    return "".join(f"{line}\n" for line in lines).encode()


def cert_and_signature(
    data: Mapping[str, Any], bad_field: Callable[[str], GossipdError]
) -> tuple[x509.Certificate, bytes]:
    """The certificate (PEM) and signature (base64 DER) a signed message carries; what
    ``bad_field`` makes of the reason when either is malformed."""
    pem, signature = data.get("cert"), data.get("signature")
    if not isinstance(pem, str) or len(pem) > MAX_CERT_CHARS:
        raise bad_field(f"cert must be a PEM certificate, got {pem!r:.60}")
    try:
        cert = x509.load_pem_x509_certificate(pem.encode())
    except ValueError as err:
        raise bad_field(f"cert is not a PEM certificate: {err}") from None
    if not isinstance(signature, str):
        raise bad_field(f"signature must be base64, got {signature!r:.60}")
    try:
        return cert, base64.b64decode(signature, validate=True)
    except binascii.Error as err:
        raise bad_field(f"signature is not base64: {err}") from None


def verifies(cert: x509.Certificate, signature: bytes, message: bytes) -> bool:
    """Whether ``signature`` is ``cert``'s key's ECDSA (SHA-256) signature of ``message``."""
    key = cert.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey):
        return False
    try:
        key.verify(signature, message, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        return False
    return True


def issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def valid_at(cert: x509.Certificate, now_s: float) -> bool:
    now = dt.datetime.fromtimestamp(now_s, dt.UTC)
    return cert.not_valid_before_utc <= now <= cert.not_valid_after_utc
