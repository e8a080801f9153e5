"""Link shaping for tests and benchmarks: added latency and a send-rate cap, off by default.

Real processes on one machine talk over loopback, where every link is fast and
immediate; a benchmark of slow or distant sites (docs/design.md §5's scheduled overlap,
the wide-area runs) needs links that are not. ``[link]`` in a node's config makes
this node's own sends look like a slow, distant link. It is a test and benchmark
knob, never for production: it only ever slows a node down.

What one-way latency means for a stream: the data arrives ``latency`` later than
it would without it. So a message (a push stream, a pull request, a served pull's
reply stream) waits the latency once, before its first frame; its later frames
are paced by the rate and do not each wait the latency again. A transfer of S
payload bytes thus takes about ``latency + S / rate``.

The rate is one link per node: every push this node sends and every pull it
serves draw on the same clock, so two transfers at once share the rate the way
two flows share a real uplink. The clock forgives a sender that comes back to it
up to CHUNK_TIME_S late (a busy event loop wakes sleepers late, and a real link
would have kept sending meanwhile), and no more: S bytes never go out in less than
S/rate − CHUNK_TIME_S, and a long transfer averages the rate.

Everything here sleeps on the event loop (``asyncio.sleep``); nothing blocks the
loop's thread, and nothing is called with the replica's lock held.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import TYPE_CHECKING

from gossipd.node.errors import ConfigError

if TYPE_CHECKING:
    from gossipd.node.shared.config import LinkConfig

log = logging.getLogger(__name__)

# Chunks on a shaped link are cut to about this much transmission time, so a slow link
# still shows progress to the receiver's idle timeout and the rate is paced smoothly;
# it is also the most idle time the rate clock gives back (its burst allowance).
CHUNK_TIME_S = 0.05
MIN_CHUNK_BYTES = 4096


class LinkShaper:
    """One node's shaped uplink: :meth:`delay` once per message, :meth:`pace` per chunk."""

    def __init__(
        self,
        latency_s: float = 0.0,
        rate_bytes_s: float = 0.0,
        jitter_s: float = 0.0,
        seed: int = 0,
    ) -> None:
        """``rate_bytes_s`` 0: no cap. ``jitter_s``: each delay adds a uniform draw in
        [0, jitter_s] (seeded, so runs repeat), so latency stays a lower bound."""
        self.latency_s = latency_s
        self.rate_bytes_s = rate_bytes_s
        self.jitter_s = jitter_s
        self._rng = random.Random(seed)
        self._free_at = 0.0  # loop time at which the link has sent everything reserved

    @classmethod
    def from_config(cls, link: LinkConfig, node_id: str, seed: int = 0) -> LinkShaper | None:
        """The node's shaper, or None when ``[link]`` is off (nothing is delayed then)."""
        if not link.enabled:
            return None
        log.info(
            "[link] shaping is ON for node %s: latency_ms = %g, jitter_ms = %g, rate_mbit = %s. "
            "This is a test and benchmark knob that slows every push and served pull of this "
            "node; remove the [link] section for production",
            node_id,
            link.latency_ms,
            link.jitter_ms,
            f"{link.rate_mbit:g}" if link.rate_mbit else "unlimited",
        )
        return cls(
            link.latency_ms / 1000.0, link.rate_mbit * 1e6 / 8, link.jitter_ms / 1000.0, seed
        )

    def chunk_bytes(self, chunk_bytes: int) -> int:
        """``chunk_bytes``, cut to about CHUNK_TIME_S of sending at the rate (when capped)."""
        if not self.rate_bytes_s:
            return chunk_bytes
        return min(chunk_bytes, max(MIN_CHUNK_BYTES, int(self.rate_bytes_s * CHUNK_TIME_S)))

    def next_delay_s(self) -> float:
        """The one-way delay of the next message."""
        if not self.jitter_s:
            return self.latency_s
        return self.latency_s + self._rng.uniform(0.0, self.jitter_s)

    async def delay(self) -> None:
        """Wait the link's one-way latency: once per message, before its first frame."""
        delay_s = self.next_delay_s()
        if delay_s > 0:
            await asyncio.sleep(delay_s)

    async def pace(self, nbytes: int) -> None:
        """Wait until ``nbytes`` more would have left through the capped link.

        The bytes are booked on the node's one link clock before the wait, so
        concurrent transfers queue behind each other and share the rate.
        """
        if not self.rate_bytes_s:
            return
        now = asyncio.get_running_loop().time()
        self._free_at = max(self._free_at, now - CHUNK_TIME_S) + nbytes / self.rate_bytes_s
        wait_s = self._free_at - now
        if wait_s > 0:
            await asyncio.sleep(wait_s)


def link_tables(nodes: int, **flags: str | None) -> list[dict[str, float]]:
    """Each local node's ``[link]`` table from ``mesh up`` flags such as ``latency_ms="50"``.

    A flag's value is one number for every node, or a comma-separated list with one
    number per node (node 0 first), e.g. two fast and six slow sites. Each node's
    table is checked as its config will be, so a bad value fails before any node starts.
    """
    from gossipd.node.shared.config import parse_config

    tables: list[dict[str, float]] = [{} for _ in range(nodes)]
    for key, text in flags.items():
        if text is None:
            continue
        flag = f"--link-{key.replace('_', '-')}"
        parts = [p.strip() for p in text.split(",")]
        if len(parts) not in (1, nodes):
            raise ConfigError(
                f"{flag} {text!r} has {len(parts)} values for {nodes} nodes; give one value "
                f"for all, or exactly {nodes} separated by commas (node 0 first)"
            )
        try:
            values = [float(p) for p in parts]
        except ValueError:
            raise ConfigError(
                f"{flag} {text!r} is not a number or a comma-separated list of numbers"
            ) from None
        if len(values) == 1:
            values *= nodes
        for table, value in zip(tables, values, strict=True):
            table[key] = value
    for index, table in enumerate(tables):
        if table:
            stand_in = {"mesh_id": "mesh", "node_id": f"node-{index}", "tls": {"insecure": True}}
            parse_config({**stand_in, "link": table}, f"(--link-* flags of node-{index})")
    return tables
