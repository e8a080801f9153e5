"""What gossipd says on MQTT, and the checks on what it hears there: no I/O.

Topics, under ``PREFIX/MESH_ID/``:

* ``presence/NODE_ID`` (retained): ``{node_id, address, incarnation, fingerprint,
  mesh_id, version}``; an empty payload clears it (the last will, or a graceful leave);
* ``control`` (every node) and ``control/NODE_ID`` (one node):
  ``{"command": "pause"|"resume"|"checkpoint"|"leave", "request_id": "...", ...}`` and the
  signature fields of :mod:`gossipd.node.shared.control_signing`, checked there;
* ``reply/NODE_ID``: ``{request_id, node_id, command, ok, detail}``.

Anyone who can publish to the broker can write any of these, so each message is
checked here and a bad one raises :class:`Junk` with a reason from a fixed set
(the label of ``gossipd_mqtt_rejected_total``). A presence is only ever a hint:
the address it names is dialled and the node there must prove its id with its
own certificate, as for any relayed candidate.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from gossipd.node.shared.control_signing import COMMANDS

MAX_PAYLOAD_BYTES = 4096
MAX_REQUEST_ID = 128
# A request id goes back in the signed reply's one-line field: no line feed, nothing a
# reply's bytes could be re-cut at (control_signing's reply form).
_REQUEST_ID = re.compile(rf"[A-Za-z0-9._:-]{{0,{MAX_REQUEST_ID}}}")
_ID = re.compile(r"[A-Za-z0-9._-]+")
_HOST_PORT = r"[A-Za-z0-9.\-\[\]:]+:[0-9]{1,5}"
# A direct address, or a relayed site's (docs/nat.md): relay://SITE@HOST:PORT,HOST:PORT
_ADDRESS = re.compile(rf"{_HOST_PORT}|relay://[A-Za-z0-9._\-]+@(?:{_HOST_PORT}(?:,{_HOST_PORT})*)?")
REASONS = (
    "oversize",
    "bad_json",
    "bad_field",
    "wrong_mesh",
    "unknown_command",
    "topic_mismatch",
)


class Junk(ValueError):
    """A message that is ignored; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str, request_id: str | None = None) -> None:
        assert reason in REASONS, reason
        super().__init__(detail)
        self.reason = reason
        self.request_id = request_id  # a command's, when it can still be answered


@dataclass(frozen=True)
class Topics:
    """The topic names of one node in one mesh."""

    prefix: str
    mesh_id: str
    node_id: str

    @property
    def base(self) -> str:
        return f"{self.prefix}/{self.mesh_id}"

    def presence(self, node_id: str | None = None) -> str:
        return f"{self.base}/presence/{node_id or self.node_id}"

    @property
    def presence_filter(self) -> str:
        return f"{self.base}/presence/+"

    @property
    def control(self) -> str:
        return f"{self.base}/control"

    @property
    def control_mine(self) -> str:
        return f"{self.base}/control/{self.node_id}"

    def reply(self, node_id: str | None = None) -> str:
        return f"{self.base}/reply/{node_id or self.node_id}"

    def presence_of(self, topic: str) -> str | None:
        """The node id a presence topic names, or None when ``topic`` is no presence topic."""
        head = f"{self.base}/presence/"
        return topic[len(head) :] if topic.startswith(head) else None


@dataclass(frozen=True)
class Presence:
    node_id: str
    address: str
    incarnation: int  # as in its handshake: a candidate must answer with the same
    fingerprint: str | None  # SHA-256 of the certificate (DER, hex); None in plaintext
    mesh_id: str
    version: str

    def payload(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()


@dataclass(frozen=True)
class Command:
    command: str
    request_id: str
    body: Mapping[str, Any] = field(default_factory=dict)  # the whole message, signature too


def _object(payload: bytes) -> dict[str, Any]:
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise Junk("oversize", f"{len(payload)} bytes, over the {MAX_PAYLOAD_BYTES} allowed")
    try:
        data = json.loads(payload)
    except (UnicodeDecodeError, ValueError) as err:
        raise Junk("bad_json", f"not JSON: {err}") from None
    if not isinstance(data, dict):
        raise Junk("bad_json", f"a JSON {type(data).__name__}, not an object")
    return data


def _text(data: dict[str, Any], key: str, pattern: re.Pattern[str] | None = None) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value or len(value) > 256:
        raise Junk("bad_field", f"{key} must be a non-empty string, got {value!r:.60}")
    if pattern is not None and not pattern.fullmatch(value):
        raise Junk("bad_field", f"{key} = {value!r:.60} is not well-formed")
    return value


def parse_presence(topics: Topics, topic_node: str, payload: bytes) -> Presence | None:
    """The presence on ``topics.presence(topic_node)``; None for an empty (cleared) one."""
    if not payload:
        return None
    data = _object(payload)
    node_id = _text(data, "node_id", _ID)
    if node_id != topic_node:
        raise Junk("topic_mismatch", f"a presence for {node_id!r} on the topic of {topic_node!r}")
    mesh_id = _text(data, "mesh_id")
    if mesh_id != topics.mesh_id:
        raise Junk("wrong_mesh", f"mesh_id {mesh_id!r:.60}, this node is in {topics.mesh_id!r}")
    fingerprint = data.get("fingerprint")
    if fingerprint is not None and not (
        isinstance(fingerprint, str) and re.fullmatch(r"[0-9a-f]{64}", fingerprint)
    ):
        raise Junk(
            "bad_field", f"fingerprint must be 64 hex digits or null, got {fingerprint!r:.80}"
        )
    incarnation = data.get("incarnation")
    if not isinstance(incarnation, int) or isinstance(incarnation, bool) or incarnation < 0:
        raise Junk("bad_field", f"incarnation must be an integer >= 0, got {incarnation!r:.60}")
    return Presence(
        node_id=node_id,
        address=_text(data, "address", _ADDRESS),
        incarnation=incarnation,
        fingerprint=fingerprint,
        mesh_id=mesh_id,
        version=_text(data, "version"),
    )


def parse_command(payload: bytes) -> Command:
    data = _object(payload)
    request_id = data.get("request_id")
    if not isinstance(request_id, str) or not _REQUEST_ID.fullmatch(request_id):
        raise Junk(
            "bad_field",
            f"request_id must be at most {MAX_REQUEST_ID} of [A-Za-z0-9._:-], "
            f"got {request_id!r:.60}",
        )
    command = data.get("command")
    if not isinstance(command, str):
        raise Junk("bad_field", f"command must be a string, got {command!r:.60}")
    if command not in COMMANDS:
        known = ", ".join(COMMANDS)
        raise Junk("unknown_command", f"command {command!r:.60}; known: {known}", request_id)
    return Command(command, request_id, data)
