"""The all-reduce baseline's communication: joining the group, the gradient hook that
models link latency, the stop flag, and naming the site that left when a collective fails.

Every collective here is blocking and timed, so ``wait_s`` is exactly the time the
trainer spent communicating. Liveness is a counter each site bumps in the rendezvous
store (hosted by rank 0) from a thread: a collective that fails does not say which
peer broke it, the counters do.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at run
# time and refuses them as strings.
import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from gossipd.node.errors import GossipdError

log = logging.getLogger("gossipd.node.baselines.allreduce")

KEY = "gossipd/allreduce"
BEAT_INTERVAL_S = 0.5
# A site whose counter has not moved in this long after a failed collective is gone
# (six beats: a thread starved for a moment on a loaded machine is not taken for dead).
SILENCE_S = 3.0
STORE_PROBE_TIMEOUT_S = 5.0


class GroupLost(GossipdError):
    """A site left the all-reduce group; the synchronous baseline cannot go on without it."""


def split_master(master: str) -> tuple[str, int]:
    host, _, port = master.rpartition(":")
    return host.strip("[]"), int(port)


def rendezvous(master: str, rank: int, world: int, timeout_s: float) -> dist.TCPStore:
    """The store every site meets at, once all ``world`` sites are there.

    Waiting for everyone here, with ``timeout_s`` (``join_timeout_s``), lets the
    process group itself use the shorter collective timeout: gloo's own start-up
    waits for its peers only that long.
    """
    host, port = split_master(master)
    try:
        store = dist.TCPStore(
            host,
            port,
            world,
            is_master=rank == 0,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except (RuntimeError, dist.DistError) as err:
        if rank == 0:
            raise GossipdError(
                f"allreduce.master = {master!r}: the site with job.shard_index = 0 hosts the "
                f"rendezvous there but cannot listen: {first_line(err)}; use an address of "
                "this machine and a free port"
            ) from None
        raise GossipdError(
            f"allreduce.master = {master!r}: the site with job.shard_index = 0 did not answer "
            f"within join_timeout_s = {timeout_s:g} s ({first_line(err)}); start it, or check "
            "the address and firewalls"
        ) from None
    if rank == 0:
        store.set(f"{KEY}/world", str(world))
    try:
        store.wait([f"{KEY}/world"])
        theirs = int(store.get(f"{KEY}/world"))
        if theirs != world:
            raise GossipdError(
                f"job.num_shards = {world}, but the site with job.shard_index = 0 has "
                f"{theirs}; every site of the all-reduce group sets the same job.num_shards"
            )
        if store.add(f"{KEY}/rank/{rank}", 1) > 1:
            raise GossipdError(
                f"job.shard_index = {rank} is taken by another site in the all-reduce group at "
                f"{master}; give each site its own shard_index in 0..{world - 1}"
            )
        if store.add(f"{KEY}/joined", 1) == world:
            store.set(f"{KEY}/all-joined", "1")
        store.wait([f"{KEY}/all-joined"])
    except dist.DistError as err:
        joined = _try(lambda: store.add(f"{KEY}/joined", 0))
        raise GossipdError(
            f"only {joined} of {world} sites joined the all-reduce group at {master} within "
            f"join_timeout_s = {timeout_s:g} s ({first_line(err)}); start every site with "
            f"job.num_shards = {world} and its own job.shard_index"
        ) from None
    return store


def _try(read: Callable[[], object]) -> str:
    try:
        return str(read())
    except (RuntimeError, dist.DistError):
        return "?"


def first_line(err: BaseException) -> str:
    """torch's error without its source location and advice: the part an operator needs."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    text = re.sub(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", text)
    return text.split(". This is typically")[0][:300]


class Collectives:
    """The collectives the baseline runs, each timed into ``wait_s``.

    ``latency_s`` is the one-way delay of ``[link] latency_ms``. A ring all-reduce
    is 2(N−1) sequential hops (reduce-scatter, then all-gather), so each gradient
    bucket first sleeps 2(N−1)·latency: what the same latency costs a real ring.
    """

    def __init__(self, world: int, latency_s: float) -> None:
        self.world = world
        self.bucket_delay_s = 2 * (world - 1) * latency_s
        self.wait_s = 0.0

    @contextlib.contextmanager
    def _timed(self) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.wait_s += time.perf_counter() - started

    def gradient_hook(
        self, state: object, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        """DDP communication hook: delay, all-reduce, average; blocking, so it is timed whole."""
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(self.average(bucket.buffer()))
        return done

    def average(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` averaged over every site, in place, after the ring's latency."""
        with self._timed():
            if self.bucket_delay_s:
                time.sleep(self.bucket_delay_s)
            dist.all_reduce(tensor)
            if tensor.is_cuda:
                torch.cuda.synchronize(tensor.device)
        return tensor.div_(self.world)

    def broadcast_from_rank0(self, tensors: list[torch.Tensor]) -> None:
        """Overwrite ``tensors`` with rank 0's, in place (one start for every site)."""
        with self._timed():
            for tensor in tensors:
                dist.broadcast(tensor, src=0)

    def stop_flags(self, done: bool, signalled: bool) -> tuple[bool, bool]:
        """(training done, a site was signalled), the maximum over all sites."""
        flags = torch.tensor([int(done), int(signalled)], dtype=torch.int32)
        with self._timed():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0]), bool(flags[1])

    def rank0_schedule(self, values: list[float]) -> list[float]:
        """Rank 0's ``values`` on every site: it alone decides when training ends."""
        tensor = torch.tensor(values, dtype=torch.float64)
        with self._timed():
            dist.broadcast(tensor, src=0)
        return tensor.tolist()


class Heartbeats:
    """Each site's counter in the rendezvous store, bumped from a thread every half second."""

    def __init__(self, master: str, rank: int, world: int) -> None:
        self.host, self.port = split_master(master)
        self.rank = rank
        self.world = world
        self._stop = threading.Event()
        self._probe: dist.TCPStore | None = None  # the diagnosis's own client
        self._store: dist.TCPStore | None = self._client()
        # Not a daemon: interpreter exit waits for it. A daemon thread still inside a store
        # call when the interpreter finalizes is ended there by pthread_exit, which C++
        # cannot unwind through (pybind11 takes the GIL back in a noexcept destructor):
        # std::terminate, SIGABRT, "terminate called without an active exception".
        self._thread = threading.Thread(target=self._beat, name="allreduce-heartbeat")
        self._thread.start()

    def _client(self) -> dist.TCPStore:
        return dist.TCPStore(
            self.host,
            self.port,
            self.world,
            is_master=False,
            timeout=timedelta(seconds=STORE_PROBE_TIMEOUT_S),
            wait_for_workers=False,
        )

    def _beat(self) -> None:
        store = self._store
        while store is not None and not self._stop.wait(BEAT_INTERVAL_S):
            try:
                store.add(f"{KEY}/beat/{self.rank}", 1)
            except (RuntimeError, dist.DistError):
                return  # rank 0, which hosts the store, is gone: the next collective says so

    def close(self) -> None:
        """Stop and join the beat thread, then drop the store clients.

        Bounded: a beat in flight ends within the store timeout. Should the join still
        time out, the thread, not a daemon, ends before the interpreter finalizes.
        """
        self._stop.set()
        self._thread.join(timeout=STORE_PROBE_TIMEOUT_S + BEAT_INTERVAL_S)
        if self._thread.is_alive():
            log.warning(
                "the heartbeat thread did not stop within %g s; exit waits for its last beat",
                STORE_PROBE_TIMEOUT_S + BEAT_INTERVAL_S,
            )
        self._store = None
        self._probe = None

    def gone(self) -> list[int]:
        """Ranks that stopped beating (rank 0 when its store does not answer at all).

        Takes :data:`SILENCE_S`; this site keeps beating meanwhile, so the other
        survivors, diagnosing at the same time, do not count it as gone.
        """
        try:
            self._probe = self._client()
            keys = [f"{KEY}/beat/{r}" for r in range(self.world)]
            before = [self._probe.add(k, 0) for k in keys]
            time.sleep(SILENCE_S)
            after = [self._probe.add(k, 0) for k in keys]
        except (RuntimeError, dist.DistError):
            self._probe = None  # asked no more: each try would wait for the timeout again
            return [0]
        return [r for r in range(self.world) if r != self.rank and after[r] == before[r]]

    def left_on_purpose(self, rank: int) -> bool:
        """Whether ``rank`` said it stopped because it lost the group (after :meth:`gone`)."""
        if self._probe is None:
            return False
        try:
            return bool(self._probe.check([f"{KEY}/left/{rank}"]))
        except (RuntimeError, dist.DistError):
            return False

    def announce_left(self) -> None:
        """Tell sites still diagnosing that this one stopped on purpose (not a crash)."""
        if self._probe is not None:
            with contextlib.suppress(RuntimeError, dist.DistError):
                self._probe.set(f"{KEY}/left/{self.rank}", "1")
