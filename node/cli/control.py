"""`gossipd control`: send one signed control command to a mesh's sites through its MQTT
broker and print each site's reply.

The command is signed with an operator certificate of the mesh CA (``gossipd certs issue
NAME --operator``) in the form of :mod:`gossipd.node.shared.control_signing`, published on
``control/NODE_ID`` (``--node``) or ``control`` (every site), and the replies on
``reply/+`` are awaited for at most ``--timeout-s``. Without ``--node``, the sites expected
to answer are those whose presence the broker holds when the command is sent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import time
import uuid
from pathlib import Path
from typing import Any

import aiomqtt

from gossipd.node.errors import GossipdError
from gossipd.node.net.mqtt import CONNECT_TIMEOUT_S, BrokerLogin
from gossipd.node.net.mqtt_messages import Topics
from gossipd.node.shared.cert_checks import operator_name_of
from gossipd.node.shared.cert_files import CertificateError, load_cert, load_key
from gossipd.node.shared.config import MqttConfig
from gossipd.node.shared.control_signing import (
    ALL_NODES,
    COMMANDS,
    ControlClaim,
    ControlRefused,
    sign,
)

DEFAULT_TIMEOUT_S = 15.0


def signed_payload(args: argparse.Namespace, request_id: str) -> bytes:
    """The command of ``args``, signed with its ``--cert`` and ``--key``."""
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
    return json.dumps(sign(claim, cert, key)).encode()


async def _send(
    login: BrokerLogin,
    topics: Topics,
    target: str | None,
    payload: bytes,
    request_id: str,
    timeout_s: float,
) -> tuple[set[str], dict[str, dict[str, Any]]]:
    """Publish ``payload`` and gather replies: (the sites expected, their replies by node)."""
    expected = {target} if target else set()
    replies: dict[str, dict[str, Any]] = {}
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
                    _take(topics, message, request_id, target, expected, replies)
                    if expected and expected <= replies.keys():
                        break
        except TimeoutError:
            pass
    return expected, replies


def _take(
    topics: Topics,
    message: aiomqtt.Message,
    request_id: str,
    target: str | None,
    expected: set[str],
    replies: dict[str, dict[str, Any]],
) -> None:
    topic = str(message.topic)
    node_id = topics.presence_of(topic)
    if node_id is not None:
        if target is None and message.retain and message.payload:
            expected.add(node_id)  # a site present when the command went out
        return
    if not message.topic.matches(topics.reply("+")):
        return
    try:
        reply = json.loads(bytes(message.payload or b""))
    except ValueError:
        return
    if isinstance(reply, dict) and reply.get("request_id") == request_id:
        replies[topic.rsplit("/", 1)[1]] = reply


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
    payload = signed_payload(args, request_id)
    try:
        expected, replies = asyncio.run(
            _send(login, topics, args.node, payload, request_id, args.timeout_s)
        )
    except aiomqtt.MqttError as err:
        raise GossipdError(
            f"MQTT broker {args.broker}: {err}; check that it runs and the login options"
        ) from None
    failed = 0
    for node_id in sorted(expected | replies.keys()):
        reply = replies.get(node_id)
        if reply is None:
            failed += 1
            print(
                f"{node_id}: no reply within {args.timeout_s:g} s (is it connected to the broker?)"
            )
        elif reply.get("ok") is True:
            print(f"{node_id}: ok: {reply.get('detail')}")
        else:
            failed += 1
            print(f"{node_id}: REFUSED: {reply.get('detail')}")
    if not expected and not replies:
        print(f"no site has a presence on {topics.presence_filter} and none replied")
        return 1
    return 1 if failed else 0


def add_control_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "control",
        help="send a signed pause/resume/checkpoint/leave to sites over MQTT",
        description="Sign COMMAND with an operator certificate, publish it on the mesh's MQTT "
        "control topic and print every site's reply; exit 1 if a site refused or did not "
        "answer within --timeout-s.",
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
