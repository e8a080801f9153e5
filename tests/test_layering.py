"""Layering: each room of node/ imports only the rooms below it, and the pure parts of
gossipd load no wire and no tensor library.

The rooms (docs/design.md §1) and what each may import are the table ``ROOMS``; every
module of node/ and coordinator/ is read (its imports, at module level and inside
functions alike) and checked against it, so a new file is covered the day it lands.

The error hierarchy, membership, the certificate tool, every protocol core and
the simulator are plain Python (docs/design.md §2): importing any of them must load
neither grpc, nor protobuf, nor torch. The simulator's real-model payload
(``DigitsPayload``) imports torch inside its constructor, so only a simulation
of real models loads it. Each module is imported in a fresh interpreter, since
this test process has long loaded all three.
"""

from __future__ import annotations

import ast
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
from gossipd.node.launch.localmesh import free_ports

HEAVY = ("grpc", "google.protobuf", "torch")
ROOT = Path(__file__).resolve().parent.parent

# Room -> the rooms its modules may import. "coordinator.client" is the node's side of the
# coordinator protocol; the coordinator's server is the CLI's alone. An entry "room.module"
# allows that one module of a room: the network meets the trainer only through its typed
# messages and the summary it publishes (docs/design.md §3).
_MEETING = {"trainer.messages", "trainer.report"}
_BELOW_NET = {"errors", "protocols", "shared", "compression", "model", "proto"}
_BELOW_SITE = _BELOW_NET | {"trainer", "jobs", "net", "coordinator.client"}
ROOMS: dict[str, set[str]] = {
    "errors": set(),
    "protocols": {"errors"},
    "compression": {"errors", "proto"},
    "jobs": {"errors"},
    "shared": {"errors", "protocols"},
    "model": {"errors", "shared"},
    # model and jobs: a real-model payload, lazily (no trainer: the simulator drives cores)
    "sim": {"errors", "protocols", "compression", "model", "jobs"},
    "trainer": {"errors", "protocols", "shared", "compression", "model", "jobs"},
    "net": _BELOW_NET | _MEETING | {"coordinator.client"},
    "site": _BELOW_SITE,
    "baselines": {"errors", "shared", "model", "jobs", "trainer"},
    "launch": _BELOW_SITE | {"site", "baselines", "sim"},
    "cli": _BELOW_SITE | {"site", "baselines", "launch", "sim", "coordinator.server"},
    # The coordinator shares only what both sides use; it never reaches into a node.
    "coordinator": {"errors", "protocols", "shared", "proto"},
}

# The network's own rooms (node/net/*/), bottom up, and which of them each may import;
# "" is node/net/network.py, which builds them all. Rooms outside net see it as one.
NET_ROOMS: dict[str, set[str]] = {
    "limits": set(),
    "telemetry": set(),
    "wire": {"limits"},
    "bulk": {"limits", "telemetry"},
    "relay": {"limits", "telemetry", "wire"},
    "serve": {"wire", "limits", "telemetry", "bulk", "relay"},
    "dial": {"wire", "bulk", "telemetry", "relay"},
    "peers": {"dial", "wire", "telemetry", "relay"},
    "gossip": {"peers", "dial", "limits", "telemetry", "wire"},
    "status": {"gossip", "peers", "dial", "serve", "bulk", "limits", "telemetry", "wire", "relay"},
    "": {
        "limits",
        "telemetry",
        "wire",
        "bulk",
        "relay",
        "serve",
        "dial",
        "peers",
        "gossip",
        "status",
    },
}


def _room(module: str) -> str | None:
    """The room ``module`` lives in (None: not gossipd's, or a package's own root)."""
    parts = module.split(".")
    if parts[:2] == ["gossipd", "node"] and len(parts) > 2:
        return parts[2]
    if parts[:2] == ["gossipd", "coordinator"]:
        return ".".join(parts[:3])[len("gossipd.") :] if len(parts) > 2 else "coordinator"
    if parts[:2] == ["gossipd", "proto"]:
        return "proto"
    return None


def _net_room(module: str) -> str | None:
    """The room of node/net/ that ``module`` lives in ("": the network; None: not net's)."""
    parts = module.split(".")
    if parts[:3] != ["gossipd", "node", "net"] or len(parts) < 4:
        return None
    return parts[3] if parts[3] in NET_ROOMS else ""


def _sources() -> list[tuple[str, Path]]:
    """(room, path) of every source file of node/ and coordinator/."""
    found = []
    for path in sorted((ROOT / "node").rglob("*.py")):
        parts = path.relative_to(ROOT / "node").parts
        if parts != ("__init__.py",):
            found.append((parts[0].removesuffix(".py"), path))
    found += [("coordinator", p) for p in sorted((ROOT / "coordinator").glob("*.py"))]
    return found


def _imports(path: Path) -> list[str]:
    """Every gossipd module ``path`` imports, anywhere in it."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in ("gossipd.node", "gossipd.coordinator"):
                names += [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    return [n for n in names if n.startswith("gossipd.")]


def test_every_file_of_node_lives_in_a_room() -> None:
    loose = [
        p.name for p in (ROOT / "node").glob("*.py") if p.name not in ("__init__.py", "errors.py")
    ]
    assert loose == [], f"put {loose} in the room of node/ that runs it (docs/design.md §1)"
    rooms = {p.name for p in (ROOT / "node").iterdir() if (p / "__init__.py").exists()}
    assert rooms == set(ROOMS) - {"errors", "coordinator"}, "ROOMS and node/ disagree"


@pytest.mark.parametrize(
    ("own", "path"), _sources(), ids=[str(p.relative_to(ROOT)) for _, p in _sources()]
)
def test_a_module_imports_only_the_rooms_below_its_own(own: str, path: Path) -> None:
    allowed = ROOMS[own] | {own}
    wrong = []
    for module in _imports(path):
        target = _room(module)
        if target is None or target in allowed or _module_of(module) in allowed:
            continue
        if own == "coordinator" and target.startswith("coordinator"):
            continue
        wrong.append(module)
    assert wrong == [], (
        f"{path.relative_to(ROOT)} ({own}) imports {wrong}; {own} may import only "
        f"{sorted(allowed)} (tests/test_layering.py ROOMS, docs/design.md §1)"
    )


def _module_of(module: str) -> str:
    """``module`` as a ROOMS entry names one module: "trainer.messages"."""
    return ".".join(module.split(".")[2:4])


def _net_sources() -> list[tuple[str, Path]]:
    return [(own, p) for own, p in _sources() if own == "net" and p.name != "__init__.py"]


def _dotted(path: Path) -> str:
    return "gossipd." + ".".join(path.relative_to(ROOT).with_suffix("").parts)


def test_every_room_of_net_is_in_the_table_and_says_what_it_owns() -> None:
    found = {p.parent.name for p in (ROOT / "node" / "net").glob("*/__init__.py")}
    assert found == set(NET_ROOMS) - {""}, "NET_ROOMS and node/net/ disagree"
    for room in found:
        doc = ast.get_docstring(ast.parse((ROOT / "node/net" / room / "__init__.py").read_text()))
        assert doc and "May import" in doc, (
            f"node/net/{room}/__init__.py: say what it owns and may import"
        )
    loose = sorted(p.name for p in (ROOT / "node" / "net").glob("*.py"))
    assert loose == ["__init__.py", "network.py"], f"put {loose} in a room of node/net/"


@pytest.mark.parametrize(
    "path",
    [p for _, p in _net_sources()],
    ids=[str(p.relative_to(ROOT)) for _, p in _net_sources()],
)
def test_a_module_of_net_imports_only_the_net_rooms_below_its_own(path: Path) -> None:
    own = _net_room(_dotted(path))
    assert own is not None
    allowed = NET_ROOMS[own] | {own}
    wrong = [m for m in _imports(path) if (r := _net_room(m)) is not None and r not in allowed]
    assert wrong == [], (
        f"{path.relative_to(ROOT)} (net/{own}) imports {wrong}; it may import only the net "
        f"rooms {sorted(allowed)} (tests/test_layering.py NET_ROOMS, docs/design.md §1)"
    )


def test_the_room_check_sees_a_forbidden_import(tmp_path: Path) -> None:
    # Without this, a checker that never found an import would pass every test above.
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from gossipd.node.site.site import Site\n")
    assert [_room(m) for m in _imports(probe)] == ["site"]
    assert "site" not in ROOMS["trainer"] | ROOMS["net"]
    probe.write_text("from gossipd.node.trainer.replica import Replica\n")
    (module,) = _imports(probe)
    assert _room(module) not in ROOMS["net"] and _module_of(module) not in ROOMS["net"]
    probe.write_text("from gossipd.node.net.gossip.outbound import Outbound\n")
    assert [_net_room(m) for m in _imports(probe)] == ["gossip"]
    assert "gossip" not in NET_ROOMS["dial"]


def _submodules(package: ModuleType) -> list[str]:
    """The package and every module in it, found on disk, so a new file is covered too."""
    found = [f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)]
    return [package.__name__, *sorted(found)]


PURE = [
    "gossipd.node.errors",
    "gossipd.node.net.peers.membership",
    "gossipd.node.model.outer",
    "gossipd.node.shared.certs",
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


def test_the_commands_that_only_ask_a_node_load_no_torch() -> None:
    """A container's health check runs `gossipd health` every few seconds: it took 3.6 s of
    CPU, 2 of them importing torch through the transport. Asked of a port where nothing
    listens, each answers with its error, having loaded gRPC but not torch."""
    port = free_ports(1)[0]
    asks = [["health"], ["status"], ["status", "--mesh"]]
    code = "from gossipd.node.cli.main import main\n" + "".join(
        f"assert main({[*ask, '--address', f'127.0.0.1:{port}', '--timeout-s', '2']!r}) != 0\n"
        for ask in asks
    )
    assert _loaded_after(code) == ["grpc", "google.protobuf"]


def test_the_probe_sees_grpc_protobuf_and_torch_when_a_module_does_load_them() -> None:
    # Without this, a probe that never saw anything would pass every test above.
    assert _loaded_after("import gossipd.node.net.serve.servicer") == list(HEAVY)


def test_every_error_class_has_its_status_code_in_the_servicer_table() -> None:
    from gossipd.node.net.serve.servicer import STATUS_CODES

    hierarchy = [
        cls
        for cls in vars(errors).values()
        if isinstance(cls, type) and issubclass(cls, errors.GossipdError)
    ]
    assert len(hierarchy) > 10
    missing = [cls.__name__ for cls in hierarchy if cls not in STATUS_CODES]
    assert missing == [], f"no status code for {missing} in servicer.STATUS_CODES"
