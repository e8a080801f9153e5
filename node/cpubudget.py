"""A node's CPU budget for gossip: pushes wait while gossip took more than its share.

On a site whose cores all train, every CPU-second the daemon spends on gossip
(grpc, TLS, framing, checksums, merges, snapshots) is taken from a trainer.
``gossip.cpu_share`` caps gossip's part of the CPU the node may use (its cores:
the CPU affinity, or a container's CPU quota when that is lower) while the
trainer is stepping: over a sliding window, gossip CPU-seconds ≤ share × cores ×
wall seconds. Over it, pushes are paced: the node's push rate over the window is
scaled by share/measured, so a push waits until that rate's interval has passed
since the last push went. The protocol core meanwhile sees the push still in
flight and starts no new one to that peer (nor beyond
``gossip.max_pushes_in_flight``), so the push *rate* adapts to what pushes really
cost, with no weight lost or duplicated: a held push is an ordinary
unacknowledged push. Gossip that only uses CPU nobody else wants (a GPU trainer,
a cheap step on an idle machine) is never held while it stays under the share of
the whole node.

Pacing, not holding every push while over: gossip CPU includes what peers push
here, so with every node of a mesh holding while over, all of them stop at once,
the share falls, all of them burst at once, and the mesh mixes in bursts with
seconds of nothing between (3 digits sites at 0.03: final consensus distance
0.012 held, 0.0018 paced). Scaling each node's own rate converges on the share
with pushes spread evenly.

Training CPU is what the trainer thread spends on anything but merging inbound
pushes and snapshotting its own (the job's steps, evaluations, checkpoints, a
multi-rank site's collectives, the replica's per-step bookkeeping, which costs the
same with gossip off); everything else the process spends is gossip: the network
side's threads and those merges and snapshots. While the trainer does not step
(start-up, paused, training done) nothing is held: there is nothing to starve.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

WINDOW_S = 2.0  # the share is measured over about this much of the recent past
SAMPLE_S = 0.1  # a new sample is taken at most this often
HOLD_POLL_S = 0.02  # a held push looks again at least this often


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
        self.training = False  # the trainer is stepping (set and cleared by the trainer)
        self.held_pushes = 0  # pushes that waited for the budget (for summary.json)
        self._releases: collections.deque[float] = collections.deque()  # when pushes went
        self._last_release: float | None = None  # the latest, kept after it leaves the window
        # (wall, process CPU, training CPU), oldest first, about WINDOW_S of them
        self._samples: collections.deque[tuple[float, float, float]] = collections.deque()
        self._last_share = 0.0
        self.share_while_training = 0.0  # the last share measured while the trainer stepped
        self._gossip_s_training = 0.0  # gossip CPU between samples taken while it stepped
        self._wall_s_training = 0.0  # and the wall time between them
        self._lock = threading.Lock()  # the loop (metrics, pushes) and the trainer (summary) ask

    def add_training(self, cpu_s: float) -> None:
        """CPU the trainer thread just spent on training (not on gossip)."""
        self.training_cpu_s += cpu_s

    def gossip_share(self) -> float:
        """Gossip's CPU over the last window, as a share of the node's cores' time."""
        with self._lock:
            return self._sample(self._clock())

    def _sample(self, now: float) -> float:
        samples = self._samples
        if not samples or now - samples[-1][0] >= SAMPLE_S:
            sample = (now, self._process_cpu(), self.training_cpu_s)
            if samples and self.training:
                prev = samples[-1]
                self._gossip_s_training += (sample[1] - prev[1]) - (sample[2] - prev[2])
                self._wall_s_training += now - prev[0]
            samples.append(sample)
            while len(samples) > 2 and now - samples[1][0] >= WINDOW_S:
                samples.popleft()
            first, last = samples[0], samples[-1]
            wall = last[0] - first[0]
            gossip = (last[1] - first[1]) - (last[2] - first[2])
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
        """How much longer a push should wait before it goes: 0 under the share, or
        while the trainer does not step; over it, until the interval of the paced rate
        (pushes per second over the window × share / measured) has passed since the
        last push went. With no push in the window that rate is one per window, so over
        the share pushes go at least WINDOW_S × measured / share apart: a node whose
        inbound traffic alone is over its share still moves its weight, but no faster.
        (Letting the first push of every window go at once made one push per window
        the floor: a 17 MB model's pushes, sent and received, then took 8% of a core
        at cpu_share 0.03.) The very first push goes at once."""
        if self.share >= 1.0 or not self.training:
            return 0.0
        with self._lock:
            now = self._clock()
            measured = self._sample(now)
            releases = self._recent(now)
            if measured <= self.share or self._last_release is None:
                return 0.0
            rate = max(len(releases), 1) / WINDOW_S
            interval = (measured / self.share) / rate
            return max(0.0, self._last_release + interval - now)

    def released(self) -> None:
        """A push went now (held or not): the rate the next ones are paced from."""
        with self._lock:
            now = self._clock()
            self._recent(now).append(now)
            self._last_release = now

    def _recent(self, now: float) -> collections.deque[float]:
        """When pushes went within the window (older ones dropped: the record stays
        bounded whether or not anything is paced)."""
        releases = self._releases
        while releases and now - releases[0] > WINDOW_S:
            releases.popleft()
        return releases

    def held(self) -> None:
        """A push waited for the budget before going."""
        self.held_pushes += 1
