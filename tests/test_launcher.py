"""The launcher (`mesh up`) keeps a run whose polls fail for reasons that pass.

On a loaded machine a pull's TLS handshake can fail (``Handshake read failed
(Endpoint closing)``) although the node is alive and well; the launcher used to
exit 2 on the first such failure and throw a finished run away. Here a real TCP
proxy in front of a real daemon closes the launcher's first connections as they
open, which is what those failures look like from the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gossipd.node.errors import GossipdError
from gossipd.node.launch.forked import fork_node
from gossipd.node.launch.localmesh import LocalMesh
from gossipd.node.launch.meshspec import MeshSpec
from gossipd.node.trainer import checkpoint
from tests.daemons import left_running, pipe_holders


class FlakyProxy:
    """Forwards TCP to ``target``, but closes the first ``drops`` connections at once."""

    def __init__(self, target: str, drops: int) -> None:
        self.host, port = target.rsplit(":", 1)
        self.port = int(port)
        self.drops = drops
        self.dropped = 0
        self.forwarded = 0
        self.tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.dropped < self.drops:
            self.dropped += 1
            writer.close()
            return
        self.forwarded += 1
        up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(src, dst))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    @staticmethod
    async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            while data := await src.read(1 << 16):
                dst.write(data)
                await dst.drain()
        dst.close()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> LocalMesh:
    spec = MeshSpec(
        nodes=2,
        job="synthetic",
        learning_rate=0.0,
        push_probability=0.0,
        duration_s=0.0,
        max_steps=0,
        eval_every_steps=0,
        checkpoint_every_steps=0,
    )
    with LocalMesh(spec, tmp_path_factory.mktemp("launcher"), fork_node) as mesh:
        for i in range(spec.nodes):
            mesh.start(i)
        mesh.load_plan()
        asyncio.run(mesh.wait_ready())
        yield mesh


def test_a_pull_whose_connections_are_closed_at_first_is_retried_not_fatal(
    mesh: LocalMesh,
) -> None:
    direct = asyncio.run(mesh.pull_all())

    async def through_proxy() -> tuple[list[torch.Tensor], FlakyProxy]:
        proxy = FlakyProxy(mesh.addresses[1], drops=3)
        real = mesh.addresses[1]
        async with proxy as address:
            mesh.addresses[1] = address  # only the launcher's own calls go through it
            try:
                return await mesh.pull_all(patience_s=60.0), proxy
            finally:
                mesh.addresses[1] = real

    models, proxy = asyncio.run(through_proxy())
    assert proxy.dropped == 3 and proxy.forwarded >= 1
    # Push probability 0 and learning rate 0: nothing moves the models between the pulls.
    assert all(torch.equal(a, b) for a, b in zip(models, direct, strict=True))


def test_a_pull_that_keeps_failing_says_so_after_its_patience(mesh: LocalMesh) -> None:
    async def through_proxy() -> None:
        real = mesh.addresses[0]
        async with FlakyProxy(real, drops=10**6) as address:
            mesh.addresses[0] = address
            try:
                await mesh.pull(0, patience_s=2.0)
            finally:
                mesh.addresses[0] = real

    with pytest.raises(GossipdError, match=r"127\.0\.0\.1:\d+"):
        asyncio.run(through_proxy())


def test_final_models_come_from_the_checkpoints_nodes_write_at_exit(tmp_path: Path) -> None:
    spec = MeshSpec(nodes=2, job="synthetic", learning_rate=0.0, push_probability=0.0)
    with LocalMesh(spec, tmp_path, fork_node) as mesh:
        mesh.load_plan()
        with pytest.raises(GossipdError, match="the run's result is unknown: node-0"):
            mesh.final_models()
        mesh.start(0)
        mesh.start(1)
        asyncio.run(mesh.wait_ready())
        initial = mesh.initial_models()
        assert [mesh.stop(i) for i in (0, 1)] == [0, 0]
        final = mesh.final_models()
        weights = [
            checkpoint.load(
                mesh.node_dir(i) / checkpoint.FILENAME, fingerprint=mesh.plan.fingerprint
            ).weights
            for i in (0, 1)
        ]
    # Learning rate 0, push probability 0: the only push is node-0's hand-off as it
    # leaves first, so node-1 ends at the average with all the weight.
    assert [w[0] for w in weights] == [0.0, 2.0]
    assert torch.equal(final[0], initial[0])
    assert torch.allclose(final[1], (initial[0] + initial[1]) / 2, atol=1e-6)


def test_sigterm_to_mesh_up_stops_its_nodes_and_the_mesh_keeps_its_weight(tmp_path: Path) -> None:
    """``timeout`` or a cancelled CI job sends SIGTERM: it used to kill the launcher alone,
    and its daemons trained on (with --max-steps 0, for ever). Now it unwinds as Ctrl-C
    does, every node is stopped (each leaves with a final checkpoint) and it exits 143."""
    workdir = tmp_path / "mesh"
    argv = ["mesh", "up", "--nodes", "2", "--max-steps", "0", "--duration-s", "0"]
    argv += ["--insecure", "--workdir", str(workdir)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "gossipd.node.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        stepping = [workdir / f"node-{i}" / "initial.pt" for i in range(2)]  # before a 1st step
        while not all(p.exists() for p in stepping):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)  # a poll of the nodes' files, bounded above
        running = left_running(workdir)
        assert len(running) >= 2, f"the check after SIGTERM must see the 2 nodes: {running}"
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired as late:
            holders = pipe_holders(proc.stderr.fileno())  # type: ignore[union-attr]
            raise AssertionError(
                f"no end of output 120 s after SIGTERM; launcher {proc.pid} "
                f"{'exited ' + str(proc.poll()) if proc.poll() is not None else 'running'}; "
                f"its stderr held by {holders}; stderr so far: {late.stderr!r}"
            ) from late
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        left = left_running(workdir)
        for pid in left:  # a failure here must not leave them training
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.rstrip().endswith("gossipd: stopped by SIGTERM"), err
    assert left == [], "nodes outlived their launcher"
    weights = [
        json.loads((workdir / f"node-{i}" / "summary.json").read_text())["sum_weights"]
        for i in range(2)
    ]
    assert sum(w[0] for w in weights) == pytest.approx(2.0, abs=1e-9), weights
