"""What relaying costs, and who pays it. ``reach.rate_mbit`` paces what a relay forwards,
all its connections together: each frame is due when the bytes before it would have
left at that rate, so the relay's bytes (and the CPU that copies them) per second are
capped; read off the pace's own schedule, not off a clock on a loaded machine. And a
dialler's choice of relay spreads a site's diallers over its relays."""

from __future__ import annotations

import asyncio

import pytest

from gossipd.node.net.relay.hub import Pace


def test_frames_are_scheduled_at_the_capped_rate_across_connections() -> None:
    async def go() -> float:
        pace = Pace(rate_mbit=80.0)  # 10 MB/s
        start = asyncio.get_running_loop().time()
        # Two connections' frames, interleaved: one budget for both.
        await asyncio.gather(*(pace.take(100_000) for _ in range(10)))
        return pace.free_at - start

    assert asyncio.run(go()) == pytest.approx(10 * 100_000 / 10e6, abs=0.02)


def test_no_cap_forwards_at_once() -> None:
    async def go() -> float:
        pace = Pace(rate_mbit=0.0)
        await pace.take(1 << 30)
        return pace.free_at

    assert asyncio.run(go()) == 0.0


def test_a_dialler_tries_itself_first_when_it_relays_the_site_then_spreads() -> None:
    """A relay dialling a site it relays crosses no other site; other diallers of the same
    site do not all pick the same relay first."""
    from gossipd.node.net.relay.routes import Routes
    from gossipd.node.shared.relay_address import parse
    from gossipd.node.shared.tls import Credentials

    relayed = parse("relay://c@10.0.0.1:1,10.0.0.2:1,10.0.0.3:1")
    assert relayed is not None
    routes = Routes(Credentials(insecure=True))
    routes.me = "10.0.0.2:1"
    assert routes.order(relayed)[0] == "10.0.0.2:1"
    firsts = set()
    for i in range(20):
        routes.me = f"10.9.0.{i}:1"
        firsts.add(routes.order(relayed)[0])
    assert len(firsts) > 1
