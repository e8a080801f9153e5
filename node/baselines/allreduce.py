"""The synchronous baseline (``gossip.protocol = "allreduce"``): plain torch DDP across
all sites in one process group, the reference every benchmark compares gossip with.

For benchmarks and comparisons only. There is no gRPC server and no gossip: every
site waits for the slowest one at every step, and one site that dies stops them all.
Rank is ``job.shard_index``, world size ``job.num_shards``; the site with rank 0
hosts the rendezvous at ``[allreduce] master``. DDP broadcasts rank 0's initial
model, so all sites start from one model and stay bit-identical.

The site writes what a gossip site writes to ``data_dir`` (``history.jsonl``,
``summary.json`` with ``sum_weights: []`` and a ``model_checksum``, ``node.json``
with no address), so tools read both alike. No checkpoints: a restarted group
starts from scratch.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any, ClassVar

import torch.distributed as dist
from torch import nn

from gossipd.node.baselines.allreduce_comm import (
    Collectives,
    GroupLost,
    Heartbeats,
    first_line,
    rendezvous,
)
from gossipd.node.errors import ConfigError
from gossipd.node.jobs.registry import build_job
from gossipd.node.shared.config import NodeConfig
from gossipd.node.shared.config_ranks import ALLREDUCE
from gossipd.node.shared.statefiles import write_json
from gossipd.node.trainer.ranks import site_spec

log = logging.getLogger("gossipd.node.baselines.allreduce")

CHECK_EVERY_STEPS = 10  # steps between the stop-flag all-reduces (every site must agree)


def run_allreduce(config: NodeConfig) -> int:
    """``gossipd node`` for ``gossip.protocol = "allreduce"``: 0 once the group stopped
    together, 1 when a site left it (one line on stderr says which)."""
    return run_group_site(AllreduceSite(config))


def run_group_site(site: AllreduceSite) -> int:
    """Run one baseline site: 0 once the group stopped together, 1 (one line on stderr)
    when a site left it."""
    try:
        site.run()
    except GroupLost as err:
        print(f"gossipd: {err}", file=sys.stderr)
        return 1
    return 0


def drop_frame_locals(err: BaseException) -> None:
    """Clear the locals of every finished frame ``err`` (and the errors it chains) passed
    through; its traceback still prints every line.

    A traceback keeps those frames, and what their locals hold, alive as long as the error
    is: to the end of the handler that catches it, or to interpreter exit for one that
    nobody catches. Cleared, they no longer hold DDP, the group or the store.
    """
    chained: BaseException | None = err
    while chained is not None:
        traceback.clear_frames(chained.__traceback__)
        chained = chained.__context__


def resolve_backend(backend: str, model: nn.Module) -> str:
    """``[ranks] backend``; auto: nccl when the model is on CUDA, else gloo."""
    on_cuda = any(p.is_cuda for p in model.parameters())
    if backend == "auto":
        return "nccl" if on_cuda else "gloo"
    if backend == "nccl" and not on_cuda:
        raise ConfigError(
            "ranks.backend = nccl, but the job's model is on the CPU; nccl only reduces CUDA "
            'tensors: use backend = "gloo" or "auto"'
        )
    return backend


def model_checksum(model: nn.Module) -> str:
    """sha256 of the parameters' bytes in order: equal on every site of a healthy group.

    Buffers are left out: BatchNorm's running statistics move with each site's own
    last batch after DDP broadcast rank 0's.
    """
    digest = hashlib.sha256()
    for param in model.parameters():
        digest.update(param.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _check_link(config: NodeConfig) -> None:
    link = config.link
    if link.jitter_ms or link.rate_mbit:
        raise ConfigError(
            f"link.jitter_ms = {link.jitter_ms:g}, link.rate_mbit = {link.rate_mbit:g}: the "
            f"{config.gossip.protocol} baseline models only link.latency_ms; remove the others "
            "(shape bandwidth on the real link, as bench wan does)"
        )


class AllreduceSite:
    """One site of the baseline: joins the group, trains in lockstep, writes its files.

    A baseline that trains another way (:mod:`gossipd.node.baselines.diloco`) keeps the
    group's lifecycle, signals and files and replaces :meth:`_train`.
    """

    protocol: ClassVar[str] = ALLREDUCE
    summary_name: ClassVar[str] = "synchronous"  # "the synchronous baseline cannot continue"

    def __init__(self, config: NodeConfig) -> None:
        _check_link(config)
        self.config = config
        self.rank = config.job.shard_index
        self.world = config.job.num_shards
        self.data_dir = Path(config.data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # One process per site: job.device "cuda" is that process's first GPU.
        self.job = build_job(site_spec(config, None))
        self.model = self.job.model  # the unwrapped module: checksums and what DDP wraps
        self.backend = resolve_backend(config.ranks.backend, self.model)
        self.comm = Collectives(self.world, config.link.latency_ms / 1000.0)
        self.signalled = threading.Event()
        self.steps = 0
        self.loss = math.nan
        self.last_eval: dict[str, float] = {}
        self.last_eval_step: int | None = None
        self.started: float | None = None  # perf_counter at the first step

    @property
    def master(self) -> str:
        """``[<protocol>] master``: where the site with rank 0 hosts the rendezvous."""
        return str(getattr(self.config, self.protocol).master)

    # -- lifecycle ---------------------------------------------------------------------
    def run(self) -> None:
        """Join, train until rank 0 says stop (or a site was signalled), write files, leave.

        Whichever way it ends (stopped together, a site left, an error, a signal), the
        group is gone when this returns or raises: no thread of gloo, of rank 0's store
        server or of the heartbeat is left for interpreter exit, where one that is still
        alive, or an object that owns one, aborted an exit now and then with SIGABRT
        ("terminate called without an active exception").
        """
        self._write_node_json()
        master = self.master
        log.info(
            "site %s: joining the all-reduce group at %s as rank %d of %d (waiting up to %g s "
            "for every site)",
            self.config.node_id,
            master,
            self.rank,
            self.world,
            self.config.join_timeout_s,
        )
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            # Until every site is there nothing needs saving, and the wait is in C++, where
            # a Python signal handler would only run once it ends: SIGTERM and SIGINT end it.
            for sig in handlers:
                signal.signal(sig, signal.SIG_DFL)
            # Rank 0's store is the server every site's clients talk to. Only _in_group's
            # frame holds it, so it goes when that frame does: last, after the group.
            self._in_group(rendezvous(master, self.rank, self.world, self.config.join_timeout_s))
        except BaseException as err:
            drop_frame_locals(err)  # _in_group's frame, and with it the store, goes now
            raise
        finally:
            # The handler closes over this site, and through it DDP and the group: left
            # installed, it kept them alive into interpreter exit (see _leave).
            for sig, handler in handlers.items():
                if handler is not None:  # None: set outside Python, not ours to restore
                    signal.signal(sig, handler)

    def _in_group(self, store: dist.TCPStore) -> None:
        """Form the process group on ``store``, train, write files, leave in order."""
        master = self.master
        ranks = self.config.ranks
        self._catch_signals()
        beats = Heartbeats(master, self.rank, self.world)
        try:
            dist.init_process_group(
                self.backend,
                store=store,
                rank=self.rank,
                world_size=self.world,
                timeout=timedelta(seconds=ranks.collective_timeout_s),
            )
            log.info(
                "joined the all-reduce group: rank %d of %d, backend %s, collective timeout "
                "%g s; gradients cross sites unencrypted (a trusted network only)",
                self.rank,
                self.world,
                self.backend,
                ranks.collective_timeout_s,
            )
            try:
                done = self._train()
            except Exception as err:
                self._lost(beats, err)  # raises GroupLost if a site left; else re-raises
                raise
            self._finish(done)
        except BaseException as err:
            # The frames the error passed through (the step's, the job's) hold DDP, and
            # DDP's reducer holds the group: without them _leave frees both now.
            drop_frame_locals(err)
            raise
        finally:
            self._leave(beats)

    def _leave(self, beats: Heartbeats) -> None:
        """Tear the group down now, in order, while the interpreter is whole.

        Left to interpreter exit, the group's last holder (DDP's reducer) went only in
        finalization, where gloo's worker threads, whose work can hold tensors that need
        the GIL to be freed, aborted one exit in several under load with SIGABRT
        ("terminate called without an active exception"). So: the heartbeat thread stops
        and its store clients go, then DDP, then the group itself, whose destructor joins
        gloo's threads here.
        """
        beats.close()
        self.job.model = self.model
        gc.collect()  # DDP's own reference cycles: its reducer goes now, not at exit
        if dist.is_initialized():
            dist.destroy_process_group()

    def check_every_steps(self) -> int:
        """Steps between the collectives where every site learns whether to stop."""
        return CHECK_EVERY_STEPS

    def _catch_signals(self) -> None:
        def stop(signum: int, frame: FrameType | None) -> None:
            if not self.signalled.is_set():
                log.info(
                    "%s: every site stops at the next check (within %d steps)",
                    signal.Signals(signum).name,
                    self.check_every_steps(),
                )
            self.signalled.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, stop)

    # -- training ----------------------------------------------------------------------
    def _train(self) -> bool:
        """Steps in lockstep; True when rank 0's max_steps or duration_s ended training."""
        ddp = nn.parallel.DistributedDataParallel(
            self.model,
            # The graph is the same every step, and the synthetic job's padding parameter
            # never gets a gradient: a static graph handles that without a graph walk per step.
            static_graph=True,
        )
        ddp.register_comm_hook(None, self.comm.gradient_hook)
        self.job.model = ddp  # the built-in jobs' train_step and evaluate now run through DDP
        job = self.config.job
        # Rank 0's limits and evaluation cadence on every site: each is a point where all
        # sites must run the same collectives (DDP syncs BatchNorm buffers in evaluate too).
        schedule = [float(job.max_steps), job.duration_s, float(job.eval_every_steps)]
        steps_limit, duration_s, every = self.comm.rank0_schedule(schedule)
        max_steps, eval_every = int(steps_limit), int(every)
        done, signalled = self.comm.stop_flags(False, self.signalled.is_set())
        interval_s = self.config.progress_interval_s
        next_line = time.monotonic() + interval_s
        self.started = time.perf_counter()
        while not (done or signalled):
            self.loss = float(self.job.train_step())
            self.steps += 1
            if eval_every and self.steps % eval_every == 0:
                self.evaluate()
            if interval_s and time.monotonic() >= next_line:
                log.info("%s", self._progress_line())
                next_line = time.monotonic() + interval_s
            if self.steps % CHECK_EVERY_STEPS == 0 or self.steps == max_steps:
                ended = self.rank == 0 and (
                    (max_steps and self.steps >= max_steps)
                    or (duration_s and time.perf_counter() - self.started >= duration_s)
                )
                done, signalled = self.comm.stop_flags(bool(ended), self.signalled.is_set())
        return done

    def _finish(self, done: bool) -> None:
        if self.steps and self.last_eval_step != self.steps:
            self.evaluate()
        self._write_summary(training_done=done)
        why = "rank 0's max_steps or duration_s reached" if done else "a site was signalled"
        metrics = ", ".join(f"{k} {v:.4f}" for k, v in sorted(self.last_eval.items()))
        log.info(
            "%s training ended at step %d (%s): %s; waited %.1f s in all-reduce "
            "(%.0f%% of the time); wrote %s",
            self.protocol,
            self.steps,
            why,
            metrics or "no evaluation",
            self.comm.wait_s,
            100 * self.wait_fraction(),
            self.data_dir / "summary.json",
        )

    def _lost(self, beats: Heartbeats, err: Exception) -> None:
        """Raise GroupLost naming the site(s) that left, if any did; else return."""
        log.info("a collective failed (%s); finding which site left", first_line(err))
        gone = beats.gone()
        crashed = [r for r in gone if not beats.left_on_purpose(r)] or gone
        if not crashed:
            return
        beats.announce_left()
        self._write_summary(training_done=False)
        who = (
            f"site with rank {crashed[0]}"
            if len(crashed) == 1
            else f"sites with ranks {', '.join(map(str, crashed))}"
        )
        message = (
            f"{who} left the all-reduce group: {first_line(err)}; the {self.summary_name} baseline "
            "cannot continue without it (stopped at step "
            f"{self.steps}; restart every site to train again)"
        )
        log.error("%s", message)
        raise GroupLost(message) from None

    # -- what an operator and tools read ----------------------------------------------
    def wait_fraction(self) -> float:
        wall = time.perf_counter() - self.started if self.started is not None else 0.0
        return min(self.comm.wait_s / wall, 1.0) if wall > 0 else 0.0

    def _progress_line(self) -> str:
        return (
            f"progress: step {self.steps}, loss {self.loss:.4g}, rank {self.rank} of "
            f"{self.world}, waited {self.comm.wait_s:.1f} s in all-reduce "
            f"({100 * self.wait_fraction():.0f}% of the time)"
        )

    def evaluate(self) -> None:
        self.last_eval = {k: float(v) for k, v in self.job.evaluate().items()}
        self.last_eval_step = self.steps
        line = {"unix_s": time.time(), "step": self.steps, "loss": self.loss, **self.last_eval}
        with open(self.data_dir / "history.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")

    def own_summary(self) -> dict[str, Any]:
        """What this baseline adds to ``summary.json``."""
        return {}

    def _write_summary(self, *, training_done: bool) -> None:
        summary: dict[str, Any] = {
            "node_id": self.config.node_id,
            "protocol": self.protocol,
            "rank": self.rank,
            "world": self.world,
            "steps": self.steps,
            "loss": self.loss,
            "sum_weights": [],
            "wait_s": self.comm.wait_s,
            "wait_fraction": self.wait_fraction(),
            "training_done": training_done,
            "model_checksum": model_checksum(self.model),
            **self.own_summary(),
            **self.last_eval,
        }
        write_json(self.data_dir / "summary.json", summary)

    def _write_node_json(self) -> None:
        write_json(
            self.data_dir / "node.json",
            {"node_id": self.config.node_id, "pid": os.getpid(), "address": None},
        )
