"""Real daemons for tests: one ``gossipd node`` (or ``gossipd coordinator``) in a process of
its own (forked by :mod:`gossipd.node.launch.forked`) on a loopback port, its config
written with the test defaults, always reaped.

The :func:`~tests.conftest.daemons` fixture starts these; :mod:`tests.meshes` starts several
at once and reads and disturbs them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gossipd.node.errors import GossipdError
from gossipd.node.launch.forked import fork_node
from gossipd.node.launch.localmesh import stop_process
from gossipd.node.launch.processes import NodeProcess
from gossipd.node.net.status.query import query_status
from gossipd.node.shared.tls import Credentials

START_TIMEOUT_S = 120.0
TEST_STEPS_PER_S = 100.0


@dataclass
class DaemonHandle:
    node_id: str
    address: str
    data_dir: Path
    config_path: Path
    proc: NodeProcess
    tls: Credentials | None = None  # what this test presents to it (None: plaintext)

    def status(self, *, checksum: bool = False) -> dict[str, Any]:
        return asyncio.run(query_status(self.address, 10.0, checksum=checksum, tls=self.tls))

    def log(self) -> str:
        path = self.data_dir / "node.log"
        return path.read_text() if path.exists() else ""

    def node_json(self) -> dict[str, Any]:
        return json.loads((self.data_dir / "node.json").read_text())

    def stop(self, timeout_s: float = 60.0) -> int:
        return stop_process(self.proc, timeout_s)


def wait_until(
    check: Callable[[], bool],
    what: str,
    timeout_s: float = 120.0,
    also: Callable[[], None] = lambda: None,
) -> None:
    """Poll ``check`` until it holds; ``also`` runs each round (e.g. raise if a child died)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        also()
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def scrape_metrics(port: int) -> dict[str, float]:
    """One scrape of a node's Prometheus endpoint: sample name with labels -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in lines
        if line and not line.startswith("#")
    }


def toml_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def write_config(path: Path, config: dict[str, Any]) -> None:
    top = [f"{k} = {toml_value(v)}" for k, v in config.items() if not isinstance(v, dict)]
    sections = [
        f"[{k}]\n" + "\n".join(f"{kk} = {toml_value(vv)}" for kk, vv in v.items())
        for k, v in config.items()
        if isinstance(v, dict)
    ]
    path.write_text("\n".join(top) + "\n\n" + "\n\n".join(sections) + "\n")


@contextlib.contextmanager
def coordinator_process(config: dict[str, Any], workdir: Path) -> Iterator[dict[str, Any]]:
    """`gossipd coordinator` on ``config`` (written to ``workdir/coord.toml``; give it
    ``listen`` and ``metrics.listen`` on port 0), once it serves: yields the addresses it
    bound (its ``coordinator.json``). Always reaped."""
    from gossipd.coordinator.server import INFO_FILE

    path = workdir / "coord.toml"
    write_config(path, config)
    log_path = workdir / "coord.log"
    proc = fork_node(path, log_path, "coordinator")
    try:
        info = Path(config["data_dir"]) / INFO_FILE

        def alive() -> None:
            if proc.poll() is not None:
                raise AssertionError(f"coordinator exited:\n{log_path.read_text()[-3000:]}")

        wait_until(info.exists, "the coordinator to serve", 30.0, alive)
        yield json.loads(info.read_text())
    finally:
        stop_process(proc, 15.0)


def _gossip_from_environment() -> dict[str, Any]:
    codec = os.environ.get("GOSSIPD_TEST_CODEC", "raw")
    protocol = os.environ.get("GOSSIPD_TEST_PROTOCOL", "")
    return {
        **({} if codec == "raw" else {"codec": codec, "error_feedback": True}),
        **({"protocol": protocol} if protocol else {}),
    }


def write_node_config(
    tmp_path: Path, node_id: str, port: int, data_dir: Path, **config: Any
) -> Path:
    """A daemon's TOML with the test defaults (synthetic job, lr 0, no pushes, no periodic
    checkpoints, no CPU budget for gossip: tests count pushes against their own timeouts
    on loaded machines, and tests/test_cpu_budget_holds.py covers the budget); sections given
    in ``config`` are merged key by key over them.

    The trainer is paced to ``TEST_STEPS_PER_S``: these tests wait on gossip, not on
    steps, and a trainer stepping flat out took a core from every other test's daemons.

    ``GOSSIPD_TEST_CODEC=int8`` (or another lossy codec) in the environment runs every such
    daemon with that codec and error feedback: the fault suites' checks of the sum of
    weights, run again with compression on (docs/protocols/index.md, "Compressed gossip").
    ``GOSSIPD_TEST_PROTOCOL=persyn`` (or another) does the same with that protocol, where a
    test names none; tests whose hand-made peers speak sum-weight are refused then.
    """
    full: dict[str, Any] = {
        "mesh_id": "test-mesh",
        "node_id": node_id,
        "listen": f"127.0.0.1:{port}",
        "data_dir": str(data_dir),
        "job": {
            "name": "synthetic",
            "learning_rate": 0.0,
            "eval_every_steps": 0,
            "max_steps_per_s": TEST_STEPS_PER_S,
        },
        "gossip": {"push_probability": 0.0, "cpu_share": 1.0, **_gossip_from_environment()},
        "checkpoint": {"every_steps": 0},
        # Plaintext unless a test gives certificates: TLS has its own tests, and a
        # user's paths (demo, mesh up) default to it.
        "tls": {"insecure": True},
    }
    for key, value in config.items():
        if isinstance(value, dict) and isinstance(full.get(key), dict):
            full[key] = {**full[key], **value}
        else:
            full[key] = value
    config_path = tmp_path / f"{node_id}.toml"
    write_config(config_path, full)
    return config_path


def start_daemon(
    tmp_path: Path, node_id: str, port: int, *, client_tls: Credentials | None = None, **config: Any
) -> DaemonHandle:
    """``client_tls``: the certificate the test presents to this daemon (None: plaintext)."""
    data_dir = tmp_path / node_id
    data_dir.mkdir(parents=True, exist_ok=True)
    config_path = write_node_config(tmp_path, node_id, port, data_dir, **config)
    proc = fork_node(config_path, data_dir / "node.log")
    return answering(
        DaemonHandle(node_id, f"127.0.0.1:{port}", data_dir, config_path, proc, client_tls)
    )


def answering(handle: DaemonHandle) -> DaemonHandle:
    """``handle`` once its daemon answers Status; stopped and raised if it never does."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if handle.proc.poll() is not None:
            raise RuntimeError(
                f"{handle.node_id} exited with {handle.proc.returncode}:\n{handle.log()}"
            )
        try:
            handle.status()
            return handle
        except GossipdError:
            if time.monotonic() > deadline:
                handle.stop()
                raise RuntimeError(
                    f"{handle.node_id} did not answer Status:\n{handle.log()}"
                ) from None
            time.sleep(0.2)
        except BaseException:
            handle.stop()  # never leave a daemon behind, whatever went wrong
            raise


def restart_daemon(handle: DaemonHandle) -> DaemonHandle:
    """Start ``handle``'s daemon again from its config and data dir (it resumes from its
    checkpoint); the old process must have exited. Returns the new handle."""
    assert handle.proc.poll() is not None, f"{handle.node_id} is still running"
    proc = fork_node(handle.config_path, handle.data_dir / "node.log")
    return answering(replace(handle, proc=proc))


def _processes() -> Iterator[Path]:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            yield entry


def _open_files(entry: Path) -> list[str]:
    """What a process's descriptors point at (``pipe:[N]`` for a pipe); [] once it is gone."""
    try:
        return [os.readlink(fd) for fd in (entry / "fd").iterdir()]
    except OSError:
        return []


def left_running(workdir: Path) -> list[int]:
    """Processes of the run's sites: their command line names the run's files (a spawned
    executable) or one of their descriptors is open on them (a forked site, whose command
    line is the fork server's, writes its log there)."""
    root = str(workdir)
    found = []
    for entry in _processes():
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if root.encode() in cmdline or any(f.startswith(root) for f in _open_files(entry)):
            found.append(int(entry.name))
    return found


def pipe_holders(fileno: int) -> list[str]:
    """Every other process holding the pipe behind ``fileno``, as "pid: command line (state)":
    why reading it to its end did not end."""
    target = f"pipe:[{os.fstat(fileno).st_ino}]"
    held = []
    for entry in _processes():
        if target in _open_files(entry):
            with contextlib.suppress(OSError):
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                held.append(f"{entry.name}: {cmdline[:200]} ({state})")
    return held


def kill_hard(handle: DaemonHandle) -> None:
    """``kill -9``: no hand-off, no final checkpoint, whatever was in flight is cut."""
    handle.proc.kill()
    handle.proc.wait(timeout=30)
