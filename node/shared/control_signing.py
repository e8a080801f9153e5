"""Signed MQTT control commands: an operator signs a command, a node checks it before it
obeys, and ``gossipd control`` checks the site's signed reply before it believes it.

Whoever can publish on the broker can write a control topic, so a node obeys a command only
when an operator certificate of its own mesh CA signed it (``gossipd certs issue NAME
--operator``), for this mesh and this node (or every node), within ``window_s`` of the
node's clock, and not before: each nonce is obeyed once.

This module signs (:func:`sign`) and names the whole of it for its callers; the parts:
the command's form and its refusals, :mod:`.control_claims`; a node's checks,
:mod:`.control_verifying`; the replay window, :mod:`.control_nonces`; the signed replies,
:mod:`.control_replies`; the signature checks both share, :mod:`.control_signatures`.
"""

from __future__ import annotations

import base64
from dataclasses import asdict
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from gossipd.node.shared.control_claims import (
    ALL_NODES,
    COMMANDS,
    ISSUE_OPERATOR,
    REASONS,
    VERSION_LINE,
    ControlClaim,
    ControlRefused,
)
from gossipd.node.shared.control_nonces import MAX_REMEMBERED, NonceWindow
from gossipd.node.shared.control_replies import (
    MAX_DETAIL_CHARS,
    REPLY_REASONS,
    REPLY_VERSION_LINE,
    ReplyClaim,
    ReplyUnverified,
    ReplyVerifier,
    sign_reply,
)
from gossipd.node.shared.control_signatures import MAX_CERT_CHARS
from gossipd.node.shared.control_verifying import ControlVerifier

__all__ = [
    "ALL_NODES",
    "COMMANDS",
    "ISSUE_OPERATOR",
    "MAX_CERT_CHARS",
    "MAX_DETAIL_CHARS",
    "MAX_REMEMBERED",
    "REASONS",
    "REPLY_REASONS",
    "REPLY_VERSION_LINE",
    "VERSION_LINE",
    "ControlClaim",
    "ControlRefused",
    "ControlVerifier",
    "NonceWindow",
    "ReplyClaim",
    "ReplyUnverified",
    "ReplyVerifier",
    "sign",
    "sign_reply",
]


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
