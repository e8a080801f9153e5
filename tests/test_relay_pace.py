"""``reach.rate_mbit`` paces what a relay forwards, all its connections together: each
frame is due when the bytes before it would have left at that rate, so the relay's
bytes (and the CPU that copies them) per second are capped. Read off the pace's own
schedule, not off a clock on a loaded machine."""

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
