"""Pulls in the daemon: a core that pulls every round, over real gRPC between two nodes.

The daemon used to raise on the first ``Pull`` a core returned, while the simulator
carried pulls out: a pull-based protocol would have passed its simulator tests and
failed on its first real pull. These tests drive the test-only core in
``tests/pullcore.py`` through the daemon's own driver (``GossipNode``: the replica
and the network, real sockets) and through the simulator.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from gossipd.node.errors import GossipdError
from gossipd.node.jobs.registry import JobSpec, build_job
from gossipd.node.launch.localmesh import free_ports
from gossipd.node.net.wire.frames import ReceivedSegment
from gossipd.node.protocols import PROTOCOLS
from gossipd.node.site.api import GossipNode
from gossipd.node.trainer.messages import InboundPush
from gossipd.node.trainer.replica import Replica
from tests.pullcore import NAME, PullEveryRound

DEADLINE_S = 60.0
NUMEL = 1000


@pytest.fixture
def pull_protocol(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, float]]:
    """Registers the test-only core; its settings are what the test puts in the dict."""
    settings: dict[str, float] = {}
    monkeypatch.setitem(
        PROTOCOLS,
        NAME,
        lambda s: PullEveryRound(s.node_id, s.num_segments, **settings),  # type: ignore[arg-type]
    )
    yield settings


def _model(value: float) -> torch.nn.Module:
    """Four tensors of 1000 bytes: four segments of ``segment_bytes = 1024``."""
    model = torch.nn.Module()
    model.parts = torch.nn.ParameterList(
        torch.nn.Parameter(torch.full((NUMEL // 4,), value)) for _ in range(4)
    )
    return model


def _pair(**gossip: Any) -> tuple[GossipNode, GossipNode]:
    ports = free_ports(2)
    nodes = []
    for i, (port, value) in enumerate(zip(ports, (0.0, 8.0), strict=True)):
        config = {
            "mesh_id": "pull-mesh",
            "node_id": f"n{i}",
            "listen": f"127.0.0.1:{port}",
            "seeds": [f"127.0.0.1:{p}" for p in ports if p != port],
            "gossip": {"protocol": NAME, "segment_bytes": 1024, **gossip},
            "metrics": {"listen": None},
            "tls": {"insecure": True},
            "shutdown_timeout_s": 5.0,
        }
        nodes.append(GossipNode(config, _model(value)))
    for node in nodes:
        assert node.wait_for_peers(1, DEADLINE_S)
    return nodes[0], nodes[1]


def _step_both(nodes: tuple[GossipNode, ...], done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        for node in nodes:
            node.step()
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)  # stand-in for a training step's compute


def _core(node: GossipNode) -> PullEveryRound:
    core = node.replica.core
    assert isinstance(core, PullEveryRound)
    return core


def test_a_pulling_core_averages_with_pulled_models_through_the_daemon(
    pull_protocol: dict[str, float],
) -> None:
    a, b = _pair()
    with a, b:
        _step_both((a, b), lambda: min(len(_core(a).merged), len(_core(b).merged)) >= 6, "pulls")
        spread = max(
            (x - y).abs().max().item()
            for x, y in zip(a.replica.flat.buffers, b.replica.flat.buffers, strict=True)
        )
        segments = len(a.replica.flat.plan)
        arrival = _core(a).merged[0]
    assert segments > 1, "the model must span several segments"
    assert sorted(arrival.weights) == list(range(segments))
    assert arrival.nbytes == NUMEL * 4 and arrival.transfer_s > 0
    # Both started 8 apart; each merge halves the gap or better: after 6 rounds it is tiny.
    assert spread < 8 / 2**3, spread
    assert not _core(a).failed and not _core(b).failed


@pytest.mark.parametrize("via_timer", [False, True], ids=["pull at_s", "timer"])
def test_a_pull_starts_at_its_time_while_the_trainer_is_inside_a_long_step(
    pull_protocol: dict[str, float], via_timer: bool
) -> None:
    """The core asks for a pull 0.2 s after its step (or for a timer then, which asks for
    the pull); the trainer then holds its lock (a long step). The timer fires and the peer
    serves the pull meanwhile; the merge waits for the step boundary."""
    pull_protocol.update(delay_s=0.2, round_steps=1_000_000, via_timer=via_timer)
    a, b = _pair()
    with a, b:
        a.replica.steps = 999_999  # only the pull of step 1_000_000
        labels = {"direction": "sent", "kind": "pull", "result": "ok"}

        def served() -> float:
            value = b.network.metrics.registry.get_sample_value(
                "gossipd_gossip_messages_total", labels
            )
            return value or 0.0

        with a.lock:  # the trainer is inside a step from here on
            report = a.step()  # step 1_000_000 ends: the core asks for its pull or timer
            asked_at = a.replica.clock()
            assert _core(a).pulling is not None and not report.pulled
            deadline = time.monotonic() + DEADLINE_S
            while served() < 1:
                assert time.monotonic() < deadline, "the pull did not start during the step"
                time.sleep(0.01)
            assert not _core(a).merged, "merged outside a step boundary"
        _step_both((a,), lambda: bool(_core(a).merged), "the merge at a step boundary")
    if via_timer:
        [fired_at] = _core(a).timer_fired_at
        assert fired_at >= asked_at + 0.2 - 0.05  # at its time, not at an earlier boundary
    assert all(torch.all(x == 4.0) for x in a.replica.flat.buffers)  # (0 + 8) / 2


def test_a_pull_from_a_peer_that_went_away_reaches_the_core_as_failed(
    pull_protocol: dict[str, float],
) -> None:
    a, b = _pair()
    with a:
        b.closed = True
        b._stop_loop()  # gone without a Leave: its server closed, a still thinks it is live
        _step_both((a,), lambda: bool(_core(a).failed), "a failed pull")
        failure = _core(a).failed[0]
        assert all(torch.all(x == 0.0) for x in a.replica.flat.buffers), "a failed pull merged"
    assert failure.peer == "n1" and failure.error


def test_the_server_refuses_a_pull_of_segments_it_does_not_have(
    pull_protocol: dict[str, float],
) -> None:
    import asyncio

    a, b = _pair()
    with a, b:
        client = asyncio.run_coroutine_threadsafe(_client(a, b), a._loop).result(30)
        with pytest.raises(GossipdError, match=r"each must be in 0\.\.\d+, once"):
            asyncio.run_coroutine_threadsafe(
                client.pull(a.replica.flat.plan, a.network.limits, 10.0, segments=[0, 99]),
                a._loop,
            ).result(30)


async def _client(a: GossipNode, b: GossipNode) -> Any:
    return a.network.channels.client(b.address, "n1")


def test_the_simulator_carries_out_the_same_core_s_pulls(pull_protocol: dict[str, float]) -> None:
    """The same core in the simulator: every pull arrives with its bytes and a transfer
    time of latency plus bytes over bandwidth, and averaging drives the nodes together."""
    from gossipd.node.sim import SimSpec, Simulation

    simulation = Simulation(SimSpec(protocol=NAME, nodes=4, rounds=8, predict=False))
    result = simulation.run()
    cores = [node.core for node in simulation.nodes]
    assert all(isinstance(c, PullEveryRound) and len(c.merged) >= 4 for c in cores)
    assert all(a.nbytes > 0 and a.transfer_s > 0 for c in cores for a in c.merged)  # type: ignore[union-attr]
    assert result.consensus_error_end < result.consensus_error_start / 4


def test_a_core_without_sum_weights_has_status_metrics_and_checkpoints(
    pull_protocol: dict[str, float], tmp_path: Any
) -> None:
    """Status, metrics and checkpoints read sum-weights only where a core keeps them."""
    import asyncio

    from gossipd.node.net.status.query import query_status
    from gossipd.node.trainer import checkpoint

    a, b = _pair()
    with a, b:
        _step_both((a, b), lambda: bool(_core(a).merged), "a pull")
        status = asyncio.run(query_status(a.address, 10.0))
        saved = checkpoint.load(a.save_checkpoint(tmp_path), fingerprint=a.replica.fingerprint)
        samples = a.network.metrics.registry.get_sample_value("gossipd_round")
    assert status["protocol"] == NAME and status["sum_weights"] == []
    assert status["reserved_weights"] == [] and status["pushes_in_flight"] in (0, 1)
    assert saved.weights == [] and saved.core["protocol"] == NAME
    assert samples is not None and samples >= 1
    assert a.sum_weights == []


def test_an_idle_trainer_waits_for_a_push_without_holding_the_replica_lock() -> None:
    """A pull's snapshot (and a status) takes the replica's lock. The idle trainer used to
    hold it through its whole wait for a push, so every pull of an idle node (training
    ended, or not yet started) waited out the 50 ms idle tick. The push that ends the
    wait is merged at once, and counted as pending until it is."""
    job = build_job(JobSpec("synthetic", seed=3, learning_rate=0.0))
    replica = Replica("r", job.model, segment_bytes=4 << 20)
    waiting = threading.Event()
    wait = replica.inbox.wait

    def announced_wait(timeout_s: float) -> None:
        waiting.set()
        wait(timeout_s)

    replica.inbox.wait = announced_wait  # type: ignore[method-assign]
    idle = threading.Thread(target=replica.idle, args=(DEADLINE_S,))
    idle.start()
    try:
        assert waiting.wait(DEADLINE_S), "the idle trainer never waited for a push"
        locked = threading.Event()

        def take_lock() -> None:
            with replica.lock:
                locked.set()

        locker = threading.Thread(target=take_lock)
        locker.start()
        assert locked.wait(DEADLINE_S / 4), "idle held the replica's lock while waiting"
        locker.join(DEADLINE_S)
        values = torch.full((replica.flat.plan.segments[0].numel,), 3.0)
        item = InboundPush("s", 1, 1, [ReceivedSegment(0, 1.0, values)])
        replica.inbox.put(item)
        assert not replica.settled() or item.reply.done()  # pending until merged
        [ack] = item.reply.result(timeout=DEADLINE_S)
    finally:
        replica.inbox.put(InboundPush("s", 1, 2, []))  # ends a wait the test did not end
        idle.join(DEADLINE_S)
    assert not idle.is_alive()
    assert (ack.segment, ack.duplicate) == (0, False)
    assert replica.summary.weights == (2.0,)
