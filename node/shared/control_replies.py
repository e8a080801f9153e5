"""Signed replies to control commands, and ``gossipd control``'s checks before it believes one.

A reply on ``reply/NODE_ID`` is signed by the site that gives it, with its own TLS key
(the certificate its mesh CA issued for NODE_ID), so whoever can publish on the broker
cannot tell an operator that a site obeyed when it did not, or refused when it obeyed.
The signed bytes (version 1) are eight lines, each ended by a line feed::

    gossipd-control-reply-v1
    MESH_ID        the mesh's id
    NODE_ID        the site answering
    COMMAND        the command answered, as the site read it (? when it read none)
    REQUEST_ID     the command's request id
    NONCE          the command's nonce (empty when it had none)
    OUTCOME        ok or refused
    DETAIL         what the site says, to the end (the only field that may hold a
                   line feed: the seven before it cannot, so the bytes name one reply)

The command's nonce is in the bytes, so a reply answers one command only: a site's old
reply cannot be passed off as its answer to a new one.

No I/O and no clock: the caller gives the time.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from gossipd.node.errors import GossipdError
from gossipd.node.shared.cert_checks import node_id_of_cert
from gossipd.node.shared.cert_files import is_ca
from gossipd.node.shared.control_signatures import (
    cert_and_signature,
    issued_by,
    signed_lines,
    valid_at,
    verifies,
)

REPLY_VERSION_LINE = "gossipd-control-reply-v1"
MAX_DETAIL_CHARS = 2000
# Why ``gossipd control`` did not believe a reply.
REPLY_REASONS = (
    "unsigned",
    "bad_field",
    "other_ca",
    "cert_expired",
    "not_a_site",
    "wrong_node",
    "bad_signature",
    "other_command",
)


class ReplyUnverified(GossipdError):
    """A reply ``gossipd control`` does not believe; ``reason`` is one of
    :data:`REPLY_REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in REPLY_REASONS, reason
        super().__init__(f"unverified ({reason}): {detail}")
        self.reason = reason


@dataclass(frozen=True)
class ReplyClaim:
    """What a site's signature on its reply covers."""

    mesh_id: str
    node_id: str
    command: str
    request_id: str
    nonce: str
    ok: bool
    detail: str

    def __post_init__(self) -> None:
        # A line feed in one of the seven one-line fields would let other fields be cut
        # from the same bytes: a reply "refused" to a request id holding "\nNONCE\nok"
        # would verify as an "ok" to that nonce's command.
        lines = (self.mesh_id, self.node_id, self.command, self.request_id, self.nonce)
        bad = next((v for v in lines if not isinstance(v, str) or "\n" in v), None)
        if bad is not None:
            raise ValueError(f"a reply's one-line field holds a line feed: {bad!r:.60}")

    def canonical(self) -> bytes:
        """The bytes the site signs (the block above)."""
        lines = (
            REPLY_VERSION_LINE,
            self.mesh_id,
            self.node_id,
            self.command,
            self.request_id,
            self.nonce,
            "ok" if self.ok else "refused",
            self.detail,
        )
        return signed_lines(lines)

    def payload(self) -> dict[str, Any]:
        """The reply unsigned (a site without TLS has no key to sign it with)."""
        return asdict(self)


def sign_reply(claim: ReplyClaim, cert_pem: bytes, key_pem: bytes) -> dict[str, Any]:
    """The reply to publish: ``claim``'s fields, the site's certificate (PEM) and its
    signature (ECDSA P-256, SHA-256, DER, base64) with the site's TLS key."""
    key = serialization.load_pem_private_key(key_pem, password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey), "a site's TLS key is ECDSA P-256"
    signature = key.sign(claim.canonical(), ec.ECDSA(hashes.SHA256()))
    return {
        **claim.payload(),
        "cert": cert_pem.decode(),
        "signature": base64.b64encode(signature).decode(),
    }


def _reply_claim(data: Mapping[str, Any]) -> ReplyClaim:
    texts = {k: data.get(k) for k in ("mesh_id", "node_id", "command", "request_id", "nonce")}
    for name, value in texts.items():
        if not isinstance(value, str) or "\n" in value or len(value) > 256:
            raise ReplyUnverified("bad_field", f"{name} {value!r:.60} is not one short line")
    ok, detail = data.get("ok"), data.get("detail")
    if not isinstance(ok, bool):
        raise ReplyUnverified("bad_field", f"ok {ok!r:.60} is not true or false")
    if not isinstance(detail, str) or len(detail) > MAX_DETAIL_CHARS:
        raise ReplyUnverified("bad_field", f"detail {detail!r:.60} is not text")
    return ReplyClaim(ok=ok, detail=detail, **texts)


class ReplyVerifier:
    """``gossipd control``'s checks on the replies to one command it sent: signed by the
    certificate ``ca`` issued for the site on whose topic it came, over this command."""

    def __init__(
        self, ca: x509.Certificate, *, mesh_id: str, command: str, request_id: str, nonce: str
    ) -> None:
        self.ca = ca
        self.mesh_id = mesh_id
        self.command = command
        self.request_id = request_id
        self.nonce = nonce

    def check(self, node_id: str, data: Mapping[str, Any], now_s: float) -> ReplyClaim:
        """The reply ``data`` that came on ``reply/node_id``, once it is proven to be that
        site's answer to this command; ReplyUnverified saying why not."""
        if "signature" not in data and "cert" not in data:
            raise ReplyUnverified(
                "unsigned",
                "it carries no signature (a site without TLS, tls.insecure, has no key to "
                "sign with, and one older than signed replies signs none), so anyone who can "
                "publish on the broker could have written it",
            )
        claim = _reply_claim(data)
        cert, signed = cert_and_signature(data, lambda why: ReplyUnverified("bad_field", why))
        signer = self._signer(cert, now_s)
        if signer != node_id or claim.node_id != node_id:
            raise ReplyUnverified(
                "wrong_node",
                f"it came on {node_id!r}'s reply topic saying it is from {claim.node_id!r}, "
                f"signed by {signer!r}'s certificate: one site cannot answer for another",
            )
        if not verifies(cert, signed, claim.canonical()):
            raise ReplyUnverified(
                "bad_signature",
                f"the signature does not verify with {signer!r}'s certificate over the "
                "reply's fields (altered on the way)",
            )
        asked = (self.mesh_id, self.command, self.request_id, self.nonce)
        answered = (claim.mesh_id, claim.command, claim.request_id, claim.nonce)
        if answered != asked:
            raise ReplyUnverified(
                "other_command",
                f"{signer!r} signed it as its answer to {claim.command!r} (request "
                f"{claim.request_id!r}, mesh {claim.mesh_id!r}), not to this {self.command!r}: "
                "an old reply sent again",
            )
        return claim

    def _signer(self, cert: x509.Certificate, now_s: float) -> str:
        subject = cert.subject.rfc4514_string()
        if not issued_by(cert, self.ca):
            raise ReplyUnverified(
                "other_ca",
                f"its certificate {subject!r} is not signed by the mesh CA "
                f"{self.ca.subject.rfc4514_string()!r} given with --ca",
            )
        if not valid_at(cert, now_s):
            raise ReplyUnverified(
                "cert_expired",
                f"its certificate {subject!r} is valid from "
                f"{cert.not_valid_before_utc.isoformat()} to "
                f"{cert.not_valid_after_utc.isoformat()}",
            )
        site = None if is_ca(cert) else node_id_of_cert(cert)
        if site is None:
            raise ReplyUnverified(
                "not_a_site",
                f"it is signed with {subject!r}, which names no site (an operator's or the "
                "coordinator's certificate)",
            )
        return site
