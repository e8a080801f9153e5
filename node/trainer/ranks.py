"""A site of several processes: torch.distributed inside, gossip between sites.

Every rank trains on its own slice of the site's shard and all-reduces gradients
in ``optimizer.step`` (a step pre-hook, so any job that calls its optimizer works),
which keeps the ranks' parameters bit-identical without any broadcast. Rank 0 is
the site's gossip member: it alone runs the daemon, and merges, restores and a
joiner's bootstrap change only its copy. So rank 0 drives the others with one small
command per step (:class:`Leader`): "step", "evaluate", "stop" or, while it does not
step, "idle" (a heartbeat, so a paused site does not trip the collective timeout),
each with a flag saying whether its parameters (and, the first time, its optimizer
state) follow. Parameters travel only when something was merged, counted by
``FlatModel.version``.

A rank that dies or hangs fails the next collective, at once (its sockets close)
or after ``[ranks] collective_timeout_s``: rank 0's trainer then fails and the site
shuts down as after any trainer failure (leave, final checkpoint, exit 1); the other
ranks see rank 0 go and exit 1. Nothing waits for ever.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gossipd.node.errors import ConfigError, GossipdError
from gossipd.node.jobs.registry import Job, JobSpec
from gossipd.node.model.segments import FlatModel
from gossipd.node.shared.config import NodeConfig

log = logging.getLogger(__name__)

STEP, IDLE, EVALUATE, STOP = 1, 2, 3, 4
NO_SYNC, PARAMETERS, EVERYTHING = 0, 1, 2  # what follows a command
RANKS_DIR = "ranks"  # under data_dir: rank-R.json (latest) and rank-R.jsonl (every evaluation)


class RankError(GossipdError):
    """A collective failed: a rank of this site died, hung or cannot be reached."""


@dataclass(frozen=True)
class RankEnv:
    """Where this process sits in its site, from torchrun's variables (or ``--ranks``)."""

    rank: int
    world: int
    local_rank: int

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> RankEnv | None:
        """None for a one-process site (no WORLD_SIZE, or 1)."""
        try:
            world = int(environ.get("WORLD_SIZE", "1"))
            rank = int(environ.get("RANK", "0"))
            local = int(environ.get("LOCAL_RANK", str(rank)))
        except ValueError as err:
            raise ConfigError(
                f"torch.distributed environment: {err}; RANK, WORLD_SIZE and "
                "LOCAL_RANK must be integers (torchrun sets them)"
            ) from None
        if world <= 1:
            return None
        if not 0 <= rank < world:
            raise ConfigError(f"RANK={rank} is outside 0..{world - 1} (WORLD_SIZE={world})")
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not environ.get(k)]
        if missing:
            raise ConfigError(
                f"WORLD_SIZE={world} but {' and '.join(missing)} unset: start a multi-rank "
                "site with torchrun or `gossipd node --ranks R`"
            )
        return cls(rank, world, local)

    def job_spec(self, spec: JobSpec) -> JobSpec:
        """This rank's slice: site shard s of S becomes shard s·R + r of S·R."""
        return JobSpec(
            name=spec.name,
            seed=spec.seed,  # the same init on every rank; rank 0's state is sent anyway
            shard_index=spec.shard_index * self.world + self.rank,
            num_shards=spec.num_shards * self.world,
            learning_rate=spec.learning_rate,
            batch_size=spec.batch_size,
            options=dict(spec.options),
            device=f"cuda:{self.local_rank}" if spec.device == "cuda" else spec.device,
        )


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def backend_for(config: NodeConfig, device: torch.device) -> str:
    """auto: NCCL when the job's model lives on a GPU (the job puts it there), else gloo."""
    wanted = config.ranks.backend
    if wanted == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if wanted == "nccl" and device.type != "cuda":
        raise ConfigError(
            f'ranks.backend = "nccl" needs the job\'s model on a GPU, and it is on {device}; '
            'use "gloo" (or "auto"), or a job that places its model on cuda:LOCAL_RANK'
        )
    return wanted


def join_group(config: NodeConfig, env: RankEnv, device: torch.device) -> str:
    """Join the site's process group (MASTER_ADDR/MASTER_PORT); returns the backend."""
    backend = backend_for(config, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=config.ranks.collective_timeout_s)
    dist.init_process_group(
        backend, init_method="env://", rank=env.rank, world_size=env.world, timeout=timeout
    )
    log.info(
        "rank %d of %d joined site %s's process group (%s, collective timeout %g s)",
        env.rank,
        env.world,
        config.node_id,
        backend,
        config.ranks.collective_timeout_s,
    )
    return backend


def sync_gradients(optimizer: torch.optim.Optimizer, world: int) -> None:
    """Average gradients over the site's ranks just before every ``optimizer.step``.

    One flat all-reduce per step: every rank has the same model, so the same
    parameters have gradients, in the same order, and the flat layouts agree.
    """

    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        grads = [p.grad for group in opt.param_groups for p in group["params"]]
        present = [g for g in grads if g is not None]
        if not present:
            return
        flat = torch._utils._flatten_dense_tensors(present)
        _collective(lambda: dist.all_reduce(flat), "all-reducing gradients")
        flat.div_(world)
        for grad, synced in zip(
            present, torch._utils._unflatten_dense_tensors(flat, present), strict=True
        ):
            grad.copy_(synced)

    optimizer.register_step_pre_hook(hook)


def _collective(call: Callable[[], object], what: str) -> None:
    try:
        call()
    except (RuntimeError, dist.DistBackendError) as err:
        raise RankError(
            f"{what} failed: a rank of this site died, hung past ranks.collective_timeout_s "
            f"or cannot be reached ({err}); the site stops"
        ) from err


def _broadcast_state(
    flat: FlatModel, optimizer: torch.optim.Optimizer, level: int, device: torch.device
) -> None:
    for buffer in flat.buffers:
        _collective(lambda b=buffer: dist.broadcast(b, src=0), "broadcasting parameters")
    if level == EVERYTHING:
        box: list[Any] = [optimizer.state_dict() if dist.get_rank() == 0 else None]
        _collective(
            lambda: dist.broadcast_object_list(box, src=0, device=device),
            "broadcasting optimizer state",
        )
        if dist.get_rank() != 0:
            optimizer.load_state_dict(box[0])


def write_record(data_dir: Path, rank: int, record: dict[str, Any]) -> None:
    """``ranks/rank-R.json`` (the latest) and one line in ``rank-R.jsonl`` per evaluation."""
    folder = data_dir / RANKS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record, sort_keys=True)
    with open(folder / f"rank-{rank}.jsonl", "a") as f:
        f.write(line + "\n")
    tmp = folder / f".rank-{rank}.json.tmp"
    tmp.write_text(line)
    os.replace(tmp, folder / f"rank-{rank}.json")


def read_records(data_dir: Path) -> list[dict[str, Any]]:
    """Every rank's latest record, by rank (empty for a one-process site)."""
    folder = Path(data_dir) / RANKS_DIR
    records = [json.loads(p.read_text()) for p in sorted(folder.glob("rank-*.json"))]
    return sorted(records, key=lambda r: r["rank"])


def rank_record(
    rank: int, step: int, flat: FlatModel, result: Mapping[str, float]
) -> dict[str, Any]:
    return {
        "rank": rank,
        "step": step,
        "unix_s": time.time(),
        "model_checksum": flat.checksum(),
        **{k: float(v) for k, v in result.items()},
    }


class Leader:
    """Rank 0's side: one command per step to the other ranks, parameters when they moved.

    Called only from the trainer thread, so the collectives are issued in one order.
    """

    def __init__(
        self,
        flat: FlatModel,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        *,
        heartbeat_s: float,
    ) -> None:
        self.flat = flat
        self.optimizer = optimizer
        self.device = device
        self.heartbeat_s = heartbeat_s
        self.sent_version: int | None = None  # None: nothing sent yet (everything goes first)
        self.last_sent = time.monotonic()
        self.stopped = False
        self.broken = False
        self.broadcasts = 0

    def _send(self, action: int, step: int) -> None:
        if self.sent_version is None:
            level = EVERYTHING
        elif self.sent_version != self.flat.version:
            level = PARAMETERS
        else:
            level = NO_SYNC
        command = torch.tensor([action, level, step], dtype=torch.int64, device=self.device)
        try:
            _collective(lambda: dist.broadcast(command, src=0), "sending a command to the ranks")
            if level != NO_SYNC:
                _broadcast_state(self.flat, self.optimizer, level, self.device)
                self.broadcasts += 1
        except RankError:
            self.broken = True
            raise
        self.sent_version = self.flat.version
        self.last_sent = time.monotonic()

    def before_step(self, step: int) -> None:
        self._send(STEP, step)

    def tick(self, step: int) -> None:
        """While not stepping: a heartbeat now and then, and parameters that moved."""
        if self.stopped or self.broken:
            return
        moved = self.sent_version is not None and self.sent_version != self.flat.version
        if moved or time.monotonic() - self.last_sent >= self.heartbeat_s:
            self._send(IDLE, step)

    def evaluate(self, step: int) -> None:
        self._send(EVALUATE, step)

    def stop(self, step: int) -> None:
        """The other ranks evaluate the final model and exit; idempotent, skipped if broken."""
        if self.stopped or self.broken:
            return
        self._send(STOP, step)
        self.stopped = True
        log.info("told the site's other ranks to stop at step %d", step)


def end_leader(leader: Leader, step: int, trainer_alive: bool) -> None:
    """After the site's loop: stop the other ranks if the trainer never did (the site
    failed before training started), then leave the process group."""
    if not trainer_alive and not (leader.stopped or leader.broken):
        try:
            leader.stop(step)
        except RankError as err:
            log.warning("could not stop the other ranks: %s", err)
    if not trainer_alive and dist.is_initialized():
        dist.destroy_process_group()


def follow(config: NodeConfig, env: RankEnv, build: Callable[[JobSpec], Job]) -> int:
    """A rank other than 0: train when rank 0 says, load what it sends, never open a port."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _waiting_for_leader(env.rank))
    job = build(env.job_spec(_site_spec(config)))
    device = model_device(job.model)
    join_group(config, env, device)
    flat = FlatModel(job.model, config.gossip.segment_bytes)
    sync_gradients(job.optimizer, env.world)
    data_dir = Path(config.data_dir)
    command = torch.zeros(3, dtype=torch.int64, device=device)
    steps = 0
    try:
        while True:
            _collective(lambda: dist.broadcast(command, src=0), "waiting for rank 0")
            action, level, step = (int(v) for v in command.tolist())
            if level != NO_SYNC:
                _broadcast_state(flat, job.optimizer, level, device)
            if action == STEP:
                job.train_step()
                steps = step + 1
            elif action == EVALUATE:
                record = rank_record(env.rank, step, flat, job.evaluate())
                write_record(data_dir, env.rank, record)
            elif action == STOP:
                log.info("rank %d stopped by rank 0 at step %d", env.rank, step)
                return 0
    except RankError as err:
        log.error("rank %d (after %d steps): %s", env.rank, steps, err)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _waiting_for_leader(rank: int) -> Callable[[int, Any], None]:
    """Rank 0 ends the site (it holds the model and the checkpoint): a signal here only
    says so, and the rank goes on until rank 0's stop arrives or rank 0 is gone."""

    def handler(signum: int, frame: Any) -> None:
        log.info(
            "rank %d got signal %d: it stops when rank 0 stops the site (or within "
            "ranks.collective_timeout_s if rank 0 is gone)",
            rank,
            signum,
        )

    return handler


def _site_spec(config: NodeConfig) -> JobSpec:
    j = config.job
    return JobSpec(
        name=j.name,
        seed=j.seed,
        shard_index=j.shard_index,
        num_shards=j.num_shards,
        learning_rate=j.learning_rate,
        batch_size=j.batch_size,
        options=dict(j.options),
        device=j.device,  # "cuda" is made a GPU index by site_spec or RankEnv.job_spec
    )


def site_spec(config: NodeConfig, env: RankEnv | None) -> JobSpec:
    """The JobSpec this process trains: the site's, or this rank's slice of it."""
    spec = _site_spec(config)
    if env is not None:
        return env.job_spec(spec)
    return dataclasses.replace(spec, device="cuda:0") if spec.device == "cuda" else spec
