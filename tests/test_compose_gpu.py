"""docker/compose.gpu.yaml makes site-a a multi-rank CUDA site under torchrun, and agrees
with docker/Dockerfile.cuda, the site config it mounts and the CPU site it replaces.

No container engine runs here, so no image is built and no GPU is used: the real
docker-compose merges the override, torch's own torchrun parser reads the command and
gossipd's parser its tail, the mounted config goes through the daemon's loader, and the
real torchrun runs the exact command on the host to show it starts ``gossipd node`` on
every rank and ends non-zero, with the daemon's reason, when a site cannot start (so
``restart: on-failure:3`` still bounds the retries). With tests/test_containers.py's
helpers; its checks of the Dockerfiles (hadolint, what the build copies, ports, health
check against the site configs) already cover Dockerfile.cuda.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from torch.distributed.run import get_args_parser

from gossipd.node.cli.main import build_parser
from gossipd.node.shared.config import load_config
from tests.compose_files import (
    COMPOSE,
    DOCKER,
    DOCKERFILES,
    REPO,
    TIMEOUT_S,
    _binds,
    _compose_config,
    _instructions,
    _one,
    _port,
    _site_config_path,
    _tool,
)

COMPOSE_GPU = DOCKER / "compose.gpu.yaml"
DOCKERFILE_CUDA = DOCKER / "Dockerfile.cuda"
GPU_SITE = "site-a"
RANKS_VARIABLE = "GOSSIPD_RANKS"
DEFAULT_RANKS = 2  # docs/containers.md "Multi-rank sites on GPUs" promises this default
# What the override may change in a CPU site; the rest (ports, mounts, health check,
# restart policy, grace period) is rank 0's and stays the CPU site's.
GPU_KEYS = {"build", "entrypoint", "command", "deploy", "shm_size", "ulimits"}
VENV = "/opt/gossipd"  # the venv both Dockerfiles install torch and gossipd into


def _merged(ranks: str | None) -> dict[str, Any]:
    """The services of compose.yaml + compose.gpu.yaml, with GOSSIPD_RANKS unset or set."""
    env = {k: v for k, v in os.environ.items() if k != RANKS_VARIABLE}
    if ranks is not None:
        env[RANKS_VARIABLE] = ranks
    args = [_tool("docker-compose"), "-f", str(COMPOSE), "-f", str(COMPOSE_GPU), "config"]
    done = subprocess.run(
        args, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert done.returncode == 0, f"docker-compose {' '.join(args[1:])}:\n{done.stderr}"
    return yaml.safe_load(done.stdout)["services"]


def _torchrun_args(service: dict[str, Any]) -> Any:
    """The service's command as torchrun itself parses it."""
    assert service["entrypoint"] == ["torchrun"], service["entrypoint"]
    return get_args_parser().parse_args(service["command"])


def _gpu_count(service: dict[str, Any]) -> int:
    """The one GPU reservation's count, read as Compose v2 reads a count: an integer."""
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    return int(device["count"])


def _bytes(size: str) -> int:
    match = re.fullmatch(r"(\d+)([kmg])b?", str(size).lower())
    assert match, f"size {size!r}: this test reads sizes such as 1gb"
    return int(match.group(1)) * 1024 ** " kmg".index(match.group(2))


def _unordered(service: dict[str, Any]) -> dict[str, Any]:
    """The service with its mounts in target order: merging files reorders them."""
    return {**service, "volumes": sorted(service.get("volumes", []), key=lambda v: v["target"])}


@pytest.fixture(scope="module")
def merged() -> dict[str, Any]:
    return _merged(None)


def test_the_override_changes_only_site_a_and_only_what_a_gpu_site_needs(
    merged: dict[str, Any],
) -> None:
    cpu = _compose_config(COMPOSE)["services"]
    assert sorted(merged) == sorted(cpu), "the override adds or drops no service"
    assert "version" not in yaml.safe_load(COMPOSE_GPU.read_text())
    for name, service in merged.items():
        if name != GPU_SITE:
            assert _unordered(service) == _unordered(cpu[name]), f"{name} changed"
    gpu, base = _unordered(merged[GPU_SITE]), _unordered(cpu[GPU_SITE])
    changed = {k for k in {*gpu, *base} if gpu.get(k) != base.get(k)}
    assert changed == GPU_KEYS, f"{GPU_SITE}: changed {sorted(changed)}"
    # Rank 0 serves gRPC and metrics as the CPU site does, checked by the image's own
    # health check: the CPU site's ports, mounts and grace period, no compose health check.
    assert gpu["expose"] == base["expose"] and "ports" not in gpu and "healthcheck" not in gpu
    assert gpu["build"] == {**base["build"], "dockerfile": str(DOCKERFILE_CUDA.relative_to(REPO))}


def test_the_command_is_torchrun_of_gossipd_node_with_the_mounted_site_config(
    merged: dict[str, Any],
) -> None:
    service = merged[GPU_SITE]
    args = _torchrun_args(service)
    assert args.standalone and args.no_python and args.nnodes == "1:1"
    assert args.training_script == "gossipd"
    node = build_parser().parse_args(args.training_script_args)
    assert node.command == "node"
    assert str(node.config) == _site_config_path(), "where the image and the CPU site read it"
    source = _binds(service)[str(node.config)]
    assert source == DOCKER / "sites" / f"{GPU_SITE}.toml" and source.is_file()
    config = load_config(source)
    assert config.node_id == GPU_SITE
    # auto: NCCL when the job's model is on a GPU; "nccl" would stop a CPU job at start.
    assert config.ranks.backend == "auto"
    exposed = {int(p) for p in service["expose"]}
    assert {_port(config.listen), _port(config.metrics.listen or "")} <= exposed


def test_one_variable_sets_ranks_and_gpus_and_it_defaults_to_two(merged: dict[str, Any]) -> None:
    service = merged[GPU_SITE]
    assert int(_torchrun_args(service).nproc_per_node) == _gpu_count(service) == DEFAULT_RANKS
    four = _merged("4")[GPU_SITE]
    assert int(_torchrun_args(four).nproc_per_node) == _gpu_count(four) == 4


def test_the_site_reserves_nvidia_gpus_and_enough_shared_memory_for_nccl(
    merged: dict[str, Any],
) -> None:
    service = merged[GPU_SITE]
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert "device_ids" not in device, "a count, so the container sees GPUs 0..R-1"
    # NCCL's documentation for containers: --shm-size=1g --ulimit memlock=-1.
    assert _bytes(service["shm_size"]) >= 1024**3
    assert service["ulimits"]["memlock"] == -1
    assert "ipc" not in service, "a private /dev/shm, not the host's IPC namespace"


def test_the_cuda_image_puts_torchrun_and_gossipd_on_path_like_the_cpu_image() -> None:
    cpu, cuda = DOCKERFILES
    assert cuda == DOCKERFILE_CUDA
    for instruction in ("HEALTHCHECK", "EXPOSE", "ENTRYPOINT", "CMD", "VOLUME", "USER"):
        assert _one(cuda, instruction) == _one(cpu, instruction), instruction
    runs = _runs(cuda)
    pins = {re.search(r"\btorch==([\w.]+)", " ".join(_runs(p)))[1] for p in (cpu, cuda)}
    assert pins == {importlib.metadata.version("torch").split("+")[0]}, pins
    assert "pip install --no-cache-dir . && gossipd --help >/dev/null" in runs
    # torchrun is the torch wheel's console script: pip puts it, like gossipd, in the venv,
    # which the runtime stage copies whole and puts first on PATH; its interpreter is
    # the runtime stage's python3.11.
    scripts = {
        e.name: e.value
        for dist in ("torch", "gossipd")
        for e in importlib.metadata.distribution(dist).entry_points
        if e.group == "console_scripts"
    }
    assert scripts["torchrun"] == "torch.distributed.run:main" and "gossipd" in scripts
    assert f"python3.11 -m venv {VENV}" in runs
    assert _one(cuda, "COPY") == f"--from=build {VENV} {VENV}"
    assert _one(cuda, "ENV").startswith(f"PATH={VENV}/bin:$PATH ")
    runtime = _instructions(cuda)
    runtime = runtime[max(i for i, (word, _) in enumerate(runtime) if word == "FROM") :]
    assert any(
        w == "RUN" and "install -y --no-install-recommends python3.11" in r for w, r in runtime
    )


def _runs(path: Path) -> list[str]:
    return [rest for word, rest in _instructions(path) if word == "RUN"]


def test_torchrun_runs_gossipd_node_and_a_failed_start_ends_it_with_the_daemons_reason(
    merged: dict[str, Any], tmp_path: Path
) -> None:
    """The exact torchrun line on this host, with the mounted config copied and its
    certificates pointed at a missing directory: the ranks are ``gossipd node``, the first
    to exit 2 makes torchrun end the rest and exit non-zero, and no rank outlives it."""
    service = merged[GPU_SITE]
    source = _binds(service)[_site_config_path()]
    missing = tmp_path / "no-certs"
    config = tmp_path / "site.toml"
    config.write_text(source.read_text().replace("/etc/gossipd/certs", str(missing)))
    command = [*service["entrypoint"], *service["command"]]
    command[command.index(_site_config_path())] = str(config)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.Popen(
        command,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    finally:
        survivors = _kill_group(proc.pid)
        proc.wait(timeout=TIMEOUT_S)
    assert not survivors, f"ranks outlived torchrun:\n{output}"
    assert proc.returncode != 0, output
    assert f"gossipd: error: cannot read certificate {missing}/ca.pem" in output, output
    # torchrun's own report: a rank ran the gossipd binary itself (--no-python), exited 2.
    assert re.search(r"failed \(exitcode: 2\) local_rank: \d .* of binary: gossipd", output)


def _kill_group(pgid: int) -> bool:
    """SIGKILL whatever is left of torchrun's session; True when something was."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def test_the_docs_give_the_command_the_default_and_the_torchrun_line() -> None:
    header = COMPOSE_GPU.read_text().split("\n\n")[0]
    command = "torchrun --standalone --nproc-per-node=R --no-python gossipd node --config"
    up = "docker compose -f docker/compose.yaml -f docker/compose.gpu.yaml up --build"
    assert command in header and up in header
    page = (REPO / "docs" / "containers.md").read_text()
    section = page.split("## Multi-rank sites on GPUs", 1)[1].split("\n## ", 1)[0]
    assert up in section and f"`{RANKS_VARIABLE}` (default {DEFAULT_RANKS})" in section
    assert "NVIDIA Container Toolkit" in section and "shm_size" in section
