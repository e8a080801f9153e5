"""A daemon's life through its public surfaces: status CLI, metrics, SIGTERM, restart, join."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tests.conftest import scrape_metrics, wait_until


def _pair(daemons: Any, **config: Any) -> tuple[Any, Any]:
    ports = [next(daemons.ports), next(daemons.ports)]
    a = daemons("a", ports[0], seeds=[f"127.0.0.1:{ports[1]}"], **config)
    b = daemons("b", ports[1], seeds=[f"127.0.0.1:{ports[0]}"], **config)
    wait_until(
        lambda: a.status()["live_peers"] == ["b"] and b.status()["live_peers"] == ["a"],
        "a and b to see each other",
    )
    return a, b


def test_health_cli_says_serving_for_a_live_node_and_fails_for_a_closed_port(
    daemons: Any,
) -> None:
    from gossipd.node.launch.localmesh import free_ports

    node = daemons("a")

    def health(address: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gossipd.node.cli", "health", "--address", address],
            capture_output=True,
            text=True,
            timeout=60,
        )

    live = health(node.address)
    assert live.returncode == 0 and live.stdout.strip() == "SERVING", live.stderr
    closed = health(f"127.0.0.1:{free_ports(1)[0]}")
    assert closed.returncode == 2 and "no health answer" in closed.stderr


def test_status_cli_json_reports_identity_step_weights_and_checksum(daemons: Any) -> None:
    # Training stops after max_steps (the daemon keeps serving), so the step is known.
    max_steps = 7
    node = daemons("solo", job={"max_steps": max_steps})
    wait_until(lambda: node.status()["training_done"], "the solo node to finish training")
    assert node.status()["step"] == max_steps
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "gossipd.node.cli",
            "status",
            "--address",
            node.address,
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    status = json.loads(out.strip().splitlines()[-1])
    assert status["node_id"] == "solo" and status["mesh_id"] == "test-mesh"
    assert status["fingerprint"] == node.node_json()["fingerprint"]
    assert status["sum_weights"] == [1.0]
    assert status["live_peers"] == []
    assert status["params_checksum"] == node.status(checksum=True)["params_checksum"]
    assert len(status["params_checksum"]) == 32
    assert status["step"] == max_steps


def test_a_paced_trainer_steps_no_faster_than_its_rate(daemons: Any) -> None:
    rate, steps = 10.0, 40
    node = daemons("paced", job={"max_steps": steps, "max_steps_per_s": rate})
    asked = time.monotonic()
    seen = node.status()["step"]
    wait_until(lambda: node.status()["training_done"], "the paced node to finish", 60.0)
    # When the status was taken (after `asked`) step seen+1 had not ended, so step seen+2
    # started after `asked` and the last one (steps - seen - 2) / rate later at the
    # earliest. A lower bound only: a loaded machine makes steps slower, never faster.
    assert time.monotonic() - asked >= (steps - seen - 2) / rate
    assert seen < steps - 10 and node.status()["step"] == steps


def test_status_cli_names_the_address_when_nothing_listens() -> None:
    from gossipd.node.launch.localmesh import free_ports

    address = f"127.0.0.1:{free_ports(1)[0]}"
    proc = subprocess.run(
        [sys.executable, "-m", "gossipd.node.cli", "status", "--address", address],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert address in proc.stderr and "gossipd: error" in proc.stderr


def test_sigterm_hands_weight_off_checkpoints_exits_and_restart_resumes(daemons: Any) -> None:
    a, b = _pair(daemons, shutdown_timeout_s=10.0)
    before = a.status()
    a.proc.send_signal(signal.SIGTERM)
    assert a.proc.wait(timeout=30) == 0  # bounded: shutdown_timeout_s plus process exit
    wait_until(lambda: b.status()["sum_weights"] == [2.0], "b to hold all the weight")
    assert "handed weight to b" in a.log()
    ckpt = torch.load(a.data_dir / "checkpoint.pt", weights_only=True)
    assert ckpt["core"]["weights"] == [0.0]
    assert ckpt["core"]["protocol"] == "sumweight" and ckpt["core"]["in_flight"] == []
    summary = json.loads((a.data_dir / "summary.json").read_text())
    assert summary["sum_weights"] == [0.0]

    again = daemons("a", int(a.address.rsplit(":", 1)[1]), seeds=[b.address])
    resumed = again.status()
    assert resumed["sum_weights"] == [0.0]
    assert resumed["params_checksum"] == before["params_checksum"]  # lr 0: the model it left with
    assert resumed["step"] >= ckpt["step"]
    assert "resumed a from step" in again.log()
    wait_until(lambda: "b" in again.status()["live_peers"], "the restarted node to rejoin")
    # The step counter an operator graphs goes on from where the node left off.
    assert scrape_metrics(again.node_json()["metrics_port"])["gossipd_step"] >= ckpt["step"] > 0


def test_two_sites_leaving_at_once_hand_their_weight_to_the_one_that_stays(
    daemons: Any,
) -> None:
    """a and b get SIGTERM together. Whichever picks the other as its heir is answered
    without a merge (a leaving node takes nothing new): it must then hand off to c, not
    keep the weight (a bench whose sites stopped together left 0.72-1.27 on each, logged
    as 'handed weight to' the other leaver)."""
    ports = [next(daemons.ports) for _ in range(3)]
    # The heir order is a seeded shuffle of the live peers by id: with these gossip seeds
    # a tries b first and b tries a first, so each first asks the other leaver.
    seeds = {"a": 4, "b": 7, "c": 0}
    nodes = [
        daemons(
            name,
            ports[i],
            seeds=[f"127.0.0.1:{p}" for j, p in enumerate(ports) if j != i],
            shutdown_timeout_s=10.0,
            gossip={"seed": seed},
        )
        for i, (name, seed) in enumerate(seeds.items())
    ]
    a, b, c = nodes
    wait_until(lambda: all(len(n.status()["live_peers"]) == 2 for n in nodes), "all three in touch")
    for leaver in (a, b):
        leaver.proc.send_signal(signal.SIGTERM)
    assert a.proc.wait(timeout=30) == 0 and b.proc.wait(timeout=30) == 0
    for leaver in (a, b):
        ckpt = torch.load(leaver.data_dir / "checkpoint.pt", weights_only=True)
        assert ckpt["core"]["weights"] == [0.0], leaver.log()[-3000:]
    wait_until(lambda: c.status()["sum_weights"] == [3.0], "c to hold all the weight")


def test_joining_node_starts_at_weight_zero_with_a_pulled_model(daemons: Any) -> None:
    host = daemons("host")
    joiner = daemons("joiner", seeds=[host.address], join=True, job={"seed": 99})
    # Training starts only after the bootstrap pull, so a first step means it is done.
    wait_until(lambda: joiner.status()["step"] >= 1, "the joiner's first step")
    status = joiner.status()
    assert status["sum_weights"] == [0.0]
    assert status["params_checksum"] == host.status()["params_checksum"]
    assert "bootstrapped the model from host" in joiner.log()


def test_metrics_endpoint_exposes_core_metrics(daemons: Any) -> None:
    a, _ = _pair(daemons, gossip={"push_probability": 0.5}, metrics={"listen": "127.0.0.1:0"})
    port = a.node_json()["metrics_port"]

    wait_until(
        lambda: (
            scrape_metrics(port).get(
                'gossipd_gossip_messages_total{direction="sent",kind="push",result="ok"}', 0
            )
            > 0
        ),
        "an acknowledged push in the metrics",
    )
    m = scrape_metrics(port)
    assert m["gossipd_steps_total"] > 0
    assert m['gossipd_gossip_bytes_total{direction="sent",kind="push",result="ok"}'] > 0
    assert m["gossipd_live_peers"] == 1.0
    assert 'gossipd_sum_weight{segment="0"}' in m
    assert "gossipd_loss" in m
    assert m['gossipd_step_seconds_bucket{le="+Inf"}'] == m["gossipd_step_seconds_count"] > 0
    assert any(k.startswith("gossipd_node_info{") and 'protocol="sumweight"' in k for k in m)
    # 32 samples a step (the synthetic job's batch); the two counters are read one after
    # the other while the node steps, so allow a step between them.
    assert abs(m["gossipd_samples_total"] - 32 * m["gossipd_steps_total"]) <= 32
    assert m["gossipd_round"] > 0 and m["gossipd_membership_epoch"] > 0
    assert m["gossipd_push_seconds_count"] > 0
    assert m["gossipd_suspected_peers"] == 0.0


def test_merges_between_paced_steps_are_counted(daemons: Any) -> None:
    """gossipd_merges_total was fed from step reports only, so what a paced node merged
    while waiting out a step (most of its merges: its steps are short, its waits long)
    was never counted; nor what it merges before training starts or after it ends."""
    ports = [next(daemons.ports), next(daemons.ports)]
    common = {
        "gossip": {"push_probability": 1.0, "cpu_share": 1.0},  # paced: no budget to earn
        "metrics": {"listen": "127.0.0.1:0"},
    }
    a = daemons(
        "a",
        ports[0],
        seeds=[f"127.0.0.1:{ports[1]}"],
        job={"max_steps": 40, "max_steps_per_s": 20.0},
        **common,
    )
    b = daemons(
        "b",
        ports[1],
        seeds=[f"127.0.0.1:{ports[0]}"],
        job={"max_steps": 400, "max_steps_per_s": 100.0},
        **common,
    )
    for node in (a, b):
        wait_until(lambda n=node: n.status()["training_done"], f"{node.node_id} to finish", 60.0)
    wait_until(lambda: b.status()["pushes_in_flight"] == 0, "b's last push to settle", 30.0)
    status, m = a.status(), scrape_metrics(a.node_json()["metrics_port"])
    # sumweight pushes every segment: each merged push is that many merged segments
    merged_segments = status["pushes_merged"] * len(status["sum_weights"])
    assert m["gossipd_merges_total"] == merged_segments > 0


def test_pulled_segments_are_counted_as_merges_and_their_clips_as_clips() -> None:
    """A pulling protocol (overlap) merges only what it pulls: its merges, and the clip's
    pulls-in of them, were left out of gossipd_merges_total, gossipd_merges_clipped_total
    and summary.json, so a benchmark read 'nothing merged' off a node that merged every
    round."""
    from prometheus_client import generate_latest

    from gossipd.node.net.telemetry.metrics import NodeMetrics
    from gossipd.node.trainer.report import MergeRecord, PullRecord, StepReport

    metrics = NodeMetrics()
    report = StepReport(
        step=7,
        merged=[MergeRecord("a", 1, (0, 1), ())],
        pulled=[PullRecord("b", 3, (0, 1, 2), clipped_segments=(2,))],
    )
    metrics.record_merges(report)
    text = generate_latest(metrics.registry).decode()
    assert "gossipd_merges_total 5.0" in text
    assert "gossipd_merges_clipped_total 1.0" in text
    assert (metrics.merged_segments, metrics.clipped_segments) == (5, 1)


def test_stock_grpc_tools_work_health_checking_and_reflection(daemons: Any) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    node = daemons("tools")
    with grpc.insecure_channel(node.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "gossipd.v1.Gossip"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = ProtoReflectionDescriptorDatabase(channel)
        assert "gossipd.v1.Gossip" in reflection.get_services()
        methods = reflection.FindFileContainingSymbol("gossipd.v1.Gossip").service[0].method
        assert {m.name for m in methods} >= {
            "Handshake",
            "PushSegments",
            "PullModel",
            "Leave",
            "Peers",
            "Status",
        }


def test_training_failure_shuts_the_daemon_down_with_exit_code_1(tmp_path: Path) -> None:
    from gossipd.node.launch.processes import free_ports, spawn_node, stop_process
    from tests.conftest import write_config

    data_dir = tmp_path / "fragile"
    config = tmp_path / "fragile.toml"
    write_config(
        config,
        {
            "mesh_id": "test-mesh",
            "node_id": "fragile",
            "listen": f"127.0.0.1:{free_ports(1)[0]}",
            "data_dir": str(data_dir),
            "job": {"name": "tests.plugin_jobs:failing_job", "options": {"fail_at": 50}},
            "tls": {"insecure": True},
        },
    )
    proc = spawn_node(config, data_dir / "node.log")
    try:
        assert proc.wait(timeout=120) == 1
    finally:
        stop_process(proc)
    log = (data_dir / "node.log").read_text()
    assert "user code blew up at step 50" in log
    assert "gossipd: training failed" in log
    ckpt = torch.load(data_dir / "checkpoint.pt", weights_only=True)
    assert ckpt["step"] == 49  # the last completed step, saved on the way out


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    """Ports from the ephemeral range were taken by other processes' outgoing connections
    between the pick and the bind ("address already in use" in the suite)."""
    import socket

    from gossipd.node.launch.processes import EPHEMERAL_RANGE, free_ports

    ports = free_ports(8)
    assert len(set(ports)) == 8
    ephemeral_low = int(Path(EPHEMERAL_RANGE).read_text().split()[0])
    assert all(10_000 <= p < ephemeral_low for p in ports), (ports, ephemeral_low)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
