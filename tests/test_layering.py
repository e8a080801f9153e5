"""Layering: the pure parts of gossipd load no wire and no tensor library.

The error hierarchy, membership, the certificate tool, every protocol core and
the simulator are plain Python (docs/design.md §2): importing any of them must load
neither grpc, nor protobuf, nor torch. The simulator's real-model payload
(``DigitsPayload``) imports torch inside its constructor, so only a simulation
of real models loads it. Each module is imported in a fresh interpreter, since
this test process has long loaded all three.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import gossipd.node.protocols
import gossipd.node.sim
from gossipd.node import errors

HEAVY = ("grpc", "google.protobuf", "torch")


def _submodules(package: ModuleType) -> list[str]:
    """The package and every module in it, found on disk, so a new file is covered too."""
    found = [f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)]
    return [package.__name__, *sorted(found)]


PURE = [
    "gossipd.node.errors",
    "gossipd.node.net.membership",
    "gossipd.node.shared.certs",
    "gossipd.node.protocols.scheduler",
    *_submodules(gossipd.node.protocols),
    *_submodules(gossipd.node.sim),
]


def _loaded_after(code: str) -> list[str]:
    """Which of HEAVY a fresh interpreter holds after running ``code``."""
    report = f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    probe = f"{code}\nimport json, sys\n{report}"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, f"{code!r} failed in a fresh interpreter:\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_pure_module_list_covers_every_protocol_core_and_the_simulator() -> None:
    for needed in (
        "gossipd.node.protocols.base",
        "gossipd.node.protocols.sumweight",
        "gossipd.node.sim.driver",
        "gossipd.node.sim.spec",
        "gossipd.node.sim.scenarios",
        "gossipd.node.sim.payloads",
    ):
        assert needed in PURE, f"{needed} is missing from the layering check"


@pytest.mark.parametrize("module", PURE)
def test_importing_a_pure_module_loads_no_grpc_protobuf_or_torch(module: str) -> None:
    loaded = _loaded_after(f"import {module}")
    assert loaded == [], (
        f"importing {module} loads {loaded}; import them only where the wire or a model "
        "is used (the servicer, peering, jobs), not at module level"
    )


def test_the_certs_command_loads_no_grpc_protobuf_or_torch(tmp_path: Path) -> None:
    ca = tmp_path / "ca"
    code = (
        "from gossipd.node.cli.main import main\n"
        f"assert main(['certs', 'init', '--dir', {str(ca)!r}, '--mesh-id', 'm']) == 0\n"
        f"assert main(['certs', 'issue', 'site-a', '--dir', {str(ca)!r}]) == 0\n"
        f"assert main(['certs', 'show', {str(ca / 'site-a.pem')!r}]) == 0"
    )
    loaded = _loaded_after(code)
    assert (ca / "site-a.pem").exists()
    assert loaded == [], f"gossipd certs loads {loaded}"


def test_the_probe_sees_grpc_protobuf_and_torch_when_a_module_does_load_them() -> None:
    # Without this, a probe that never saw anything would pass every test above.
    assert _loaded_after("import gossipd.node.net.servicer") == list(HEAVY)


def test_every_error_class_has_its_status_code_in_the_servicer_table() -> None:
    from gossipd.node.net.servicer import STATUS_CODES

    hierarchy = [
        cls
        for cls in vars(errors).values()
        if isinstance(cls, type) and issubclass(cls, errors.GossipdError)
    ]
    assert len(hierarchy) > 10
    missing = [cls.__name__ for cls in hierarchy if cls not in STATUS_CODES]
    assert missing == [], f"no status code for {missing} in servicer.STATUS_CODES"
