"""MQTT discovery and control: a task on the daemon's event loop, beside gossip, never in its way.

While connected, the node keeps a retained presence message on
``PREFIX/MESH_ID/presence/NODE_ID`` (cleared by its last will if it dies, and by
itself when it leaves), turns other nodes' presences into candidates for
:class:`~gossipd.node.net.peers.peering.Peering` (dialled and proved by this node's own
mTLS handshake, like any relayed address: a presence names no identity), and
answers control commands (:mod:`gossipd.node.net.peers.mqtt_messages`), obeying only those an
operator certificate of the mesh CA signed (:mod:`gossipd.node.shared.control_signing`)
unless ``mqtt.control_requires_signature`` is false.

An empty presence (a will or a leave) removes nothing: whether a peer is alive
is decided by this node's own handshakes and pushes, as for every peer. Only an
empty presence on this node's *own* topic is acted on: it is put back, since a
previous incarnation's will may clear it after this one published it.

The broker is optional at every moment: the daemon starts, trains and gossips
without it; a lost connection is retried with capped exponential backoff.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from importlib import metadata
from typing import TYPE_CHECKING, Protocol

import aiomqtt

from gossipd.node.errors import GossipdError
from gossipd.node.net.peers.mqtt_login import BrokerLogin
from gossipd.node.net.peers.mqtt_messages import (
    Command,
    Junk,
    Presence,
    Topics,
    parse_command,
    parse_presence,
)
from gossipd.node.net.telemetry.metrics import NodeMetrics
from gossipd.node.shared import certs
from gossipd.node.shared.cert_files import load_cert
from gossipd.node.shared.config import NodeConfig
from gossipd.node.shared.control_signing import (
    MAX_DETAIL_CHARS,
    ControlRefused,
    ControlVerifier,
    ReplyClaim,
    sign_reply,
)
from gossipd.node.shared.rejections import RejectionLog

if TYPE_CHECKING:
    from gossipd.node.shared.tls import Material  # its grpc stays out of gossipd certs

log = logging.getLogger(__name__)
FIRST_RETRY_S = 0.5
CONNECT_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 2.0
QUEUED_MESSAGES = 1024  # beyond this, messages arriving faster than handled are dropped


class Controls(Protocol):
    """What the control commands do on a running site; each returns the reply's detail or
    raises GossipdError."""

    def pause(self) -> str: ...
    def resume(self) -> str: ...
    async def checkpoint(self) -> str: ...
    def leave(self) -> str: ...


class Presences(Protocol):
    """Where another node's presence goes: peering, which takes it as a candidate."""

    def heard_presence(self, node_id: str, address: str, incarnation: int) -> None: ...


class MqttAgent:
    def __init__(
        self,
        config: NodeConfig,
        *,
        address: str,
        incarnation: int,
        peers: Presences,
        controls: Controls,
        metrics: NodeMetrics,
        material: Callable[[], Material | None],
    ) -> None:
        """``peers`` takes another node's presence as a candidate; ``address`` and
        ``incarnation`` are this node's, as its handshake gives them; ``material`` its TLS
        certificate and key as they are now (SIGHUP may rotate them), which sign its
        replies (None in plaintext: replies go unsigned)."""
        assert config.mqtt is not None
        self.config = config.mqtt
        self.login = BrokerLogin.from_config(config.mqtt)
        self.topics = Topics(config.mqtt.topic_prefix, config.mesh_id, config.node_id)
        fingerprint = None
        if not config.tls.insecure:
            assert config.tls.cert is not None, "a site with TLS names its certificate"
            fingerprint = certs.describe(config.tls.cert)["sha256"]
        self.me = Presence(
            config.node_id, address, incarnation, fingerprint, config.mesh_id, _version()
        )
        self.peers = peers
        self.controls = controls
        self.metrics = metrics
        self.material = material
        self.verifier = _control_verifier(config)
        self.rejections = RejectionLog(config.limits.rejection_log_interval_s)
        self.rng = random.Random(config.gossip.seed ^ 0x3A77)
        self.client: aiomqtt.Client | None = None
        self.task: asyncio.Task[None] | None = None
        self.failures = 0  # attempts in a row that did not reach the broker
        self._republish: asyncio.Future[None] | None = None  # a new address's presence
        self._closing = False
        metrics.mqtt_connected.set(0)

    def start(self) -> asyncio.Task[None]:
        self.task = asyncio.create_task(self.run(), name="mqtt")
        return self.task

    def revoke(self, fingerprints: Sequence[str]) -> None:
        """SIGHUP: ``mqtt.revoked_operators`` as the config says now (a lost operator key
        is refused from the next command on, without a restart)."""
        if self.verifier is None:
            return
        before, self.verifier.revoked = self.verifier.revoked, frozenset(fingerprints)
        if self.verifier.revoked != before:
            log.info(
                "SIGHUP: %d operator certificate(s) revoked (mqtt.revoked_operators); "
                "commands they sign are refused from now on",
                len(self.verifier.revoked),
            )

    async def run(self) -> None:
        """Connect, serve, and on any loss of the broker wait (capped, doubling) and again."""
        delay = FIRST_RETRY_S
        while True:
            served = False
            try:
                async with self._new_client() as client:
                    served = True
                    await self._serve(client)
            except aiomqtt.MqttError as err:
                self._lost(err)
            finally:
                self.client = None
                self.metrics.mqtt_connected.set(0)
            if served:  # it was reached: a new outage starts from the shortest wait
                delay = FIRST_RETRY_S
            await asyncio.sleep(delay * self.rng.uniform(0.5, 1.0))
            delay = min(delay * 2, self.config.reconnect_max_s)

    def _new_client(self) -> aiomqtt.Client:
        login = self.login
        return aiomqtt.Client(
            login.host,
            login.port,
            username=login.username,
            password=login.password,
            tls_context=login.tls,
            keepalive=login.keepalive_s,
            timeout=CONNECT_TIMEOUT_S,
            # One session per incarnation: a restart never takes over (and then loses)
            # the old one's will; the old will is answered by republishing (below).
            identifier=f"gossipd-{self.topics.node_id}-{self.rng.getrandbits(48):012x}",
            will=aiomqtt.Will(self.topics.presence(), b"", qos=1, retain=True),
            max_queued_incoming_messages=QUEUED_MESSAGES,
        )

    async def _serve(self, client: aiomqtt.Client) -> None:
        await client.publish(self.topics.presence(), self.me.payload(), qos=1, retain=True)
        await client.subscribe(
            [
                (self.topics.presence_filter, 1),
                (self.topics.control, 1),
                (self.topics.control_mine, 1),
            ]
        )
        self.client = client
        self.metrics.mqtt_connected.set(1)
        if self.failures:
            log.info(
                "reached the MQTT broker %s again after %d failed attempts",
                self.config.broker,
                self.failures,
            )
        else:
            log.info(
                "connected to the MQTT broker %s; presence on %s",
                self.config.broker,
                self.topics.presence(),
            )
        self.failures = 0
        async for message in client.messages:
            await self.on_message(client, str(message.topic), bytes(message.payload or b""))

    def _lost(self, err: Exception) -> None:
        self.failures += 1
        if self.failures == 1:
            log.warning(
                "MQTT broker %s: %s; training and gossip go on without it (peers from "
                "seeds and anti-entropy only), retrying with backoff up to %.0f s "
                "(mqtt.reconnect_max_s). Check that the broker runs, that mqtt.broker names "
                "it, and the credentials in [mqtt]",
                self.config.broker,
                err,
                self.config.reconnect_max_s,
            )
        else:
            log.debug(
                "MQTT broker %s still unreachable (%d tries): %s",
                self.config.broker,
                self.failures,
                err,
            )

    def readvertise(self, address: str) -> None:
        """This node is reached at ``address`` from now on (an outbound-only site's relays
        changed): its retained presence says so, now if connected, else on connecting."""
        self.me = replace(self.me, address=address)
        if self.client is not None and not self._closing:
            self._republish = asyncio.ensure_future(self._publish_presence(self.client))

    async def _publish_presence(self, client: aiomqtt.Client) -> None:
        try:
            await client.publish(self.topics.presence(), self.me.payload(), qos=1, retain=True)
        except aiomqtt.MqttError as err:  # the connection is lost: the next one publishes it
            log.debug("could not publish the new presence yet: %s", err)

    # -- messages -----------------------------------------------------------------------
    async def on_message(self, client: aiomqtt.Client, topic: str, payload: bytes) -> None:
        try:
            node_id = self.topics.presence_of(topic)
            if node_id is not None:
                await self._on_presence(client, node_id, payload)
            elif topic in (self.topics.control, self.topics.control_mine):
                await self._on_command(client, parse_command(payload))
        except Junk as junk:
            self.metrics.mqtt_rejected.labels(junk.reason).inc()
            self.rejections.record("MQTT", junk.reason, f"{topic}: {junk}")
            if junk.request_id is not None:
                await self._reply(client, Command("?", junk.request_id), ok=False, detail=str(junk))

    async def _on_presence(self, client: aiomqtt.Client, node_id: str, payload: bytes) -> None:
        presence = parse_presence(self.topics, node_id, payload)
        if node_id == self.topics.node_id:
            if presence is None and not self._closing:
                # A previous incarnation's will (or someone) cleared ours: put it back.
                await client.publish(self.topics.presence(), self.me.payload(), qos=1, retain=True)
            return
        if presence is not None:
            self.peers.heard_presence(presence.node_id, presence.address, presence.incarnation)

    async def _on_command(self, client: aiomqtt.Client, command: Command) -> None:
        signer = "unsigned (mqtt.control_requires_signature = false)"
        if self.verifier is not None:
            try:
                signer = f"signed by operator {self.verifier.check(command.body, time.time())!r}"
            except ControlRefused as refused:
                self.metrics.mqtt_control_refused.labels(refused.reason).inc()
                self.rejections.record(
                    "MQTT control",
                    f"control:{refused.reason}",
                    f"{command.command} (request {command.request_id!r}): {refused}",
                )
                await self._reply(client, command, ok=False, detail=str(refused))
                return
        log.info("MQTT control: %s (request %r), %s", command.command, command.request_id, signer)
        try:
            detail = await self._run(command.command)
        except GossipdError as err:
            await self._reply(client, command, ok=False, detail=str(err))
            return
        await self._reply(client, command, ok=True, detail=detail)

    async def _run(self, command: str) -> str:
        if command == "checkpoint":
            return await self.controls.checkpoint()
        if command == "pause":
            return self.controls.pause()
        if command == "resume":
            return self.controls.resume()
        return self.controls.leave()

    async def _reply(
        self, client: aiomqtt.Client, command: Command, *, ok: bool, detail: str
    ) -> None:
        """Answer on ``reply/NODE_ID``, signed with this node's TLS key over the command's
        request id and nonce, so nobody else on the broker can answer for it."""
        nonce = command.body.get("nonce")
        claim = ReplyClaim(
            mesh_id=self.topics.mesh_id,
            node_id=self.topics.node_id,
            command=command.command,
            request_id=command.request_id,
            nonce=nonce if isinstance(nonce, str) and nonce.isprintable() else "",
            ok=ok,
            detail=detail[:MAX_DETAIL_CHARS],
        )
        mine = self.material()
        body = claim.payload() if mine is None else sign_reply(claim, mine.cert, mine.key)
        await client.publish(self.topics.reply(), json.dumps(body).encode(), qos=1)

    # -- leaving ------------------------------------------------------------------------
    async def close(self) -> None:
        """Clear this node's presence (bounded), then end the task: a graceful leave."""
        self._closing = True
        client = self.client
        if client is not None:
            try:
                await asyncio.wait_for(
                    client.publish(self.topics.presence(), b"", qos=1, retain=True), CLOSE_TIMEOUT_S
                )
            except (aiomqtt.MqttError, TimeoutError) as err:
                log.info("could not clear the MQTT presence (its last will will): %s", err)
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


def _control_verifier(config: NodeConfig) -> ControlVerifier | None:
    """The checks on control commands (None: obeyed unsigned), said once at start."""
    assert config.mqtt is not None
    if not config.mqtt.control_requires_signature:
        log.warning(
            "mqtt.control_requires_signature = false: control commands are obeyed unsigned, "
            "so anyone who can publish on the broker's control topics can pause or stop this "
            "node; issue operator certificates (gossipd certs issue NAME --operator) and "
            "remove the setting"
        )
        return None
    window_s = config.mqtt.control_window_s
    if config.tls.insecure:
        log.info(
            "MQTT control commands will be refused: without TLS this node has no mesh CA to "
            "check their signatures against (set mqtt.control_requires_signature = false to "
            "obey unsigned ones)"
        )
        ca = None
    else:
        assert config.tls.ca is not None
        ca = load_cert(config.tls.ca)
    return ControlVerifier(
        ca,
        mesh_id=config.mesh_id,
        node_id=config.node_id,
        window_s=window_s,
        revoked=config.mqtt.revoked_operators,
    )


def _version() -> str:
    try:
        return metadata.version("gossipd")
    except metadata.PackageNotFoundError:
        return "unknown"
