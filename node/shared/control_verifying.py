"""A node's checks on a signed control command before it obeys one (the form is
:mod:`.control_claims`'s): signed by an operator certificate of its own mesh CA, not
revoked, for this mesh and this node, within the window, and never obeyed before.

No I/O and no clock: the caller gives the time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes

from gossipd.node.shared.cert_checks import operator_name_of
from gossipd.node.shared.control_claims import (
    ALL_NODES,
    ISSUE_OPERATOR,
    ControlClaim,
    ControlRefused,
)
from gossipd.node.shared.control_nonces import MAX_REMEMBERED, NonceWindow
from gossipd.node.shared.control_signatures import (
    cert_and_signature,
    issued_by,
    valid_at,
    verifies,
)


def _parse(data: Mapping[str, Any]) -> tuple[ControlClaim, x509.Certificate, bytes]:
    claim = ControlClaim(  # each field's type and form is checked by ControlClaim
        mesh_id=data.get("mesh_id"),
        target=data.get("target"),
        command=data.get("command"),
        request_id=data.get("request_id"),
        issued_at=data.get("issued_at"),
        nonce=data.get("nonce"),
    )
    cert, signature = cert_and_signature(data, lambda why: ControlRefused("bad_field", why))
    return claim, cert, signature


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
        if not verifies(cert, signature, claim.canonical()):
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
        if not issued_by(cert, self.ca):
            raise ControlRefused(
                "other_ca",
                f"its certificate {signer!r} (issuer {cert.issuer.rfc4514_string()!r}) is not "
                f"signed by this mesh's CA {self.ca.subject.rfc4514_string()!r}; sign with an "
                f"operator certificate of this mesh: {ISSUE_OPERATOR}",
            )
        start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
        if not valid_at(cert, now_s):
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
