"""Real MQTT brokers for tests (Mosquitto as a child process, amqtt in this process) and a
test's own MQTT client: subscribe-and-wait, publish, ask a node a command."""

from __future__ import annotations

import asyncio
import getpass
import json
import shutil
import socket
import subprocess
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiomqtt

from gossipd.node.launch.broker import EmbeddedBroker
from gossipd.node.launch.localmesh import free_ports, stop_process
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


def ask(
    port: int, mesh: str, node_id: str, command: str, *, to_all: bool = False
) -> dict[str, Any]:
    """Send ``command`` on the node's control topic (or the mesh's) and return its reply."""
    request_id = uuid.uuid4().hex
    topic = f"gossipd/{mesh}/control" + ("" if to_all else f"/{node_id}")
    body = json.dumps({"command": command, "request_id": request_id}).encode()
    reply = wait_message(
        port,
        f"gossipd/{mesh}/reply/{node_id}",
        lambda p: json.loads(p).get("request_id") == request_id,
        f"{node_id}'s reply to {command}",
        action=lambda: publish(port, topic, body),
    )
    return json.loads(reply)
