"""The overlap protocol through the daemon's driver: in-process nodes on real sockets.

Two or three ``GossipNode``s (the replica and the network, real gRPC on loopback)
run ``protocol = "overlap"`` with no training: each node's model is a constant,
so every merge shows as an exact value ((x_i + x_j)/2) and "unchanged" is exact.
The tests check what ``Pull.merge_at_step`` promises (node/protocols/base.py):
an early pull is held until its step's boundary; a late one is waited for there,
measured, and hurried if it still waits for its start time; a waiting trainer
still serves its peers' pulls; and a peer serves one pull at a time, the others
re-picking without counting it as failed. Slow links come from the ``[link]``
knob on the serving node, never from sleeps. Overlap keeps no sum-weights (its
module docstring says why), so the "mass" checked after each fault is that no
node reports any weight and every model is an exact average of the start values.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gossipd.node.launch.localmesh import free_ports
from gossipd.node.net.status.query import query_status
from gossipd.node.protocols.base import Pull
from gossipd.node.protocols.overlap import OverlapGossip
from gossipd.node.shared import certs
from gossipd.node.shared.tls import Credentials
from gossipd.node.site.api import GossipNode
from gossipd.node.trainer.messages import OutboundPull
from gossipd.node.trainer.report import StepReport
from tests.conftest import wait_until

MESH = "overlap-mesh"
DEADLINE_S = 60.0
NUMEL = 1000
LATENCY_MS = 1000.0  # the serving node's shaped link: a pull takes at least this long


def _model(value: float) -> torch.nn.Module:
    """Four tensors of 1000 bytes: four segments of ``segment_bytes = 1024``."""
    model = torch.nn.Module()
    model.parts = torch.nn.ParameterList(
        torch.nn.Parameter(torch.full((NUMEL // 4,), value)) for _ in range(4)
    )
    return model


@contextlib.contextmanager
def _mesh(
    count: int,
    *,
    period_steps: int,
    links: dict[int, float] | None = None,
    pki: Path | None = None,
) -> Iterator[list[GossipNode]]:
    """``count`` overlap nodes n0, n1, … with models 0, 8, 16, …, verified peers of each
    other; ``links`` gives node index → shaped latency (ms); ``pki``: mutual TLS."""
    ports = free_ports(count)
    nodes: list[GossipNode] = []
    try:
        for i, port in enumerate(ports):
            tls: dict[str, Any] = {"insecure": True}
            if pki is not None:
                tls = {
                    "ca": str(pki / certs.CA_CERT_FILE),
                    "cert": str(pki / f"n{i}.pem"),
                    "key": str(pki / f"n{i}.key"),
                }
            config = {
                "mesh_id": MESH,
                "node_id": f"n{i}",
                "listen": f"127.0.0.1:{port}",
                "seeds": [f"127.0.0.1:{p}" for p in ports if p != port],
                "gossip": {
                    "protocol": "overlap",
                    "segment_bytes": 1024,
                    # The trainer gives up on a due pull after 2 × this: a test that
                    # should not wait that long fails in 20 s, not 60.
                    "push_timeout_s": 10.0,
                    "overlap": {"period_steps": period_steps},
                },
                "link": {"latency_ms": (links or {}).get(i, 0.0)},
                "metrics": {"listen": None},
                "tls": tls,
                "shutdown_timeout_s": 5.0,
            }
            nodes.append(GossipNode(config, _model(8.0 * i)))
        for node in nodes:
            assert node.wait_for_peers(count - 1, DEADLINE_S)
        yield nodes
    finally:
        for node in nodes:
            node.close()


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    directory = tmp_path / "pki"
    certs.init_ca(directory, mesh_id=MESH)
    for node_id in ("n0", "n1"):
        certs.issue(node_id, directory)
    return directory


def _values(node: GossipNode) -> set[float]:
    """The distinct parameter values of a constant model (one value unless mid-merge)."""
    return {v for buffer in node.replica.flat.buffers for v in buffer.unique().tolist()}


def _core(node: GossipNode) -> OverlapGossip:
    core = node.replica.core
    assert isinstance(core, OverlapGossip)
    return core


def _merged(report: StepReport) -> list[str]:
    return [p.peer for p in report.pulled if p.merged_segments and p.error is None]


def _served(node: GossipNode) -> float:
    labels = {"direction": "sent", "kind": "pull", "result": "ok"}
    value = node.network.metrics.registry.get_sample_value("gossipd_gossip_messages_total", labels)
    return value or 0.0


def _status(node: GossipNode, pki: Path | None = None) -> dict[str, Any]:
    tls = None
    if pki is not None:
        tls = Credentials(ca=pki / certs.CA_CERT_FILE, cert=pki / "n0.pem", key=pki / "n0.key")
    return asyncio.run(query_status(node.address, 10.0, tls=tls))


def test_a_pull_that_lands_early_is_held_until_the_end_of_its_due_step() -> None:
    with _mesh(2, period_steps=4) as (a, b):
        report = a.step()  # step 1: no step time, no c_ab yet: the pull starts at once
        assert not report.pulled and _core(a).status().extra["pulling_from"] == "n1"

        def held() -> bool:
            a.replica.idle(0)  # apply what arrived, without ending a step
            return bool(a.replica.due_pulls.held)

        wait_until(held, "the pull to land and be held", DEADLINE_S)
        for step in (2, 3):  # landed, and held: the model is the one it had
            report = a.step()
            assert report.step == step and not report.pulled and _values(a) == {0.0}
        report = a.step()  # step 4 ends the period: the pull merges at its boundary
        assert _merged(report) == ["n1"] and _values(a) == {4.0}
        assert a.replica.wait_s == 0.0  # it had landed: the trainer never waited
        assert _values(b) == {8.0} and a.sum_weights == [] and b.sum_weights == []


def test_a_pull_not_landed_by_its_due_step_is_waited_for_and_the_wait_measured() -> None:
    """n1's link is slow (1 s latency): n0's pull, started after step 1, cannot land by
    the end of step 2, so the trainer waits there; status shows the wait."""
    with _mesh(2, period_steps=2, links={1: LATENCY_MS}) as (a, b):
        assert not a.step().pulled
        report = a.step()
        assert _merged(report) == ["n1"] and _values(a) == {4.0} and _values(b) == {8.0}
        assert a.replica.wait_s > 0.0
        status = _status(a)
        assert status["wait_s"] == a.replica.wait_s and 0.0 < status["wait_fraction"] <= 1.0
        assert status["scheduling"] == "decentralized" and status["sum_weights"] == []


def test_two_trainers_waiting_for_each_other_still_serve_each_other_s_pulls(pki: Path) -> None:
    """Both links slow, mutual TLS, each trainer holding its lock around the whole step:
    each waits at its period's end for the other's model, which the other must snapshot
    while it waits itself. Every period of both merges (before FairLock.suspended the
    waits held the locks, each side's pull timed out, and nothing merged)."""
    periods = 3
    with _mesh(2, period_steps=2, links={0: 300.0, 1: 300.0}, pki=pki) as nodes:
        merged: dict[str, list[str]] = {}
        errors: list[BaseException] = []

        def train(node: GossipNode) -> None:
            try:
                mine = merged.setdefault(node.config.node_id, [])
                for _ in range(2 * periods):
                    with node.lock:  # a training step that holds the lock throughout
                        mine.extend(_merged(node.step()))
            except BaseException as err:
                errors.append(err)

        threads = [threading.Thread(target=train, args=(n,), daemon=True) for n in nodes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(DEADLINE_S)
        assert not any(t.is_alive() for t in threads), "a trainer is stuck"
        assert not errors, errors
        assert merged == {"n0": ["n1"] * periods, "n1": ["n0"] * periods}
        assert all(n.replica.wait_s > 0.0 for n in nodes)
        # Averages of 0 and 8 only: both end inside [0, 8], nothing else came in.
        assert all(len(_values(n)) == 1 and 0.0 <= min(_values(n)) <= 8.0 for n in nodes)
        status = _status(nodes[0], pki)
        assert status["transport_security"] == "mtls" and status["wait_fraction"] > 0.0
        assert status["sum_weights"] == [] and status["suspected_peers"] == []


def test_reaching_the_due_step_starts_a_pull_still_waiting_for_its_start_time() -> None:
    """A slow-step history predicts the period's end ~50 min away, so the pull is
    scheduled to start then; the steps end at once, and the trainer reaching the due
    step starts it (hurry) instead of waiting for its start time."""
    with _mesh(2, period_steps=4) as (a, b):
        a.replica.load_state_dict(
            {
                "protocol": "overlap",
                "step_time_s": 1000.0,
                "scheduler": {"estimates": [["n0", "n1", 0.01], ["n1", "n0", 0.01]]},
            }
        )
        a.step()
        period = _core(a).period
        assert period is not None and period.end_s - a.replica.clock() > 1000.0
        for _ in (2, 3):
            assert not a.step().pulled and _values(a) == {0.0}
        assert _served(b) == 0.0  # the pull still waits for its start time
        report = a.step()  # step 4: due; the pull was hurried, landed, merged
        assert _merged(report) == ["n1"] and _values(a) == {4.0}
        assert a.replica.wait_s > 0.0 and a.sum_weights == []


def test_a_pull_re_picked_while_the_trainer_waits_is_started_at_once() -> None:
    """n0 predicts a far period end (slow-step history), so its pull from n1 waits for
    its start time; n1 is gone. At the due step the trainer hurries it, it fails, the
    core re-picks n2 with a start time still far away: that pull must be hurried too,
    or the trainer waits until it gives up (2 × push_timeout_s) and merges nothing."""
    with _mesh(3, period_steps=2) as (a, b, c):
        a.replica.load_state_dict(
            {
                "protocol": "overlap",
                "step_time_s": 1000.0,
                "scheduler": {
                    "estimates": [[x, y, 0.01] for x, y in itertools.permutations(("n0", "n1"))]
                    + [[x, y, 0.01] for x, y in itertools.permutations(("n0", "n2"))]
                },
            }
        )
        b.closed = True
        b._stop_loop()  # gone without a Leave: n0 still thinks it is live
        a.step()
        assert _core(a).status().extra["pulling_from"] == "n1"
        report = a.step()
        assert [(p.peer, bool(p.error)) for p in report.pulled] == [("n1", True), ("n2", False)]
        assert _values(a) == {8.0} and _values(c) == {16.0}  # (0 + 16) / 2
        assert _core(a).status().extra["pulls"]["repicked"] == 1
        assert a.sum_weights == [] and c.sum_weights == []


def test_a_hurry_sent_right_behind_its_pull_is_not_lost() -> None:
    """The trainer's port hands the loop a pull due an hour from now and, right behind
    it, the hurry (a pull re-picked while the trainer waits at its due step): the loop
    runs the hurry before the pull's task first runs, and the pull must start at once."""
    with _mesh(2, period_steps=2) as (a, b):
        pull = Pull("n1", 99, tuple(range(len(a.replica.flat.plan))), a.replica.clock() + 3600)
        out = OutboundPull(pull)
        a.replica.port.start_pull(out)
        a.replica.port.hurry_pull(out)
        wait_until(lambda: _served(b) == 1.0, "the hurried pull to be served", DEADLINE_S)
        wait_until(lambda: a.replica.events.pending() > 0, "the pull's outcome", DEADLINE_S)


def test_a_peer_pulled_by_two_serves_one_and_the_other_re_picks_suspecting_nobody() -> None:
    """n0 and n2 pull n1 at the same time: n1 serves n0 (its snapshot waits while the
    test holds n1's lock, as a trainer inside a long step would), and answers n2 Busy
    at once; n2 re-picks n0 within the same period. A busy peer answered: nobody counts
    it as failed, nobody suspects it."""
    with _mesh(3, period_steps=2) as (a, b, c):
        with b.lock:  # n1 is inside a long step: a pull it serves waits for its snapshot
            a.step()  # n0's queue starts after it: it pulls n1
            wait_until(
                lambda: b.network.inbound.serving_pull == "n0", "n1 to start serving n0", DEADLINE_S
            )
            # n2's queue is [n0, n1]: its first period pulls n0, its second n1.
            c.step()
            assert _merged(c.step()) == ["n0"] and _values(c) == {8.0}
            assert _core(c).status().extra["pulling_from"] == "n1"
            reports: list[StepReport] = []
            wait_until(
                lambda: bool(reports.append(c.step()) or _merged(reports[-1])),
                "n2's re-picked pull to merge",
                DEADLINE_S,
            )
            pulled = [p for r in reports for p in r.pulled]
            assert [(p.peer, p.merged_segments == ()) for p in pulled] == [
                ("n1", True),
                ("n0", False),
            ]
            assert "serving a pull to n0 already" in str(pulled[0].error)
            assert c.network.membership.peers["n1"].failures == 0
            assert _values(c) == {4.0}  # (8 + 0) / 2: n0 has not merged yet
        assert _merged(a.step()) == ["n1"] and _values(a) == {4.0}  # served once n1 let go
        for node in (a, b, c):
            status = _status(node)
            assert status["suspected_peers"] == [] and status["sum_weights"] == []
        counts = _core(c).status().extra["pulls"]
        assert counts["failed"] == 1 and counts["repicked"] == 1 and counts["merged"] == 2
