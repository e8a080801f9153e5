"""The ``[link]`` test knob: added latency and a shared send-rate cap, on real gRPC with mTLS.

Two nodes run in this process (``GossipNode``: the replica and the network on real
loopback sockets, mutual TLS). Only lower bounds on time are asserted: a loaded
machine makes everything slower, never faster, so a shaped transfer that took
less than its latency, or than its bytes over its rate, means the knob failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gossipd.node.cli.main import build_parser
from gossipd.node.errors import ConfigError
from gossipd.node.launch.localmesh import MeshSpec, free_ports, node_toml
from gossipd.node.net.status.query import query_status
from gossipd.node.net.wire.shaping import CHUNK_TIME_S, LinkShaper, link_tables
from gossipd.node.protocols import PROTOCOLS
from gossipd.node.shared import certs
from gossipd.node.shared.config import LinkConfig, parse_config
from gossipd.node.shared.tls import Credentials
from gossipd.node.site.api import GossipNode
from gossipd.node.trainer.report import StepReport
from tests.pullcore import NAME, PullEveryRound

MESH = "shaped-mesh"
DEADLINE_S = 60.0
LATENCY_MS = 300.0
RATE_MBIT = 8.0  # 1 MB/s
BIG_NUMEL = 500_000  # 2 MB of float32: 2 s at RATE_MBIT, in one 4 MiB segment
PAYLOAD_S = BIG_NUMEL * 4 / (RATE_MBIT * 1e6 / 8)
# The rate clock's burst allowance (CHUNK_TIME_S), plus float rounding and clock reads.
TOLERANCE_S = CHUNK_TIME_S + 0.02


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    directory = tmp_path / "pki"
    certs.init_ca(directory, mesh_id=MESH)
    for node_id in ("n0", "n1"):
        certs.issue(node_id, directory)
    return directory


@pytest.fixture
def pull_protocol(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Registers the test-only core that pulls its peer's whole model every step."""
    monkeypatch.setitem(
        PROTOCOLS,
        NAME,
        lambda s: PullEveryRound(s.node_id, s.num_segments),  # type: ignore[arg-type]
    )
    yield


def _model(numel: int, value: float) -> torch.nn.Module:
    """Four equal tensors: four segments when small (``segment_bytes = 1024``)."""
    model = torch.nn.Module()
    model.parts = torch.nn.ParameterList(
        torch.nn.Parameter(torch.full((numel // 4,), value)) for _ in range(4)
    )
    return model


def _pair(
    pki: Path,
    links: tuple[dict[str, float], dict[str, float]],
    *,
    numel: int = 1000,
    protocol: str = "sumweight",
    push_probability: tuple[float, float] = (1.0, 1.0),
) -> tuple[GossipNode, GossipNode]:
    """n0 and n1 with their own ``[link]`` tables, verified peers of each other."""
    ports = free_ports(2)
    nodes: list[GossipNode] = []
    try:
        for i, port in enumerate(ports):
            gossip: dict[str, Any] = {"protocol": protocol}
            if numel <= 1000:
                gossip["segment_bytes"] = 1024
            if protocol == "sumweight":
                gossip["sumweight"] = {"push_probability": push_probability[i]}
            config = {
                "mesh_id": MESH,
                "node_id": f"n{i}",
                "listen": f"127.0.0.1:{port}",
                "seeds": [f"127.0.0.1:{p}" for p in ports if p != port],
                "gossip": gossip,
                "link": links[i],
                "metrics": {"listen": None},
                "tls": {
                    "ca": str(pki / certs.CA_CERT_FILE),
                    "cert": str(pki / f"n{i}.pem"),
                    "key": str(pki / f"n{i}.key"),
                },
                "shutdown_timeout_s": 5.0,
            }
            nodes.append(GossipNode(config, _model(numel, float(8 * i))))
        for node in nodes:
            assert node.wait_for_peers(1, DEADLINE_S)
    except BaseException:
        for node in nodes:
            node.close()
        raise
    return nodes[0], nodes[1]


@contextlib.contextmanager
def _both(a: GossipNode, b: GossipNode) -> Iterator[None]:
    """Close both at the end, quickly: n1's replica keeps merging (on a thread of its own,
    reaped here) while n0 leaves, so n0's weight hand-off is answered at once."""
    try:
        yield
    finally:
        stop = threading.Event()
        driver = threading.Thread(target=b.replica.idle_until, args=(stop,), daemon=True)
        driver.start()
        try:
            a.close()
        finally:
            stop.set()
            driver.join(30.0)
            b.close()


def _step_both(
    nodes: tuple[GossipNode, GossipNode], done: Callable[[list[StepReport]], bool], what: str
) -> list[StepReport]:
    """Step both (no training: pure gossip) until ``done`` holds for n0's reports so far."""
    reports: list[StepReport] = []
    deadline = time.monotonic() + DEADLINE_S
    while not done(reports):
        reports.append(nodes[0].step())
        nodes[1].step()
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)  # stand-in for a training step's compute
    return reports


def _push_seconds(node: GossipNode) -> tuple[float, float, float]:
    """(pushes settled, their total seconds, how many settled within 0.25 s)."""
    registry = node.network.metrics.registry

    def sample(name: str, labels: dict[str, str] | None = None) -> float:
        return registry.get_sample_value(name, labels or {}) or 0.0

    return (
        sample("gossipd_push_seconds_count"),
        sample("gossipd_push_seconds_sum"),
        sample("gossipd_push_seconds_bucket", {"le": "0.25"}),
    )


def _mesh_weights(pki: Path, nodes: tuple[GossipNode, GossipNode]) -> list[float]:
    """Sum over both nodes of each segment's weight, read from their Status RPCs once
    nothing is in flight: the replicas merge and settle without stepping (no new pushes)."""
    deadline = time.monotonic() + DEADLINE_S
    while not all(n.replica.settled() for n in nodes):
        assert time.monotonic() < deadline, "pushes did not settle"
        for node in nodes:
            node.replica.idle(0.01)
    for node in nodes:
        node.replica.idle(0)  # publish the settled weights in the summary Status reads
    tls = Credentials(ca=pki / certs.CA_CERT_FILE, cert=pki / "n0.pem", key=pki / "n0.key")
    statuses = [asyncio.run(query_status(n.address, 10.0, tls=tls)) for n in nodes]
    return [sum(ws) for ws in zip(*(s["sum_weights"] for s in statuses), strict=True)]


def test_the_knob_is_off_by_default_and_then_no_shaper_exists(pki: Path) -> None:
    config = parse_config({"mesh_id": MESH, "node_id": "n0", "tls": {"insecure": True}})
    assert not config.link.enabled
    assert LinkShaper.from_config(config.link, "n0") is None
    a, b = _pair(pki, ({}, {}), push_probability=(0.0, 0.0))
    with _both(a, b):
        client = asyncio.run_coroutine_threadsafe(_client(a, b), a._loop).result(30)
        assert a.network.shaper is None and a.network.inbound.shaper is None
        assert client.shaper is None and client.chunk_bytes == a.config.gossip.chunk_bytes


async def _client(a: GossipNode, b: GossipNode) -> Any:
    return a.network.channels.client(b.address, b.config.node_id)


@pytest.mark.parametrize(
    ("link", "message"),
    [
        ({"latency_ms": -1.0}, r"link\.latency_ms = -1\.0: Input should be greater than"),
        ({"rate_mbit": math.nan}, r"link\.rate_mbit = nan: Input should be a finite number"),
        ({"jitter_ms": math.inf}, r"link\.jitter_ms = inf: Input should be a finite number"),
        ({"rate_mbit": -8.0}, r"link\.rate_mbit = -8\.0: Input should be greater than"),
        ({"latency_ms": 10_000.0}, r"not below min\(gossip\.progress_timeout_s"),
        ({"rate_mbit": 0.1}, r"below limits\.min_push_rate_bytes_s"),
        ({"latencyms": 5.0}, r"unknown key; did you mean 'latency_ms'"),
    ],
)
def test_the_config_refuses_bad_link_values_with_the_key_and_the_fix(
    link: dict[str, float], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"mesh_id": MESH, "node_id": "n0", "tls": {"insecure": True}, "link": link})


def test_the_config_refuses_a_link_slower_than_the_pulls_it_serves_may_be() -> None:
    """1 Mbit/s (125,000 bytes/s) is above the push floor but below this pull floor."""
    config = {"mesh_id": MESH, "node_id": "n0", "tls": {"insecure": True}}
    config |= {"link": {"rate_mbit": 1.0}, "limits": {"min_pull_rate_bytes_s": 200_000.0}}
    with pytest.raises(
        ConfigError, match=r"below limits\.min_pull_rate_bytes_s = 200000, so this node would"
    ):
        parse_config(config)


def test_mesh_up_flags_give_each_node_its_own_link_table(tmp_path: Path) -> None:
    """One value for all, or one per node (two fast, two slow); written into each config."""
    args = build_parser().parse_args(
        [
            "mesh",
            "up",
            "--nodes",
            "4",
            "--link-latency-ms",
            "50",
            "--link-rate-mbit",
            "100,100,10,10",
        ]
    )
    tables = link_tables(args.nodes, latency_ms=args.link_latency_ms, rate_mbit=args.link_rate_mbit)
    spec = MeshSpec(nodes=4, insecure=True, link=tables)
    ports = free_ports(4)
    configs = [
        parse_config(tomllib.loads(node_toml(spec, MESH, i, ports, tmp_path)), f"node {i}")
        for i in range(4)
    ]
    assert [c.link.latency_ms for c in configs] == [50.0] * 4
    assert [c.link.rate_mbit for c in configs] == [100.0, 100.0, 10.0, 10.0]
    unshaped = parse_config(tomllib.loads(node_toml(MeshSpec(nodes=2), MESH, 0, ports, tmp_path)))
    assert not unshaped.link.enabled
    with pytest.raises(ConfigError, match=r"--link-rate-mbit '1,2' has 2 values for 4 nodes"):
        link_tables(4, rate_mbit="1,2")
    with pytest.raises(ConfigError, match=r"node-1.*\n  link\.latency_ms = -5\.0"):
        link_tables(2, latency_ms="5,-5")


def test_latency_delays_every_push_and_the_sum_of_weights_is_kept(pki: Path) -> None:
    a, b = _pair(pki, ({"latency_ms": LATENCY_MS}, {}))
    with _both(a, b):
        assert b.network.shaper is None  # the knob is per node
        _step_both((a, b), lambda _: _push_seconds(a)[0] >= 3, "three shaped pushes")
        weights = _mesh_weights(pki, (a, b))
        count, total_s, quick = _push_seconds(a)
        assert a.replica.summary.pushes_acked >= 3
    assert quick == 0, "a push with 300 ms of latency settled within 0.25 s"
    assert total_s / count >= LATENCY_MS / 1000
    assert weights == pytest.approx([2.0] * len(weights), abs=1e-9)


def test_the_rate_caps_a_2_mb_push_at_8_mbit_s(pki: Path) -> None:
    a, b = _pair(pki, ({"rate_mbit": RATE_MBIT}, {}), numel=BIG_NUMEL, push_probability=(1.0, 0.0))
    with _both(a, b):
        client = asyncio.run_coroutine_threadsafe(_client(a, b), a._loop).result(30)
        assert client.chunk_bytes == 50_000  # 50 ms of sending at 1 MB/s
        _step_both((a, b), lambda _: _push_seconds(a)[0] >= 1, "one shaped push")
        weights = _mesh_weights(pki, (a, b))
        count, total_s, _ = _push_seconds(a)
        assert a.replica.summary.pushes_acked >= 1
    assert total_s / count >= PAYLOAD_S - TOLERANCE_S
    assert weights == pytest.approx([2.0], abs=1e-9)


def test_latency_delays_a_pull(pki: Path, pull_protocol: None) -> None:
    a, b = _pair(pki, ({"latency_ms": LATENCY_MS}, {}), protocol=NAME)
    with _both(a, b):
        reports = _step_both(
            (a, b), lambda rs: sum(len(r.pulled) for r in rs) >= 2, "two shaped pulls"
        )
    pulls = [p for r in reports for p in r.pulled]
    assert all(p.error is None for p in pulls)
    assert min(p.transfer_s for p in pulls) >= LATENCY_MS / 1000


def test_two_pulls_served_at_once_share_the_rate(pki: Path) -> None:
    """n1 serves its 2 MB model to two pulls at once through one 1 MB/s link: each needs
    2 s of the link alone, and together 4 s (separate caps would end both near 2 s)."""
    a, b = _pair(pki, ({}, {"rate_mbit": RATE_MBIT}), numel=BIG_NUMEL, push_probability=(0, 0))
    with _both(a, b):

        async def timed_pull() -> float:
            client = a.network.channels.client(b.address, "n1")
            started = time.monotonic()
            pulled = await client.pull(a.replica.flat.plan, a.network.limits, 30.0)
            assert pulled.nbytes == BIG_NUMEL * 4
            return time.monotonic() - started

        async def both() -> list[float]:
            return list(await asyncio.gather(timed_pull(), timed_pull()))

        durations = asyncio.run_coroutine_threadsafe(both(), a._loop).result(DEADLINE_S)
    assert min(durations) >= PAYLOAD_S - TOLERANCE_S
    assert max(durations) >= 2 * PAYLOAD_S - TOLERANCE_S


def test_a_shaper_waits_its_latency_and_books_concurrent_bytes_on_one_clock() -> None:
    """The shaper on its own, on a real event loop: jittered delays stay within
    [latency, latency + jitter] and repeat with the seed; two streams paced at once
    finish no sooner than all their bytes over the rate."""
    shaper = LinkShaper(latency_s=0.05, rate_bytes_s=1e6, jitter_s=0.02, seed=3)
    again = LinkShaper(latency_s=0.05, rate_bytes_s=1e6, jitter_s=0.02, seed=3)
    delays = [shaper.next_delay_s() for _ in range(50)]
    assert delays == [again.next_delay_s() for _ in range(50)]
    assert all(0.05 <= d <= 0.07 for d in delays) and len(set(delays)) > 1

    async def stream(chunks: int) -> None:
        await shaper.delay()
        for _ in range(chunks):
            await shaper.pace(50_000)

    async def run() -> float:
        started = asyncio.get_running_loop().time()
        await asyncio.gather(stream(4), stream(4))
        return asyncio.get_running_loop().time() - started

    assert asyncio.run(run()) >= 0.05 + 8 * 50_000 / 1e6 - TOLERANCE_S


def test_the_documented_link_example_is_a_valid_config() -> None:
    """The ``[link]`` block on the shaping page parses as a node's config and turns shaping
    on; every ``[link]`` key has its row in the config reference, with its default."""
    docs = Path(__file__).resolve().parents[1] / "docs"
    reference = (docs / "reference" / "config.md").read_text()
    for key in LinkConfig.model_fields:
        assert f"| `link.{key}` | `0`" in reference, f"link.{key} is not in the config reference"
    page = (docs / "benchmarks" / "shaping.md").read_text()
    [block] = [b for b in page.split("```toml\n")[1:] if b.startswith("[link]")]
    table = tomllib.loads(block.split("```")[0])
    config = parse_config({"mesh_id": MESH, "node_id": "n0", "tls": {"insecure": True}, **table})
    shaper = LinkShaper.from_config(config.link, "n0")
    assert shaper is not None and shaper.latency_s == 0.05 and shaper.rate_bytes_s == 12.5e6
