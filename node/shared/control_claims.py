"""Signed MQTT control commands: what a signature covers (:class:`ControlClaim`), and why a
node refuses a command (:class:`ControlRefused`).

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

import re
from dataclasses import dataclass

from gossipd.node.errors import GossipdError
from gossipd.node.shared.cert_files import NODE_ID_RE
from gossipd.node.shared.control_signatures import signed_lines

VERSION_LINE = "gossipd-control-v1"
ALL_NODES = "*"
COMMANDS = ("pause", "resume", "checkpoint", "leave")
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
        return signed_lines(lines)


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
