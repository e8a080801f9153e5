"""An insider for tests of ``persyn``: the slot-holding, poisoning member of
``tests/insider_streams.py``, speaking ``persyn`` (a daemon refuses a member of another
protocol), that can also turn into a weight sink for a while.

It is a member of the butterfly like any site, so honest sites push to it in some
sub-rounds. While it refuses them (RESOURCE_EXHAUSTED, a known outcome) the sender folds
the weight back; while it sinks (:attr:`PersynInsider.sinking`) it acknowledges every
segment as merged and keeps the weight, counted per sender, so the honest books can be
closed exactly at the end. It never pushes in a burst, so the honest site whose
in-neighbour it is in a sub-round gets no push there: that site's burst is partial and
it takes no outer step on it (:func:`outer_steps` says how many each site took).
"""

from __future__ import annotations

import math
import time
import urllib.request
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gossipd.node.shared.tls import Credentials
from gossipd.proto import gossip_pb2 as pb
from tests.conftest import DaemonHandle, check_alive, status_of, wait_until
from tests.insider_streams import Insider

OUTER_METRIC = "gossipd_outer_steps_total"
# Each window during and after an attack must keep half the pushes per honest site step it
# had before (the goal, per step: a machine slowed by other work slows steps and
# bursts alike; measured 0.92-1.07) and this share of the pushes per second. Per second
# the 0.5 held in four runs at a load average of 3-5 (stalled streams, the worst,
# 0.58-0.74: the attacker, on the same cores, opens 480 streams and the sites refuse
# them), but not beside heavier work (load average 12-20, a burst every 4 steps then:
# stalled and trickling streams 0.21-0.55, and two windows in a row with no attack
# differed 2.4 times). A tenth still fails what the defences stopped: stalled streams
# took sum-weight's pushes to 0.01, a reopen flood to 0.05-0.08.
RATE_FLOOR = 0.1
SCRAPE_TIMEOUT_S = 30.0

# persyn with DiLoCo's outer step (learning rate 0.7, Nesterov momentum 0.9), a burst every
# 8 steps: at the tests' 100 steps a second about 45 pushes a second are acknowledged among
# 3 honest sites beside an insider. Not 4: a burst of 40 ms is shorter than a push's
# acknowledgement takes while the attacker, on the same 2 cores, polls and pushes, so
# sub-rounds found their peer still busy and were skipped (top-ups under the cap took the
# pushes to 0.48-0.56 of their rate at K′ = 4, 0.96-0.98 at 8; sum-weight's 0.89).
OPTIONS = {"average_every_steps": 8, "outer_learning_rate": 0.7, "outer_momentum": 0.9}


class PersynInsider(Insider):
    """:class:`Insider` as a ``persyn`` member; a sink while :attr:`sinking` is set."""

    def __init__(self, node_id: str, tls: Credentials) -> None:
        self.sinking = False
        self.sunk = 0  # honest pushes it acknowledged as merged (they count as acked there)
        self.taken: defaultdict[str, float] = defaultdict(float)  # Σ sum-weight, by sender
        super().__init__(node_id, tls)
        # Read at each Handshake; nobody has been introduced to it yet.
        self.protocol = "persyn"

    async def on_push(self, request_iterator: Any, context: Any) -> pb.PushReply:
        if not self.sinking:
            return await super().on_push(request_iterator, context)
        sender, acks, weight = "", [], 0.0
        async for frame in request_iterator:
            kind = frame.WhichOneof("kind")
            if kind == "open":
                sender = frame.open.sender
            elif kind == "header":
                merged = pb.SEGMENT_RESULT_MERGED
                acks.append(
                    pb.SegmentAck(segment=frame.header.segment, result=merged, receiver_weight=1.0)
                )
                weight += frame.header.sum_weight
        self.taken[sender] += weight
        self.sunk += 1
        return pb.PushReply(acks=acks)


def outer_steps(mesh: list[DaemonHandle]) -> list[int]:
    """Each honest site's outer steps so far (``gossipd_outer_steps_total``). Its own scrape,
    with a longer timeout than ``scrape_metrics``'s 10 s: during stalled streams, beside a
    busy loop, one scrape took longer than that."""
    counts = []
    for h in mesh:
        url = f"http://127.0.0.1:{h.node_json()['metrics_port']}/metrics"
        with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as r:
            lines = r.read().decode().splitlines()
        counts += [int(float(x.split()[-1])) for x in lines if x.startswith(OUTER_METRIC + " ")]
    return counts


@dataclass(frozen=True)
class Window:
    """One window of the honest sites' progress: pushes acknowledged among them per second
    and per site step (each honest site's steps added up), and each site's outer steps."""

    rate: float
    per_step: float
    outer: list[int]


def honest_window(
    mesh: list[DaemonHandle],
    progress: int,
    what: str,
    timeout_s: float,
    sunk: Callable[[], int] = lambda: 0,
) -> Window:
    """A window that ends once the pushes acknowledged among the honest sites grew by
    ``progress`` (as ``tests.insider.ack_rate``, less the ``sunk()`` ones a sink
    acknowledged). It follows the mesh's progress: a loaded machine stretches it, a
    stalled mesh fails it after ``timeout_s``, saying how far it got.

    Per step as well as per second: bursts come every K′ steps, so a machine that slows
    every process slows the pushes with the steps; per step, what is left is what an
    attack does to gossip (on 2 shared cores, beside a busy loop, two windows in a row
    with no attack differed 2.4 times per second)."""

    def count() -> tuple[int, int]:
        statuses = [status_of(h) for h in mesh]
        return sum(s["pushes_acked"] for s in statuses) - sunk(), sum(s["step"] for s in statuses)

    outer, started = outer_steps(mesh), time.monotonic()
    start, steps = count()
    latest = [(start, steps)]

    def grown() -> bool:
        latest[0] = count()
        return latest[0][0] - start >= progress

    try:
        wait_until(
            grown, f"{progress} acknowledged pushes {what}", timeout_s, lambda: check_alive(mesh)
        )
    except AssertionError as err:
        raise AssertionError(f"{err}: only {latest[0][0] - start} in {timeout_s:g} s") from None
    elapsed = time.monotonic() - started
    pushes, stepped = latest[0][0] - start, latest[0][1] - steps
    took = [n - o for n, o in zip(outer_steps(mesh), outer, strict=True)]
    return Window(pushes / elapsed, pushes / max(stepped, 1), took)


def check_attack(name: str, before: Window, during: Window, after: Window, ended_s: float) -> str:
    """Print an attack's row (returned too); then hold its windows during and after it to
    half the pushes per site step before and ``RATE_FLOOR`` of the pushes per second, and
    every site that took outer steps before to taking some during the attack."""
    row = (
        f"{name}: before {before.rate:.1f}/s ({before.per_step:.3f} a site step), during "
        f"{during.rate / before.rate:.2f}x ({during.per_step / before.per_step:.2f}x a step), "
        f"after {after.rate / before.rate:.2f}x ({after.per_step / before.per_step:.2f}x a "
        f"step; window ended {ended_s:.1f} s after the attack); outer steps per site before "
        f"{before.outer}, during {during.outer}, after {after.outer}"
    )
    print(row)
    for window in (during, after):
        assert window.per_step >= 0.5 * before.per_step, row
        assert window.rate >= RATE_FLOOR * before.rate, row
    stepping = [i for i, n in enumerate(before.outer) if n > 0]
    assert stepping, f"no site took an outer step before the attack: {row}"
    assert all(during.outer[i] > 0 for i in stepping), row
    return row


def rms(t: torch.Tensor) -> float:
    return float(t.norm()) / math.sqrt(t.numel())


def models(insider: Insider, mesh: list[DaemonHandle]) -> list[torch.Tensor]:
    """Each honest site's model as the insider pulls it, flat."""
    return [torch.cat(insider.pull(h.address)).clone() for h in mesh]
