"""Real MQTT brokers for tests (Mosquitto as a child process, amqtt in this process) and a
test's own MQTT client: subscribe-and-wait, publish, ask a node a command signed by an
operator."""

from __future__ import annotations

import asyncio
import getpass
import json
import secrets
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiomqtt

from gossipd.node.launch.broker import EmbeddedBroker
from gossipd.node.launch.localmesh import free_ports, stop_process
from gossipd.node.shared.cert_files import load_cert, load_key
from gossipd.node.shared.control_signing import ALL_NODES, ControlClaim, sign
from tests.conftest import wait_until

# Debian installs the broker outside a normal user's PATH.
MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
MOSQUITTO_PASSWD = shutil.which("mosquitto_passwd") or "/usr/bin/mosquitto_passwd"
WAIT_S = 60.0


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextmanager
def mosquitto(
    directory: Path, port: int | None = None, *, users: dict[str, str] | None = None
) -> Iterator[int]:
    """Mosquitto on 127.0.0.1:``port`` (free if None), anonymous unless ``users`` are given
    (name -> password); yields the port, always stopped and reaped."""
    port = port or free_ports(1)[0]
    directory.mkdir(parents=True, exist_ok=True)
    # Started as root, mosquitto would switch to user mosquitto, who cannot read tmp_path.
    lines = [f"listener {port} 127.0.0.1", "persistence false", f"user {getpass.getuser()}"]
    if users:
        passwords = directory / "passwords"
        passwords.write_text("")
        for name, password in users.items():
            subprocess.run(
                [MOSQUITTO_PASSWD, "-b", str(passwords), name, password],
                check=True,
                capture_output=True,
                timeout=30,
            )
        lines += ["allow_anonymous false", f"password_file {passwords}"]
    else:
        lines.append("allow_anonymous true")
    conf = directory / "mosquitto.conf"
    conf.write_text("\n".join(lines) + "\n")
    with open(directory / "mosquitto.log", "ab") as log:
        proc = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT)
    try:

        def up() -> bool:
            if proc.poll() is not None:
                text = (directory / "mosquitto.log").read_text()
                raise AssertionError(f"mosquitto exited with {proc.returncode}:\n{text}")
            return _accepts(port)

        wait_until(up, f"mosquitto to listen on {port}", WAIT_S)
        yield port
    finally:
        stop_process(proc, 30.0)


@contextmanager
def amqtt_broker() -> Iterator[int]:
    """gossipd's embedded amqtt broker, on a thread of this process; yields its port."""
    with EmbeddedBroker() as broker:
        yield broker.port


@contextmanager
def broker(kind: str, directory: Path) -> Iterator[int]:
    if kind == "mosquitto":
        with mosquitto(directory / "mosquitto") as port:
            yield port
    else:
        with amqtt_broker() as port:
            yield port


def wait_message(
    port: int,
    topic: str,
    matches: Callable[[bytes], bool],
    what: str,
    *,
    action: Callable[[], None] = lambda: None,
    timeout_s: float = WAIT_S,
    **login: Any,
) -> bytes:
    """Subscribe to ``topic``, run ``action``, return the first payload that ``matches``."""

    async def run() -> bytes:
        async with aiomqtt.Client("127.0.0.1", port, **login) as client:
            await client.subscribe(topic, qos=1)
            await asyncio.to_thread(action)
            async with asyncio.timeout(timeout_s):
                async for message in client.messages:
                    payload = bytes(message.payload or b"")
                    # amqtt 0.12 also sends a new subscriber retained messages of other topics.
                    if message.topic.matches(topic) and matches(payload):
                        return payload
        raise AssertionError("unreachable")

    try:
        return asyncio.run(run())
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}") from None


def publish(port: int, topic: str, payload: bytes, *, retain: bool = False) -> None:
    async def run() -> None:
        async with aiomqtt.Client("127.0.0.1", port) as client:
            await client.publish(topic, payload, qos=1, retain=retain)

    asyncio.run(run())


def signed_command(
    signer: Path,
    mesh: str,
    target: str,
    command: str,
    *,
    issued_at: int | None = None,
    request_id: str | None = None,
) -> dict[str, Any]:
    """``command`` for ``target`` (a node id or ``*``), signed with ``signer`` (a .pem path;
    its key is the .key beside it), as gossipd control sends it."""
    claim = ControlClaim(
        mesh_id=mesh,
        target=target,
        command=command,
        request_id=request_id or uuid.uuid4().hex,
        issued_at=int(time.time()) if issued_at is None else issued_at,
        nonce=secrets.token_hex(16),
    )
    return sign(claim, load_cert(signer), load_key(signer.with_suffix(".key")))


def send_command(
    port: int, mesh: str, node_id: str, body: dict[str, Any], *, to_all: bool = False
) -> dict[str, Any]:
    """Publish ``body`` on the node's control topic (or the mesh's) and return its reply."""
    topic = f"gossipd/{mesh}/control" + ("" if to_all else f"/{node_id}")
    request_id = body["request_id"]
    reply = wait_message(
        port,
        f"gossipd/{mesh}/reply/{node_id}",
        lambda p: json.loads(p).get("request_id") == request_id,
        f"{node_id}'s reply to {body.get('command')!r} {request_id}",
        action=lambda: publish(port, topic, json.dumps(body).encode()),
    )
    return json.loads(reply)


def ask(
    port: int, mesh: str, node_id: str, command: str, signer: Path, *, to_all: bool = False
) -> dict[str, Any]:
    """Send ``command`` signed by the operator certificate ``signer``; return its reply."""
    body = signed_command(signer, mesh, ALL_NODES if to_all else node_id, command)
    return send_command(port, mesh, node_id, body, to_all=to_all)
