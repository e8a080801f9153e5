"""MQTT discovery and control against real brokers (Mosquitto, and the embedded amqtt).

Three daemons with mutual TLS and no seeds find each other only through the
broker's presence messages, gossip, answer control commands signed by an operator
(``gossipd control`` included), refuse and count commands nobody may give, shrug off
junk and forged presences, and one leaves on command: the mesh's Σw is checked at the
end. The tests of one broker share its mesh and run in file order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiomqtt
import pytest
from cryptography.hazmat.primitives import hashes

from gossipd.node.cli.main import main
from gossipd.node.launch.localmesh import free_ports
from gossipd.node.shared import certs
from gossipd.node.shared.cert_files import load_cert
from gossipd.node.shared.control_signing import ReplyClaim, ReplyVerifier, sign_reply
from gossipd.node.shared.tls import Credentials
from tests.conftest import (
    DaemonHandle,
    check_alive,
    scrape_metrics,
    start_daemon,
    status_of,
    stop_all,
    stop_in_turn,
    wait_counters_grow,
    wait_mesh_live,
    wait_until,
    write_config,
)
from tests.mqttbrokers import ask, broker, publish, send_command, signed_command, wait_message

MESH = "test-mesh"
NODES = ["a", "b", "c"]
LOST_OPERATOR = "lost-laptop"  # an operator certificate every node lists as revoked


class Mesh:
    def __init__(self, port: int, tls_dir: Path, handles: list[DaemonHandle]) -> None:
        self.port = port
        self.tls_dir = tls_dir
        self.operator = tls_dir / "operator.pem"  # an operator certificate of the mesh CA
        self.handles = handles
        self.by_id = {h.node_id: h for h in handles}

    def control(self, command: str, *args: str, cert: Path | None = None) -> int:
        """``gossipd control COMMAND`` against this mesh's broker, in this process."""
        cert = cert or self.operator
        return main(
            [
                "control",
                "--broker",
                f"127.0.0.1:{self.port}",
                "--mesh-id",
                MESH,
                "--cert",
                str(cert),
                "--key",
                str(cert.with_suffix(".key")),
                "--timeout-s",
                "60",
                *args,
                command,
            ]
        )


@pytest.fixture(scope="module", params=["mosquitto", "amqtt"])
def mesh(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    root = tmp_path_factory.mktemp(f"mqtt-{request.param}")
    tls_dir = root / "tls"
    certs.init_ca(tls_dir, mesh_id=MESH)
    for node_id in [*NODES, "tester", "mallory"]:
        certs.issue(node_id, tls_dir)
    certs.issue("operator", tls_dir, operator=True)
    # An operator certificate every node has revoked (mqtt.revoked_operators), by fingerprint
    lost, _ = certs.issue(LOST_OPERATOR, tls_dir, operator=True)
    revoked = [load_cert(lost).fingerprint(hashes.SHA256()).hex()]
    with broker(request.param, root) as port:
        ports = free_ports(len(NODES))

        def start(i: int) -> DaemonHandle:
            node_id = NODES[i]
            return start_daemon(
                root,
                node_id,
                ports[i],
                client_tls=_tls(tls_dir, "tester"),
                job={"seed": i},
                gossip={"seed": i, "push_probability": 0.5},
                tls={
                    "insecure": False,
                    "ca": str(tls_dir / certs.CA_CERT_FILE),
                    "cert": str(tls_dir / f"{node_id}.pem"),
                    "key": str(tls_dir / f"{node_id}.key"),
                },
                mqtt={
                    "broker": f"127.0.0.1:{port}",
                    "keepalive_s": 5,
                    "revoked_operators": revoked,
                },
            )

        handles: list[DaemonHandle] = []
        try:
            with ThreadPoolExecutor(len(NODES)) as pool:
                futures = [pool.submit(start, i) for i in range(len(NODES))]
                for future in futures:
                    with contextlib.suppress(Exception):
                        handles.append(future.result())
            assert len(handles) == len(NODES), [f.exception() for f in futures]
            yield Mesh(port, tls_dir, handles)
        finally:
            stop_all(handles)


def _tls(tls_dir: Path, node_id: str) -> Credentials:
    return Credentials(
        ca=tls_dir / certs.CA_CERT_FILE,
        cert=tls_dir / f"{node_id}.pem",
        key=tls_dir / f"{node_id}.key",
    )


def _metrics(handle: DaemonHandle) -> dict[str, float]:
    return scrape_metrics(handle.node_json()["metrics_port"])


def test_nodes_with_no_seeds_find_each_other_through_the_broker_and_gossip(mesh: Mesh) -> None:
    for h in mesh.handles:
        assert "seeds" not in h.config_path.read_text()
    wait_mesh_live(mesh.handles, 120.0)
    wait_counters_grow(mesh.handles, ("pushes_acked",), 5, "pushes acknowledged on every node")
    for h in mesh.handles:
        assert _metrics(h)["gossipd_mqtt_connected"] == 1.0
    presence = json.loads(
        wait_message(mesh.port, f"gossipd/{MESH}/presence/a", bool, "a's retained presence")
    )
    a = mesh.by_id["a"]
    assert presence["node_id"] == "a" and presence["address"] == a.address
    assert presence["mesh_id"] == MESH
    seen_by_b = {p["node_id"]: p["incarnation"] for p in status_of(mesh.by_id["b"])["peers"]}
    assert presence["incarnation"] == seen_by_b["a"]
    for h in mesh.handles:  # each presence was taken as it is: no claim refused
        assert "was said to be" not in h.log(), h.log()
    assert presence["fingerprint"] == certs.describe(a.data_dir.parent / "tls" / "a.pem")["sha256"]


def test_signed_pause_resume_and_checkpoint_take_effect_and_are_answered(
    mesh: Mesh, capsys: pytest.CaptureFixture[str]
) -> None:
    c, others = mesh.by_id["c"], [mesh.by_id["a"], mesh.by_id["b"]]
    assert mesh.control("pause", "--node", "c") == 0
    assert capsys.readouterr().out.startswith("c: ok: training pauses")
    paused_at = status_of(c)["step"]
    # The other nodes' steps are the clock: while they take 30 more, c takes at most
    # the one it was in when the command came.
    wait_counters_grow(others, ("step",), 30, "steps on the nodes not paused")
    assert status_of(c)["step"] <= paused_at + 1
    assert set(status_of(c)["live_peers"]) == {"a", "b"}  # still serving gossip
    # To every node: gossipd control waits for each site whose presence the broker holds.
    assert mesh.control("resume") == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "a: ok: training was not paused",
        "b: ok: training was not paused",
        "c: ok: training resumes",
    ], out
    wait_counters_grow([c], ("step",), 20, "steps on c after resume")
    assert "MQTT control: resume" in c.log() and "signed by operator 'operator'" in c.log()

    checkpoint = c.data_dir / "checkpoint.pt"
    assert not checkpoint.exists()  # checkpoint.every_steps = 0: only on command or at exit
    reply = ask(mesh.port, MESH, "c", "checkpoint", mesh.operator)
    assert reply["ok"] and reply["node_id"] == "c" and reply["command"] == "checkpoint", reply
    assert str(checkpoint) in reply["detail"], reply
    assert checkpoint.exists()


def _forge_replies(
    port: int, forge: Callable[[dict[str, Any]], list[tuple[str, dict[str, Any]]]]
) -> Future[None]:
    """A client of the broker that, at the first control command it sees, publishes the
    replies ``forge`` makes of it: (node id, reply) pairs. Anyone who may publish on the
    broker can do this; returns once it is subscribed."""
    subscribed = threading.Event()

    async def run() -> None:
        control = f"gossipd/{MESH}/control/#"
        async with aiomqtt.Client("127.0.0.1", port) as client:
            await client.subscribe(control, qos=1)
            subscribed.set()
            async with asyncio.timeout(60.0):
                async for message in client.messages:
                    if message.topic.matches(control):  # amqtt also sends retained others
                        for node_id, body in forge(json.loads(bytes(message.payload or b""))):
                            topic = f"gossipd/{MESH}/reply/{node_id}"
                            await client.publish(topic, json.dumps(body).encode(), qos=1)
                        return

    pool = ThreadPoolExecutor(1)
    future = pool.submit(asyncio.run, run())
    pool.shutdown(wait=False)
    if not subscribed.wait(30.0):
        why = future.exception() if future.done() else "no subscription within 30 s"
        raise AssertionError(f"the forger did not subscribe: {why}")
    return future


def _forged(command: dict[str, Any], node_id: str, signer: Path | None) -> dict[str, Any]:
    """An "ok" to ``command`` from ``node_id``, unsigned or signed by ``signer``."""
    claim = ReplyClaim(
        mesh_id=MESH,
        node_id=node_id,
        command=command["command"],
        request_id=command["request_id"],
        nonce=command["nonce"],
        ok=True,
        detail="training pauses",
    )
    if signer is None:
        return claim.payload()
    return sign_reply(claim, signer.read_bytes(), signer.with_suffix(".key").read_bytes())


def test_gossipd_control_believes_only_replies_the_site_signed_for_this_command(
    mesh: Mesh, capsys: pytest.CaptureFixture[str]
) -> None:
    """Anyone who can publish on the broker can write reply/NODE_ID. Forged replies, even
    one signed by a valid site certificate of this mesh (mallory's) or the operator's,
    must not tell the operator that a site obeyed: a site that never answers (ghost) is
    reported as not answering, and a site that refused (c, to a revoked operator) as
    refusing, whatever came first on its topic."""
    tls = mesh.tls_dir
    forger = _forge_replies(
        mesh.port,
        lambda cmd: [
            ("ghost", _forged(cmd, "ghost", None)),
            ("ghost", _forged(cmd, "ghost", tls / "mallory.pem")),
            ("ghost", _forged(cmd, "ghost", mesh.operator)),
        ],
    )
    # ghost never answers, so the command waits out its timeout: the forger answers within
    # milliseconds of seeing it, and 4 s leaves a loaded box room (10 s cost the suite 12).
    assert mesh.control("pause", "--node", "ghost", "--timeout-s", "4") == 1
    forger.result(30.0)
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "ghost: a reply was ignored, unverified (unsigned): it carries no signature (a site "
        "without TLS, tls.insecure, has no key to sign with, and one older than signed replies "
        "signs none), so anyone who can publish on the broker could have written it",
        "ghost: a reply was ignored, unverified (wrong_node): it came on 'ghost''s reply topic "
        "saying it is from 'ghost', signed by 'mallory''s certificate: one site cannot answer "
        "for another",
        "ghost: a reply was ignored, unverified (not_a_site): it is signed with 'CN=operator', "
        "which names no site (an operator's or the coordinator's certificate)",
        "ghost: no verified reply within 4 s (is it connected to the broker?)",
    ], out

    c = mesh.by_id["c"]
    forger = _forge_replies(mesh.port, lambda cmd: [("c", _forged(cmd, "c", None))])
    lost = tls / f"{LOST_OPERATOR}.pem"
    assert mesh.control("pause", "--node", "c", cert=lost) == 1
    forger.result(30.0)
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("c: REFUSED: refused (revoked)"), out
    wait_counters_grow([c], ("step",), 5, "steps on c: it was not paused")


class FakeListener:
    """A TCP port that accepts connections and counts them (and never speaks gossip)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()
        self.thread.join(10)


def test_a_forged_presence_for_another_nodes_id_never_makes_a_live_peer(mesh: Mesh) -> None:
    fake = FakeListener()
    try:
        forged = {
            "node_id": "b",
            "address": fake.address,
            "incarnation": 1,
            "fingerprint": None,
            "mesh_id": MESH,
            "version": "0.1.0",
        }
        # On b's own topic (b puts its own presence back) and as a retained presence
        # of a node that does not exist.
        publish(mesh.port, f"gossipd/{MESH}/presence/b", json.dumps(forged).encode())
        ghost = {**forged, "node_id": "ghost"}
        publish(
            mesh.port, f"gossipd/{MESH}/presence/ghost", json.dumps(ghost).encode(), retain=True
        )
        # a and c dial the forged address (the hint is taken) and the handshake fails.
        wait_until(lambda: fake.accepted >= 2, "a and c to dial the forged address", 60.0)
        wait_counters_grow(mesh.handles, ("pushes_acked",), 3, "gossip after the forgery")
        for h in mesh.handles:
            s = status_of(h)
            peers = {p["node_id"]: p["address"] for p in s["peers"]}
            assert "ghost" not in peers and "ghost" not in s["live_peers"]
            assert fake.address not in peers.values()
            for node_id, address in peers.items():
                assert address == mesh.by_id[node_id].address
            assert set(s["exchanged"]) <= set(NODES) - {h.node_id}  # nothing from others
    finally:
        publish(mesh.port, f"gossipd/{MESH}/presence/ghost", b"", retain=True)
        fake.close()


JUNK: list[tuple[str, bytes, str]] = [
    ("control", b"{not json", "bad_json"),
    ("control", json.dumps({"command": 7, "request_id": "x"}).encode(), "bad_field"),
    ("control/a", json.dumps({"command": "reboot", "request_id": "r"}).encode(), "unknown_command"),
    ("presence/zz", b"[1, 2]", "bad_json"),
    ("presence/zz", b"x" * 5000, "oversize"),
    (
        "presence/zz",
        json.dumps(
            {"node_id": "zz", "address": "127.0.0.1:1", "mesh_id": "other", "version": "1"}
        ).encode(),
        "wrong_mesh",
    ),
    (
        "presence/zz",
        json.dumps({"node_id": "yy", "address": "127.0.0.1:1", "mesh_id": MESH}).encode(),
        "topic_mismatch",
    ),
]


def test_junk_on_the_topics_is_counted_and_the_node_keeps_working(mesh: Mesh) -> None:
    a = mesh.by_id["a"]
    before = _metrics(a)
    reasons = sorted({reason for _, _, reason in JUNK})
    for topic, payload, _ in JUNK:
        publish(mesh.port, f"gossipd/{MESH}/{topic}", payload)
    reply = ask(mesh.port, MESH, "a", "resume", mesh.operator)  # after the junk, in order
    assert reply["ok"], reply

    def counted() -> bool:
        now = _metrics(a)
        return all(
            now.get(f'gossipd_mqtt_rejected_total{{reason="{r}"}}', 0)
            - before.get(f'gossipd_mqtt_rejected_total{{reason="{r}"}}', 0)
            >= sum(1 for _, _, reason in JUNK if reason == r)
            for r in reasons
        )

    wait_until(counted, "each kind of junk counted on a", 30.0, lambda: check_alive(mesh.handles))
    assert "refused a request from MQTT" in a.log()
    wait_counters_grow(mesh.handles, ("step", "pushes_acked"), 3, "training and gossip after junk")


def test_commands_no_operator_of_this_mesh_signed_for_this_node_now_are_refused_and_counted(
    mesh: Mesh, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = mesh.by_id["a"]
    before = _metrics(a)
    altered = signed_command(mesh.operator, MESH, "a", "resume")
    refused: list[tuple[str, dict[str, Any]]] = [
        ("unsigned", {"command": "pause", "request_id": "unsigned-1"}),
        ("bad_signature", {**altered, "command": "pause"}),
        ("not_operator", signed_command(mesh.tls_dir / "tester.pem", MESH, "a", "pause")),
        ("wrong_mesh", signed_command(mesh.operator, "other-mesh", "a", "pause")),
        ("wrong_node", signed_command(mesh.operator, MESH, "b", "pause")),
        (
            "stale",
            signed_command(mesh.operator, MESH, "a", "pause", issued_at=int(time.time()) - 3600),
        ),
        ("revoked", signed_command(mesh.tls_dir / f"{LOST_OPERATOR}.pem", MESH, "a", "pause")),
    ]
    # Each would pause a if it were obeyed; every one is answered "ok": false with its reason.
    for reason, body in refused:
        reply = send_command(mesh.port, MESH, "a", body)
        assert reply["ok"] is False and f"refused ({reason})" in reply["detail"], (reason, reply)
    once = signed_command(mesh.operator, MESH, "a", "resume")
    assert send_command(mesh.port, MESH, "a", once)["ok"]
    reply = send_command(mesh.port, MESH, "a", once)
    assert reply["ok"] is False and "refused (replay)" in reply["detail"], reply
    # Signed by an operator of another CA, through gossipd control: a refusal exits 1.
    other = tmp_path / "other-ca"
    certs.init_ca(other, mesh_id=MESH)
    foreign, _ = certs.issue("operator", other, operator=True)
    ca = str(mesh.tls_dir / certs.CA_CERT_FILE)  # the CA beside it is the other one
    assert mesh.control("pause", "--node", "a", "--ca", ca, cert=foreign) == 1
    assert capsys.readouterr().out.startswith("a: REFUSED: refused (other_ca)")

    reasons = [r for r, _ in refused] + ["replay", "other_ca"]
    now = _metrics(a)
    for reason in reasons:
        key = f'gossipd_mqtt_control_refused_total{{reason="{reason}"}}'
        assert now.get(key, 0) - before.get(key, 0) == 1, (reason, now.get(key))
    assert "refused a request from MQTT control: pause (request 'unsigned-1')" in a.log()
    assert "gossipd certs issue NAME --operator" in a.log()  # the fix, in the log
    wait_counters_grow([a], ("step",), 5, "steps on a after the refused pauses")


def test_an_operator_revoked_on_sighup_is_refused_from_the_next_command(mesh: Mesh) -> None:
    """A lost operator key must stop working without restarting the sites: SIGHUP reads
    mqtt.revoked_operators again, as it reads [tls]; a site whose own certificate was
    rotated by the same SIGHUP signs its replies with the new one."""
    a = mesh.by_id["a"]
    bob, _ = certs.issue(f"bob-{mesh.port}", mesh.tls_dir, operator=True)
    first = send_command(mesh.port, MESH, "a", signed_command(bob, MESH, "a", "resume"))
    assert first["ok"], first
    config = tomllib.loads(a.config_path.read_text())
    fingerprint = load_cert(bob).fingerprint(hashes.SHA256()).hex()
    config["mqtt"]["revoked_operators"] = [*config["mqtt"]["revoked_operators"], fingerprint]
    write_config(a.config_path, config)
    renewed, _ = certs.issue("a", mesh.tls_dir, renew=True)
    a.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "operator certificate(s) revoked" in a.log(), "a to reload", 30.0)
    reply = send_command(mesh.port, MESH, "a", signed_command(bob, MESH, "a", "resume"))
    assert reply["ok"] is False and "refused (revoked)" in reply["detail"], reply
    command = signed_command(mesh.operator, MESH, "a", "resume")
    again = send_command(mesh.port, MESH, "a", command)
    assert again["ok"], again  # the other operators still speak
    assert again["cert"] == renewed.read_text()
    verifier = ReplyVerifier(
        load_cert(mesh.tls_dir / certs.CA_CERT_FILE),
        mesh_id=MESH,
        command="resume",
        request_id=command["request_id"],
        nonce=command["nonce"],
    )
    assert verifier.check("a", again, time.time()).ok


def test_leave_on_command_hands_the_weight_off_and_the_mesh_keeps_its_sum(mesh: Mesh) -> None:
    b = mesh.by_id["b"]
    replies: list[dict[str, Any]] = []
    # Subscribed before the leave: a cleared retained message is not sent to later subscribers.
    wait_message(
        mesh.port,
        f"gossipd/{MESH}/presence/b",
        lambda p: p == b"",
        "b's presence cleared as it leaves",
        action=lambda: replies.append(ask(mesh.port, MESH, "b", "leave", mesh.operator)),
    )
    assert replies[0]["ok"] and replies[0]["command"] == "leave", replies
    assert b.proc.wait(timeout=60) == 0, b.log()[-3000:]
    left = json.loads((b.data_dir / "summary.json").read_text())["sum_weights"]
    assert sum(left) == pytest.approx(0.0, abs=1e-9), b.log()[-3000:]  # all to a or c
    rest = [mesh.by_id["a"], mesh.by_id["c"]]
    wait_until(lambda: all("b" not in status_of(h)["live_peers"] for h in rest), "b gone", 60.0)
    weights = stop_in_turn(rest)
    segments = len(weights[0])
    totals = [sum(w[i] for w in [*weights, left]) for i in range(segments)]
    assert totals == pytest.approx([3.0] * segments, abs=1e-6)
