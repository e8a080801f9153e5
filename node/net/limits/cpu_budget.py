"""A node's CPU budget for gossip: pushes wait while gossip took more than its share.

On a site whose cores all train, every CPU-second the daemon spends on gossip
(grpc, TLS, framing, checksums, merges, snapshots) is taken from a trainer.
``gossip.cpu_share`` caps gossip's part of the CPU the node may use (its cores:
the CPU affinity, or a container's CPU quota when that is lower) while the
trainer is stepping: over the run, gossip CPU-seconds ≤ share × cores × wall
seconds. Gossip earns share × cores CPU-seconds of credit for every second the
trainer steps and spends what the process measures; while the node is in debt a
push waits until the debt is earned back. The protocol core meanwhile sees the
push still in flight and starts no new one to that peer (nor beyond
``gossip.max_pushes_in_flight``), so the push *rate* adapts to what pushes really
cost, with no weight lost or duplicated: a held push is an ordinary
unacknowledged push. Gossip that only uses CPU nobody else wants (a GPU trainer,
a cheap step on an idle machine) is never held while it stays under the share of
the whole node.

Credit, not a window: a share measured over the last 2 s was exact for a cheap
model, whose pushes are many per window, but a 17 MB model's push and the one it
receives cost tens of CPU-ms each, one or two per window: a window without one
measured under the share and let the next push go at once, so gossip took twice
its share (5.9% at 0.03). Credit keeps every CPU-ms measured until it is paid for,
whatever a push costs and whenever it lands. A push is charged its estimated cost the
moment it goes, until the next sample measures what it spent, so a burst of pushes stops
at the credit before its CPU is measured (a token bucket: see :meth:`CpuBudget.wait_s`).
The charge is not carried past that sample: kept owed until the CPU showed, it outgrew
the credit on a node whose pushes' CPU came late and small (refusing a flood on shared
cores: 410 CPU-ms owed) and held every push after. Each node waits out its own debt, so
pushes spread at the interval they really cost rather than every node of a mesh
stopping while a shared window is over and bursting together once it is under.
Credit saved while gossip is quiet is capped (``CREDIT_S`` of the share), so a
quiet stretch buys one short burst, not a flood; debt is capped (``DEBT_S``), so a
node whose inbound traffic alone is over its share still pushes, each push after
the longest hold, ``outbound.MAX_HOLD_S``.

Training CPU is what the trainer thread spends on anything but merging inbound
pushes and snapshotting its own (the job's steps, evaluations, checkpoints, the
replica's per-step bookkeeping, which costs the same with gossip off), and on a
multi-rank site what torch.distributed's own threads spend (:class:`CollectiveThreads`):
gloo runs a collective on them, not on the thread that called it (2,000 all-reduces of
5,210 floats between two ranks: 0.96 CPU-s in all, 0.05 of it on the caller's thread).
Charged to gossip, that starved a 2-rank site of pushes (held 4.7 s each, 0.3 acknowledged
a second against its peers' 5) while its peers' pushes piled weight on it. Everything
else the process spends is gossip: the network side's threads and those merges and
snapshots. While the trainer does not step
(start-up, paused, training done) nothing is held: there is nothing to starve.

Refusals are not gossip. A member reopening refused streams in a loop made the sites
refuse 900 streams a second each; charged to gossip, that CPU held every honest push for
4.5 s instead of 0.3 s, so the attacker chose how fast the mesh gossiped, and holding
pushes does not make anyone refuse less. What a refusal costs cannot be told apart from
gossip by measuring: most of it is grpc's (a call's set-up and tear-down on the event
loop, TLS and HTTP/2 on its own threads), spread over up to a second when the answer is
held (measured: about 0.5 ms a refusal on two cores, 0.09 ms of it in the servicer). So
while the node refuses (:meth:`CpuBudget.refused`, and ``REFUSAL_SPAN_S`` after),
gossip is charged what its pushes cost before the refusals began (the moving mean of
gossip CPU per push, learned while nothing was refused) for each push it makes, and the
rest of the process's CPU counts as refusing: gossip keeps its pace and its share
whatever the refusals cost on top.
"""

from __future__ import annotations

import collections
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

WINDOW_S = 2.0  # the share exported as a gauge is measured over about this much of the past
SAMPLE_S = 0.1  # a new sample is taken at most this often
HOLD_POLL_S = 0.02  # a held push looks again at least this often
CREDIT_S = 2.0  # most credit saved: this many seconds of the share
DEBT_S = 10.0  # most debt kept: this many seconds of the share
PUSH_COST_WEIGHT = 0.25  # weight of the latest push in the moving mean of what one costs
NAME_LOOKS = 5  # a thread's name is read this many times (samples) before it is let be
REFUSAL_SPAN_S = 2.0  # a refusal's CPU is spent within this long of it (a held answer: 1 s)


def available_cpus(cgroup: Path = Path("/sys/fs/cgroup/cpu.max")) -> float:
    """The cores this process may use: its CPU affinity, or a cgroup v2 quota if lower."""
    cpus = float(len(os.sched_getaffinity(0)))
    try:
        quota, period = cgroup.read_text().split()[:2]
    except (OSError, ValueError):
        return cpus
    if quota == "max":
        return cpus
    try:
        return max(0.01, min(cpus, int(quota) / int(period)))
    except (ValueError, ZeroDivisionError):
        return cpus


class CollectiveThreads:
    """The CPU this process's torch.distributed threads have spent, from /proc (Linux;
    elsewhere 0, and a multi-rank site's collectives count as gossip there).

    Known by their names, which torch and gloo give them (``gloo_tcp_loop``,
    ``pt_gloo_runloop``, ``pt_nccl_*``, ``pt_tcpstore_*``). A thread that exits keeps
    what it spent in the total, so the total never falls."""

    PREFIXES = ("gloo", "pt_gloo", "pt_nccl", "pt_tcpstore", "nccl")

    def __init__(self, tasks: Path = Path("/proc/self/task")) -> None:
        self._tasks = tasks
        self._ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._spent: dict[str, int] = {}  # collective thread id → ticks last read
        # Other thread id → how often its name was read. Torch names its threads after
        # starting them (one seen at once is "python"), so a name is read a few times
        # before the thread is taken for another; reading every thread's name at every
        # sample cost 0.4 ms with 26 threads, 7% of the default share on a 2-core site.
        self._others: dict[str, int] = {}

    def cpu_s(self) -> float:
        try:
            tids = os.listdir(self._tasks)
        except OSError:
            return 0.0
        for tid in tids:
            if self._others.get(tid, 0) >= NAME_LOOKS:
                continue
            if tid in self._spent or self._named_collective(tid):
                try:
                    fields = (self._tasks / tid / "stat").read_text().rsplit(")", 1)[1].split()
                    self._spent[tid] = int(fields[11]) + int(fields[12])  # utime + stime
                except (OSError, IndexError, ValueError):
                    pass  # exited since the listing: its last reading stays
        return sum(self._spent.values()) / self._ticks

    def _named_collective(self, tid: str) -> bool:
        try:
            name = (self._tasks / tid / "comm").read_text().strip()
        except OSError:
            return False
        if name.startswith(self.PREFIXES):
            self._others.pop(tid, None)
            return True
        self._others[tid] = self._others.get(tid, 0) + 1
        return False


class _Point(NamedTuple):
    """The counters at one moment: wall clock, then totals since the start of process CPU,
    training CPU, pushes released and CPU counted as refusing."""

    wall: float
    cpu: float
    training: float
    pushes: int
    refusing: float


class CpuBudget:
    """Gossip's share of the node's CPU, and whether a push may go now."""

    def __init__(
        self,
        share: float,
        *,
        cpus: float | None = None,
        process_cpu: Callable[[], float] = time.process_time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``share`` in (0, 1]; 1 never holds a push (the share is still measured).
        ``cpus``: the cores the node may use (default: :func:`available_cpus`)."""
        self.share = share
        self.cpus = cpus or available_cpus()
        self._process_cpu = process_cpu
        self._clock = clock
        self.training_cpu_s = 0.0  # added to by the trainer thread only
        # Set by a multi-rank site: its collectives' threads' CPU is training too.
        self.collectives: CollectiveThreads | None = None
        self.training = False  # the trainer is stepping (set and cleared by the trainer)
        self.held_pushes = 0  # pushes that waited for the budget (for summary.json)
        self.pushes = 0  # pushes released
        self.refusing_cpu_s = 0.0  # CPU spent refusing, as of the last sample: not gossip's
        self._last_refusal = -math.inf  # when the node last refused a request
        # oldest first, about WINDOW_S of them
        self._samples: collections.deque[_Point] = collections.deque()
        self._last_share = 0.0
        self.share_while_training = 0.0  # the last share measured while the trainer stepped
        self._gossip_s_training = 0.0  # gossip CPU between samples taken while it stepped
        self._wall_s_training = 0.0  # and the wall time between them
        # CPU-seconds gossip may still spend (below 0: a debt), as of the last sample
        self._credit = 0.0
        self._push_cpu_s = 0.0  # gossip CPU between one push and the next (a moving mean)
        self._push_cost_learned = False  # it was measured while nothing was refused
        self._last_release: _Point | None = None
        self._lock = threading.Lock()  # the loop (metrics, pushes) and the trainer (summary) ask

    def add_training(self, cpu_s: float) -> None:
        """CPU the trainer thread just spent on training (not on gossip)."""
        self.training_cpu_s += cpu_s

    def refused(self) -> None:
        """The node refused a request: for ``REFUSAL_SPAN_S`` gossip is charged per push."""
        self._last_refusal = self._clock()

    def _quiet_since(self, wall: float) -> bool:
        """No refusal spent CPU after ``wall``."""
        return self._last_refusal + REFUSAL_SPAN_S <= wall

    def gossip_share(self) -> float:
        """Gossip's CPU over the last window, as a share of the node's cores' time."""
        with self._lock:
            return self._sample(self._clock())

    @staticmethod
    def _gossip_s(first: _Point, last: _Point) -> float:
        """Gossip's CPU between two points: neither training nor refusing."""
        return (
            (last.cpu - first.cpu)
            - (last.training - first.training)
            - (last.refusing - first.refusing)
        )

    def _point(self, now: float) -> _Point:
        """The counters at ``now``. Since the last sample, while the node refused, gossip
        is charged its pushes at what one cost before and the rest counts as refusing
        (until a push's cost was learned, all of it is gossip's, as it was before)."""
        cpu, training, pushes = self._process_cpu(), self.training_cpu_s, self.pushes
        if self.collectives is not None:
            training += self.collectives.cpu_s()
        refusing = self.refusing_cpu_s
        if self._samples and self._push_cost_learned:
            last = self._samples[-1]
            if not self._quiet_since(last.wall):
                spent = (cpu - last.cpu) - (training - last.training)
                charged = min(spent, (pushes - last.pushes) * self._push_cpu_s)
                refusing += max(0.0, spent - charged)
        return _Point(now, cpu, training, pushes, refusing)

    def _sample(self, now: float) -> float:
        samples = self._samples
        if not samples or now - samples[-1].wall >= SAMPLE_S:
            sample = self._point(now)
            self.refusing_cpu_s = sample.refusing
            if samples and self.training:
                prev = samples[-1]
                gossip_s = self._gossip_s(prev, sample)
                self._gossip_s_training += gossip_s
                self._wall_s_training += now - prev.wall
                rate = self.share * self.cpus
                earned = self._credit + rate * (now - prev.wall) - gossip_s
                self._credit = min(rate * CREDIT_S, max(-rate * DEBT_S, earned))
            samples.append(sample)
            while len(samples) > 2 and now - samples[1].wall >= WINDOW_S:
                samples.popleft()
            first, last = samples[0], samples[-1]
            wall = last.wall - first.wall
            gossip = self._gossip_s(first, last)
            self._last_share = min(1.0, max(0.0, gossip / (wall * self.cpus))) if wall > 0 else 0.0
            if self.training:
                self.share_while_training = self._last_share
        return self._last_share

    def mean_share_while_training(self) -> float:
        """Gossip's CPU as a share of the cores' time, over all the time the trainer has
        stepped so far (the run's figure; :meth:`gossip_share` is the last window's)."""
        with self._lock:
            self._sample(self._clock())
            wall = self._wall_s_training * self.cpus
            return min(1.0, max(0.0, self._gossip_s_training / wall)) if wall > 0 else 0.0

    def wait_s(self) -> float:
        """How much longer a push should wait before it goes: 0 while the trainer does
        not step; else until the credit (earned at share × cores CPU-seconds a second,
        at most ``CREDIT_S`` of it saved, at most ``DEBT_S`` owed), less what the pushes
        released since the last sample will cost, covers what a push costs (or the most
        that can be saved, for a push that costs more).

        A token bucket: a burst of pushes goes at once while the saved credit lasts, so
        persyn's sub-rounds are not spread over its deadlines (a turn per push, the cost
        of one push at the share's rate, held a 3 ms `mnist1d` burst's second push some
        80 ms: its burst went partial and took no outer step, at 1.7% of the cores); lumpy
        pushes that cost the whole bucket go one at a time, at the interval they cost.
        Over any stretch of T seconds gossip spends at most share × cores × (T +
        ``CREDIT_S``) plus one push; over the run, the share. The very first push goes
        at once."""
        if self.share >= 1.0 or not self.training:
            return 0.0
        with self._lock:
            now = self._clock()
            self._sample(now)
            rate = self.share * self.cpus
            need = min(self._push_cpu_s, rate * CREDIT_S)
            # The pushes released since the last sample are charged at once, at what one
            # costs, so that a burst stops at the credit before their CPU shows in a sample.
            unsampled = (self.pushes - self._samples[-1].pushes) * self._push_cpu_s
            short = need + unsampled - self._credit
            if short <= 0.0:
                return 0.0
            return max(0.0, short / rate - (now - self._samples[-1].wall))

    def released(self) -> None:
        """A push went now (held or not): what gossip spent since the one before, while
        the trainer stepped and nothing was refused, updates what a push costs."""
        with self._lock:
            self.pushes += 1
            now = self._point(self._clock())
            last = self._last_release
            if last is not None and self.training and self._quiet_since(last.wall):
                spent = max(0.0, (now.cpu - last.cpu) - (now.training - last.training))
                self._push_cpu_s += PUSH_COST_WEIGHT * (spent - self._push_cpu_s)
                self._push_cost_learned = True
            self._last_release = now

    def held(self) -> None:
        """A push waited for the budget before going."""
        self.held_pushes += 1
