"""Every way out is clean: no pending tasks, no closed-loop errors, no tracebacks at exit.

The fault: a node shuts down while its peers' pushes are still arriving, so gRPC
handlers are waiting for a step boundary that never comes. Library users leave
their ``with GossipNode(...)`` block at different steps (the first to leave is
still being pushed to by the others); daemons get SIGTERM mid-gossip.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import Any

from gossipd.node.launch.localmesh import free_ports
from tests.conftest import wait_until

TIMEOUT_S = 120.0
BAD_OUTPUT = ("Traceback", "Event loop is closed", "was never awaited", "Task was destroyed")
NUMEL = 1 << 20  # 4 MiB per push: big enough that pushes are on the wire when a node leaves
STEPS = (150, 300, 450)  # each leaves while the others still push to it
WORKER = f"""
import sys
import torch
from gossipd.node.site.api import GossipNode
from gossipd.node.jobs.registry import JobSpec, build_job

torch.set_num_threads(1)
name, port, steps, seeds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
options = {{"numel": {NUMEL}}}
job = build_job(JobSpec("synthetic", seed=port % 97, learning_rate=0.01, options=options))
config = {{
    "mesh_id": "clean-exit",
    "node_id": name,
    "listen": f"127.0.0.1:{{port}}",
    "seeds": seeds,
    "gossip": {{"push_probability": 0.5}},
    "metrics": {{"listen": None}},
    "tls": {{"insecure": True}},
    "shutdown_timeout_s": 5.0,
}}
with GossipNode(config, job.model, job.optimizer) as node:
    if not node.wait_for_peers(len(seeds), 60.0):
        sys.exit(f"{{name}}: peers did not show up")
    for _ in range(steps):
        with node.lock:
            loss = job.train_step()
        node.step(loss)
print(name, "done", flush=True)
"""


def _clean(output: str) -> bool:
    return not any(bad in output for bad in BAD_OUTPUT)


def test_library_nodes_leaving_while_pushed_to_exit_0_with_clean_stderr() -> None:
    ports = free_ports(3)
    addresses = [f"127.0.0.1:{p}" for p in ports]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, f"user-{i}", str(port), str(STEPS[i])]
            + [a for a in addresses if not a.endswith(f":{port}")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i, port in enumerate(ports)
    ]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=TIMEOUT_S)
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)
    for code, out, err in results:
        assert code == 0 and "done" in out, err
        assert _clean(err), err


def test_daemons_stopped_with_sigterm_mid_gossip_exit_0_with_clean_logs(daemons: Any) -> None:
    ports = [next(daemons.ports) for _ in range(2)]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    nodes = [
        daemons(
            f"d{i}",
            port,
            seeds=[a for a in addresses if a != addresses[i]],
            gossip={"push_probability": 0.5},
            job={"options": {"numel": NUMEL}},
        )
        for i, port in enumerate(ports)
    ]
    wait_until(lambda: all(len(n.status()["live_peers"]) == 1 for n in nodes), "the mesh to form")
    wait_until(
        lambda: any(w != 1.0 for n in nodes for w in n.status()["sum_weights"]),
        "pushes to flow",
    )
    for node in nodes:
        node.proc.send_signal(signal.SIGTERM)
    codes = [node.proc.wait(timeout=TIMEOUT_S) for node in nodes]
    for node, code in zip(nodes, codes, strict=True):
        log = node.log()
        assert code == 0, log
        assert _clean(log), log
