"""`gossipd control`: send one signed control command to a mesh's sites through its MQTT
broker and print each site's reply.

The command is signed with an operator certificate of the mesh CA (``gossipd certs issue
NAME --operator``) in the form of :mod:`gossipd.node.shared.control_signing`, published on
``control/NODE_ID`` (``--node``) or ``control`` (every site), and the replies on
``reply/+`` are awaited for at most ``--timeout-s``. Without ``--node``, the sites expected
to answer are those whose presence the broker holds when the command is sent.

A reply is believed only when the site it came from signed it, with the certificate the
mesh CA (``--ca``) issued for it, as its answer to this command (its request id and nonce):
anyone who can publish on the broker can write a reply topic. One that is not is printed
as unverified and ignored; a site with no verified reply counts as not answering.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import aiomqtt
from cryptography import x509

from gossipd.node.errors import GossipdError
from gossipd.node.net.peers.mqtt import CONNECT_TIMEOUT_S
from gossipd.node.net.peers.mqtt_login import BrokerLogin
from gossipd.node.net.peers.mqtt_messages import Topics
from gossipd.node.shared.cert_checks import operator_name_of
from gossipd.node.shared.cert_files import (
    CA_CERT_FILE,
    CertificateError,
    is_ca,
    load_cert,
    load_key,
)
from gossipd.node.shared.config import MqttConfig
from gossipd.node.shared.control_signing import (
    ALL_NODES,
    COMMANDS,
    ControlClaim,
    ControlRefused,
    ReplyClaim,
    ReplyUnverified,
    ReplyVerifier,
    sign,
)

DEFAULT_TIMEOUT_S = 15.0


MAX_REPLY_BYTES = 8192  # a signed reply is about 1.5 KB; larger ones are not read
MAX_UNVERIFIED = 32  # unverified replies kept to print; the rest are only counted


def signed_payload(args: argparse.Namespace, request_id: str) -> tuple[bytes, ControlClaim]:
    """The command of ``args``, signed with its ``--cert`` and ``--key``, and what was
    signed."""
    cert, key = load_cert(args.cert), load_key(args.key)
    if operator_name_of(cert) is None:
        raise CertificateError(
            f"{args.cert} is not an operator certificate, and nodes obey only those; issue one "
            "with: gossipd certs issue NAME --operator --dir CA_DIR"
        )
    if cert.public_key() != key.public_key():
        raise CertificateError(f"{args.key} is not the key of {args.cert}")
    try:
        claim = ControlClaim(
            mesh_id=args.mesh_id,
            target=args.node or ALL_NODES,
            command=args.command,
            request_id=request_id,
            issued_at=int(time.time()),
            nonce=secrets.token_hex(16),
        )
    except ControlRefused as err:  # a --mesh-id or --node no node would take
        raise GossipdError(f"cannot sign this command, no node would obey it: {err}") from None
    return json.dumps(sign(claim, cert, key)).encode(), claim


def mesh_ca(args: argparse.Namespace) -> x509.Certificate:
    """``--ca``, or the ``ca.pem`` beside ``--cert`` (where ``gossipd certs issue`` puts
    both): the CA the sites' reply signatures are checked against."""
    path = args.ca if args.ca is not None else args.cert.parent / CA_CERT_FILE
    if not path.exists():
        raise CertificateError(
            f"no mesh CA at {path} to check the sites' signed replies against; give the mesh's "
            f"CA certificate with --ca CA.pem ({CA_CERT_FILE} in the directory of gossipd "
            "certs init)"
        )
    ca = load_cert(path)
    if not is_ca(ca):
        raise CertificateError(f"--ca {path} is not a CA certificate")
    return ca


@dataclass
class Replies:
    """What came on ``reply/+`` for one command: each site's verified reply, and why the
    others were not believed."""

    verifier: ReplyVerifier
    verified: dict[str, ReplyClaim] = field(default_factory=dict)
    unverified: dict[str, list[str]] = field(default_factory=dict)
    unverified_more: int = 0  # beyond MAX_UNVERIFIED: a flood, counted, not kept

    def take(self, node_id: str, payload: bytes) -> None:
        if node_id in self.verified or len(payload) > MAX_REPLY_BYTES:
            return
        try:
            data = json.loads(payload)
        except ValueError:
            return
        if not isinstance(data, dict) or data.get("request_id") != self.verifier.request_id:
            return  # another command's reply, or junk: not addressed to this one
        try:
            self.verified[node_id] = self.verifier.check(node_id, data, time.time())
        except ReplyUnverified as err:
            if sum(map(len, self.unverified.values())) >= MAX_UNVERIFIED:
                self.unverified_more += 1
            else:
                self.unverified.setdefault(node_id, []).append(str(err))


async def _send(
    login: BrokerLogin,
    topics: Topics,
    target: str | None,
    payload: bytes,
    replies: Replies,
    timeout_s: float,
) -> set[str]:
    """Publish ``payload`` and gather ``replies``; the sites expected to answer."""
    expected = {target} if target else set()
    async with aiomqtt.Client(
        login.host,
        login.port,
        username=login.username,
        password=login.password,
        tls_context=login.tls,
        timeout=CONNECT_TIMEOUT_S,
    ) as client:
        # Retained presences arrive as the subscription is made, before any reply.
        await client.subscribe([(topics.presence_filter, 1), (topics.reply("+"), 1)])
        await client.publish(topics.control_mine if target else topics.control, payload, qos=1)
        try:
            async with asyncio.timeout(timeout_s):
                async for message in client.messages:
                    _take(topics, message, target, expected, replies)
                    if expected and expected <= replies.verified.keys():
                        break
        except TimeoutError:
            pass
    return expected


def _take(
    topics: Topics,
    message: aiomqtt.Message,
    target: str | None,
    expected: set[str],
    replies: Replies,
) -> None:
    topic = str(message.topic)
    node_id = topics.presence_of(topic)
    if node_id is not None:
        if target is None and message.retain and message.payload:
            expected.add(node_id)  # a site present when the command went out
        return
    if message.topic.matches(topics.reply("+")):
        replies.take(topic.rsplit("/", 1)[1], bytes(message.payload or b""))


def _control(args: argparse.Namespace) -> int:
    try:
        config = MqttConfig(
            broker=args.broker,
            topic_prefix=args.topic_prefix,
            username=args.username,
            password_file=args.password_file,
            tls=args.tls,
            ca=args.broker_ca,
        )
    except ValueError as err:
        raise GossipdError(f"gossipd control: {err}") from None
    login = BrokerLogin.from_config(config)
    topics = Topics(args.topic_prefix, args.mesh_id, args.node or ALL_NODES)
    request_id = uuid.uuid4().hex
    ca = mesh_ca(args)
    payload, claim = signed_payload(args, request_id)
    replies = Replies(
        ReplyVerifier(
            ca,
            mesh_id=claim.mesh_id,
            command=claim.command,
            request_id=request_id,
            nonce=claim.nonce,
        )
    )
    try:
        expected = asyncio.run(_send(login, topics, args.node, payload, replies, args.timeout_s))
    except aiomqtt.MqttError as err:
        raise GossipdError(
            f"MQTT broker {args.broker}: {err}; check that it runs and the login options"
        ) from None
    failed = 0
    for node_id in sorted(expected | replies.verified.keys() | replies.unverified.keys()):
        for why in replies.unverified.get(node_id, []):
            print(f"{node_id}: a reply was ignored, {why}")
        reply = replies.verified.get(node_id)
        if reply is None and node_id not in expected:
            continue  # only forgeries came on a topic no site expected holds
        if reply is None:
            failed += 1
            print(
                f"{node_id}: no verified reply within {args.timeout_s:g} s (is it connected "
                "to the broker?)"
            )
        elif reply.ok:
            print(f"{node_id}: ok: {reply.detail}")
        else:
            failed += 1
            print(f"{node_id}: REFUSED: {reply.detail}")
    if replies.unverified_more:
        print(f"{replies.unverified_more} more unverified replies ignored")
    if not expected and not replies.verified and not replies.unverified:
        print(f"no site has a presence on {topics.presence_filter} and none replied")
        return 1
    return 1 if failed else 0


def add_control_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "control",
        help="send a signed pause/resume/checkpoint/leave to sites over MQTT",
        description="Sign COMMAND with an operator certificate, publish it on the mesh's MQTT "
        "control topic and print every site's reply, believing only replies the site signed "
        "(checked against the mesh CA, --ca); exit 1 if a site refused or gave no such reply "
        "within --timeout-s.",
    )
    p.add_argument("command", metavar="COMMAND", choices=COMMANDS, help=", ".join(COMMANDS))
    p.add_argument("--broker", required=True, help="HOST:PORT of the mesh's MQTT broker")
    p.add_argument("--mesh-id", required=True, help="the mesh's id, as in the sites' configs")
    p.add_argument("--node", help="the one site to command (default: every site)")
    p.add_argument(
        "--cert",
        required=True,
        type=Path,
        help="operator certificate (gossipd certs issue NAME --operator --dir CA_DIR)",
    )
    p.add_argument("--key", required=True, type=Path, help="its private key")
    p.add_argument(
        "--ca",
        type=Path,
        help="the mesh CA certificate, which the sites' signed replies are checked against "
        "(default: ca.pem beside --cert)",
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="longest wait for the replies (default: %(default)s)",
    )
    p.add_argument(
        "--topic-prefix",
        default="gossipd",
        help="the sites' mqtt.topic_prefix (default: %(default)s)",
    )
    p.add_argument("--username", help="broker user name")
    p.add_argument("--password-file", type=Path, help="file whose first line is the password")
    p.add_argument("--tls", action="store_true", help="TLS to the broker with the system CAs")
    p.add_argument("--broker-ca", type=Path, help="CA certificate of the broker (implies TLS)")
    p.set_defaults(func=_control)
