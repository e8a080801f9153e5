"""Gossip for your own training loop: wrap the model and optimizer, call ``step`` once per step.

    from gossipd.node.site.api import GossipNode

    with GossipNode({"mesh_id": "lab", "node_id": "site-a", "seeds": [...]}, model, opt) as g:
        for x, y in loader:
            opt.zero_grad(); loss = loss_fn(model(x), y); loss.backward(); opt.step()
            report = g.step(loss.item())
            if not report.ok:
                print(report.failed, report.rejected)

The network runs on an asyncio loop in a background thread; merges happen
inside ``step`` on the caller's thread, so parameters are only ever written by
the caller. Run the optimizer step inside ``with g.lock:`` if peers must never
pull a half-updated model. Optimizer state stays local; only parameters and
floating-point buffers travel.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Any

import torch

from gossipd.node.errors import GossipdError
from gossipd.node.model.torchthreads import use_for_default_executor
from gossipd.node.net.gossip.leaving import warn_unfinished
from gossipd.node.net.network import Network
from gossipd.node.shared.config import NodeConfig, load_config, parse_config
from gossipd.node.trainer import checkpoint
from gossipd.node.trainer.fairlock import FairLock
from gossipd.node.trainer.replica import Replica
from gossipd.node.trainer.report import StepReport

log = logging.getLogger(__name__)
# How long what is left on the loop after the network closed may take to end by itself.
SETTLE_S = 1.0


class GossipNode:
    def __init__(
        self,
        config: NodeConfig | dict[str, Any] | str | Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        start_timeout_s: float = 30.0,
    ) -> None:
        if isinstance(config, (str, Path)):
            config = load_config(config)
        elif isinstance(config, dict):
            config = parse_config(config, "GossipNode(config=...)")
        self.config = config
        self.optimizer = optimizer
        self.replica = Replica.from_config(config, model)
        self.network = Network(config, self.replica)
        self._loop = asyncio.new_event_loop()
        use_for_default_executor(self._loop)
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"gossipd-{config.node_id}", daemon=True
        )
        self._thread.start()
        self.closed = False
        try:
            self._call(self.network.start(), start_timeout_s)
        except BaseException:
            self.closed = True
            self._stop_loop()
            raise

    def _call(self, coro: Any, timeout_s: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    @property
    def lock(self) -> FairLock:
        return self.replica.lock

    @property
    def address(self) -> str:
        return self.network.address

    @property
    def sum_weights(self) -> list[float]:
        return list(self.replica.summary.weights)

    def step(self, loss: float | None = None) -> StepReport:
        """Merge what peers sent, settle push outcomes, maybe push; say what happened."""
        if self.closed:
            raise GossipdError("GossipNode.step() after close(); create a new GossipNode")
        self.replica.flat.check_bound()
        return self.replica.step(loss)

    def wait_for_peers(self, count: int, timeout_s: float = 30.0) -> bool:
        return bool(self._call(self.network.wait_for_peers(count, timeout_s), timeout_s + 5.0))

    def save_checkpoint(self, directory: str | Path) -> Path:
        """Write ``checkpoint.pt`` atomically; raises CheckpointWriteError, the old file intact."""
        ckpt = checkpoint.capture(self.replica, self.config.node_id, self.optimizer)
        return checkpoint.save(Path(directory), ckpt)

    def close(self, timeout_s: float | None = None) -> None:
        """Hand weight to a peer, say goodbye, stop the network thread; leaves nothing running.

        Call it (or leave the ``with`` block) before the interpreter exits: a loop
        torn down by exit instead prints "Task was destroyed but it is pending!".
        """
        if self.closed:
            return
        self.closed = True
        timeout_s = timeout_s or self.config.shutdown_timeout_s
        try:
            leaving = asyncio.run_coroutine_threadsafe(
                asyncio.wait_for(self.network.leave_mesh(), timeout_s), self._loop
            )
            # The caller's thread is the replica's trainer: it runs the hand-off's merges.
            while not leaving.done():
                self.replica.idle(0.05)
            leaving.result()
        except (TimeoutError, GossipdError) as err:
            warn_unfinished(err, timeout_s)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        """Close the node, then end every task, async generator and worker thread of the loop.

        gRPC cancels handlers still running when its grace ends, but their tasks
        need loop iterations to finish; a loop stopped right away keeps them
        pending until garbage collection complains at exit.
        """
        try:
            self._call(self._finish(), 30.0)
        except TimeoutError:
            log.warning("the network thread of %s did not stop within 30 s", self.config.node_id)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10.0)
            if not self._thread.is_alive():
                self._loop.close()

    async def _finish(self) -> None:
        try:
            await self.network.close(grace_s=0.2)
        finally:
            current = asyncio.current_task()
            # What is left is gRPC's: a handler the server cancelled ends in a loop iteration
            # or two. Cancelling gRPC's own task under it instead printed a bare
            # CancelledError traceback from inside grpc now and then (a CI run, under load).
            rest = [t for t in asyncio.all_tasks() if t is not current]
            if rest:
                await asyncio.wait(rest, timeout=SETTLE_S)
            for _ in range(10):  # a cancelled task may start another; bounded
                rest = [t for t in asyncio.all_tasks() if t is not current]
                if not rest:
                    break
                for task in rest:
                    task.cancel()
                await asyncio.gather(*rest, return_exceptions=True)
            await self._loop.shutdown_asyncgens()
            await self._loop.shutdown_default_executor()

    def __enter__(self) -> GossipNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
