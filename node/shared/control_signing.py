"""Signed MQTT control commands: the bytes an operator signs, and a node's checks before it
obeys one; and the signed replies (below :class:`ControlVerifier`), which ``gossipd control``
checks before it believes one.

Whoever can publish on the broker can write a control topic, so a node obeys a command only
when an operator certificate of its own mesh CA signed it (``gossipd certs issue NAME
--operator``), for this mesh and this node (or every node), within ``window_s`` of the
node's clock, and not before: each nonce is obeyed once.

The signed bytes (version 1) are seven lines, each ended by a line feed::

    gossipd-control-v1
    MESH_ID        the mesh's id
    TARGET         a node id, or * for every node
    COMMAND        pause, resume, checkpoint or leave
    REQUEST_ID     1 to 128 of [A-Za-z0-9._:-]
    ISSUED_AT      Unix time in whole seconds, decimal
    NONCE          16 to 64 of [A-Za-z0-9_-], new for every command

Every field has an alphabet without a line feed, so the bytes name one command only. The
message is the JSON object of those fields (``mesh_id``, ``target``, ``command``,
``request_id``, ``issued_at`` as a number, ``nonce``) plus ``cert``, the signer's
certificate (PEM), and ``signature``: ECDSA P-256 with SHA-256 over the bytes, DER, base64
(``openssl dgst -sha256 -sign operator.key`` makes it).

No I/O and no clock: the caller gives the time.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import heapq
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from gossipd.node.errors import GossipdError
from gossipd.node.shared.cert_checks import node_id_of_cert, operator_name_of
from gossipd.node.shared.cert_files import NODE_ID_RE, is_ca

VERSION_LINE = "gossipd-control-v1"
ALL_NODES = "*"
COMMANDS = ("pause", "resume", "checkpoint", "leave")
MAX_REMEMBERED = 4096  # nonces kept against replay; beyond it the oldest go (see NonceWindow)
MAX_CERT_CHARS = 3000
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_NONCE = re.compile(r"[A-Za-z0-9_-]{16,64}")
ISSUE_OPERATOR = "gossipd certs issue NAME --operator --dir CA_DIR"
# The label of gossipd_mqtt_control_refused_total.
REASONS = (
    "no_ca",
    "unsigned",
    "bad_field",
    "other_ca",
    "cert_expired",
    "not_operator",
    "revoked",
    "bad_signature",
    "wrong_mesh",
    "wrong_node",
    "stale",
    "replay",
)


class ControlRefused(GossipdError):
    """A control command a node does not obey; ``reason`` is one of :data:`REASONS`, the
    message says why and how to send one that is obeyed."""

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in REASONS, reason
        super().__init__(f"refused ({reason}): {detail}")
        self.reason = reason


@dataclass(frozen=True)
class ControlClaim:
    """What a signature covers: one command, for one mesh and target, at one time."""

    mesh_id: str
    target: str
    command: str
    request_id: str
    issued_at: int
    nonce: str

    def __post_init__(self) -> None:
        bad = _first_bad_field(self)
        if bad is not None:
            raise ControlRefused("bad_field", bad)

    def canonical(self) -> bytes:
        """The bytes the operator signs (module docstring)."""
        lines = (
            VERSION_LINE,
            self.mesh_id,
            self.target,
            self.command,
            self.request_id,
            str(self.issued_at),
            self.nonce,
        )
        return _lines(lines)


def _first_bad_field(claim: ControlClaim) -> str | None:
    if not isinstance(claim.mesh_id, str) or not NODE_ID_RE.fullmatch(claim.mesh_id):
        return f"mesh_id {claim.mesh_id!r:.60} is not a mesh id"
    if not isinstance(claim.target, str) or not (
        claim.target == ALL_NODES or NODE_ID_RE.fullmatch(claim.target)
    ):
        return f"target {claim.target!r:.60} is neither a node id nor {ALL_NODES!r}"
    if claim.command not in COMMANDS:
        return f"command {claim.command!r:.60}; known: {', '.join(COMMANDS)}"
    if not isinstance(claim.request_id, str) or not _REQUEST_ID.fullmatch(claim.request_id):
        return f"request_id {claim.request_id!r:.60} is not 1 to 128 of [A-Za-z0-9._:-]"
    if not isinstance(claim.issued_at, int) or isinstance(claim.issued_at, bool):
        return f"issued_at {claim.issued_at!r:.60} is not whole Unix seconds"
    if not isinstance(claim.nonce, str) or not _NONCE.fullmatch(claim.nonce):
        return f"nonce {claim.nonce!r:.60} is not 16 to 64 of [A-Za-z0-9_-]"
    return None


def sign(
    claim: ControlClaim, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> dict[str, Any]:
    """The JSON object to publish: ``claim``'s fields, ``cert`` (PEM) and the signature."""
    signature = key.sign(claim.canonical(), ec.ECDSA(hashes.SHA256()))
    return {
        **asdict(claim),
        "cert": cert.public_bytes(serialization.Encoding.PEM).decode(),
        "signature": base64.b64encode(signature).decode(),
    }


def _parse(data: Mapping[str, Any]) -> tuple[ControlClaim, x509.Certificate, bytes]:
    claim = ControlClaim(  # each field's type and form is checked by ControlClaim
        mesh_id=data.get("mesh_id"),
        target=data.get("target"),
        command=data.get("command"),
        request_id=data.get("request_id"),
        issued_at=data.get("issued_at"),
        nonce=data.get("nonce"),
    )
    cert, signature = _cert_and_signature(data, lambda why: ControlRefused("bad_field", why))
    return claim, cert, signature


def _lines(lines: Iterable[str]) -> bytes:
    """The signed bytes of a command or a reply: each field on its own line."""
    return "".join(f"{line}\n" for line in lines).encode()


def _cert_and_signature(
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


def _verifies(cert: x509.Certificate, signature: bytes, message: bytes) -> bool:
    """Whether ``signature`` is ``cert``'s key's ECDSA (SHA-256) signature of ``message``."""
    key = cert.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey):
        return False
    try:
        key.verify(signature, message, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        return False
    return True


def _issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _valid_at(cert: x509.Certificate, now_s: float) -> bool:
    now = dt.datetime.fromtimestamp(now_s, dt.UTC)
    return cert.not_valid_before_utc <= now <= cert.not_valid_after_utc


class NonceWindow:
    """The nonces obeyed whose command is still within the window, at most ``capacity``.

    A nonce is forgotten once its command is older than the window (it would be refused as
    stale). When more than ``capacity`` are fresh, the oldest is forgotten and every command
    issued at or before it is refused from then on: memory stays bounded and no replay gets
    through; what it costs is refusing old commands never seen, under a flood only an
    operator (who must sign each) can make."""

    def __init__(self, window_s: float, capacity: int = MAX_REMEMBERED) -> None:
        self.window_s = window_s
        self.capacity = capacity
        self._by_time: list[tuple[int, str]] = []
        self._seen: set[str] = set()
        self.floor = -math.inf  # issued_at at or below which a forgotten one may hide

    def __len__(self) -> int:
        return len(self._seen)

    def admit(self, nonce: str, issued_at: int, now_s: float) -> bool:
        """Remember ``nonce``; False when it was seen, or may have been and was forgotten."""
        while self._by_time and self._by_time[0][0] < now_s - self.window_s:
            self._seen.discard(heapq.heappop(self._by_time)[1])
        if nonce in self._seen or issued_at <= self.floor:
            return False
        if len(self._seen) >= self.capacity:
            oldest, forgotten = heapq.heappop(self._by_time)
            self._seen.discard(forgotten)
            self.floor = max(self.floor, oldest)
        heapq.heappush(self._by_time, (issued_at, nonce))
        self._seen.add(nonce)
        return True


class ControlVerifier:
    """A node's checks on a control command. ``ca`` is the mesh CA (the node's ``tls.ca``);
    None in a plaintext mesh, where nothing can be verified and every command is refused."""

    def __init__(
        self,
        ca: x509.Certificate | None,
        *,
        mesh_id: str,
        node_id: str,
        window_s: float,
        max_remembered: int = MAX_REMEMBERED,
        revoked: Iterable[str] = (),
    ) -> None:
        """``revoked``: SHA-256 fingerprints (lowercase hex) of operator certificates whose
        commands are refused although the CA signed them and they have not expired."""
        self.ca = ca
        self.mesh_id = mesh_id
        self.node_id = node_id
        self.window_s = window_s
        self.revoked = frozenset(revoked)
        self.nonces = NonceWindow(window_s, max_remembered)

    def check(self, data: Mapping[str, Any], now_s: float) -> str:
        """The operator who signed the command ``data``, once it may be obeyed (its nonce is
        then remembered); ControlRefused saying why and the fix when it may not."""
        if self.ca is None:
            raise ControlRefused(
                "no_ca",
                "this node runs without TLS (tls.insecure), so it has no mesh CA to check a "
                "signature against; give the mesh a CA ([tls]), or set "
                "mqtt.control_requires_signature = false to obey unsigned commands from "
                "anyone who can publish on the broker",
            )
        if "signature" not in data and "cert" not in data:
            raise ControlRefused(
                "unsigned",
                "it carries no signature; send it with gossipd control --cert OPERATOR.pem "
                f"--key OPERATOR.key (an operator certificate: {ISSUE_OPERATOR})",
            )
        claim, cert, signature = _parse(data)
        operator = self._check_signer(cert, now_s)
        if not _verifies(cert, signature, claim.canonical()):
            raise ControlRefused(
                "bad_signature",
                f"the signature does not verify with operator {operator!r}'s certificate over "
                "the command's fields (altered on the way, or other bytes signed); sign the "
                "form of docs/mqtt.md, or send it with gossipd control",
            )
        self._check_claim(claim, operator, now_s)
        return operator

    def _check_signer(self, cert: x509.Certificate, now_s: float) -> str:
        assert self.ca is not None
        signer = cert.subject.rfc4514_string()
        if not _issued_by(cert, self.ca):
            raise ControlRefused(
                "other_ca",
                f"its certificate {signer!r} (issuer {cert.issuer.rfc4514_string()!r}) is not "
                f"signed by this mesh's CA {self.ca.subject.rfc4514_string()!r}; sign with an "
                f"operator certificate of this mesh: {ISSUE_OPERATOR}",
            )
        start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
        if not _valid_at(cert, now_s):
            raise ControlRefused(
                "cert_expired",
                f"the certificate {signer!r} is valid from {start.isoformat()} to "
                f"{end.isoformat()}; issue a new one: {ISSUE_OPERATOR} --renew",
            )
        operator = operator_name_of(cert)
        if operator is None:
            raise ControlRefused(
                "not_operator",
                f"it is signed with {signer!r}, which is not an operator certificate (a "
                f"site's or the coordinator's cannot sign control); {ISSUE_OPERATOR}",
            )
        fingerprint = cert.fingerprint(hashes.SHA256()).hex()
        if fingerprint in self.revoked:
            raise ControlRefused(
                "revoked",
                f"operator {operator!r}'s certificate (sha256 {fingerprint}) is in "
                "mqtt.revoked_operators; sign with another operator certificate of this mesh "
                f"({ISSUE_OPERATOR})",
            )
        return operator

    def _check_claim(self, claim: ControlClaim, operator: str, now_s: float) -> None:
        by = f"signed by operator {operator!r}"
        if claim.mesh_id != self.mesh_id:
            raise ControlRefused(
                "wrong_mesh",
                f"{by} for mesh {claim.mesh_id!r}, this node is in {self.mesh_id!r}; send it "
                f"with --mesh-id {self.mesh_id}",
            )
        if claim.target not in (ALL_NODES, self.node_id):
            raise ControlRefused(
                "wrong_node",
                f"{by} for node {claim.target!r}, this is {self.node_id!r}; send it with "
                f"--node {self.node_id} (or without --node for every node)",
            )
        skew_s = now_s - claim.issued_at
        if abs(skew_s) > self.window_s:
            when = "ago" if skew_s > 0 else "in the future"
            raise ControlRefused(
                "stale",
                f"{by}, issued {abs(skew_s):.0f} s {when}, outside this node's window of "
                f"{self.window_s:g} s (mqtt.control_window_s); send it anew, and check that "
                "the operator's and this node's clocks agree (NTP)",
            )
        if not self.nonces.admit(claim.nonce, claim.issued_at, now_s):
            raise ControlRefused(
                "replay",
                f"{by}, nonce {claim.nonce!r} (request {claim.request_id!r}) was already "
                "obeyed, or is older than every command this node still remembers: each "
                "command is obeyed once; send it anew (gossipd control signs each with a new "
                "nonce)",
            )


# -- signed replies ----------------------------------------------------------------------
#
# A reply on ``reply/NODE_ID`` is signed by the site that gives it, with its own TLS key
# (the certificate its mesh CA issued for NODE_ID), so whoever can publish on the broker
# cannot tell an operator that a site obeyed when it did not, or refused when it obeyed.
# The signed bytes (version 1) are eight lines, each ended by a line feed::
#
#     gossipd-control-reply-v1
#     MESH_ID        the mesh's id
#     NODE_ID        the site answering
#     COMMAND        the command answered, as the site read it (? when it read none)
#     REQUEST_ID     the command's request id
#     NONCE          the command's nonce (empty when it had none)
#     OUTCOME        ok or refused
#     DETAIL         what the site says, to the end (the only field that may hold a
#                    line feed: the seven before it cannot, so the bytes name one reply)
#
# The command's nonce is in the bytes, so a reply answers one command only: a site's old
# reply cannot be passed off as its answer to a new one.

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
        return _lines(lines)

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
        cert, signed = _cert_and_signature(data, lambda why: ReplyUnverified("bad_field", why))
        signer = self._signer(cert, now_s)
        if signer != node_id or claim.node_id != node_id:
            raise ReplyUnverified(
                "wrong_node",
                f"it came on {node_id!r}'s reply topic saying it is from {claim.node_id!r}, "
                f"signed by {signer!r}'s certificate: one site cannot answer for another",
            )
        if not _verifies(cert, signed, claim.canonical()):
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
        if not _issued_by(cert, self.ca):
            raise ReplyUnverified(
                "other_ca",
                f"its certificate {subject!r} is not signed by the mesh CA "
                f"{self.ca.subject.rfc4514_string()!r} given with --ca",
            )
        if not _valid_at(cert, now_s):
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
