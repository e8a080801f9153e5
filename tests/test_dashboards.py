"""The Grafana dashboard and the Prometheus configs, checked against real tools and a real mesh.

The dashboard is only worth something if every panel shows data on a running
mesh, so the live test starts three daemons, a coordinator (``gossipd coordinator``
with the compose demo's ``docker/coord.toml``, its paths and ports made local) and a
real Prometheus scraping them all, then evaluates every PromQL expression the
dashboard holds: a panel whose query returns no series fails the test by its title.
Events that a quiet mesh never has (a rejected request, a failed dial, a checkpoint,
a pull granted and reported, a refused report) are made to happen first.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import re
import shutil
import signal
import subprocess
import sys
import tomllib
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from gossipd.coordinator.client import CoordinatorClient, CoordinatorUnavailable
from gossipd.node.launch.forked import fork_node
from gossipd.node.launch.localmesh import LocalMesh, MeshSpec, free_ports, stop_process
from gossipd.node.shared import certs
from gossipd.node.shared.tls import Credentials
from tests.conftest import coordinator_process, scrape_metrics, wait_until
from tests.fakepeer import dead_address, handshake_tls, node_info

REPO = Path(__file__).resolve().parents[1]
DASHBOARDS = REPO / "dashboards"
DASHBOARD_JSON = DASHBOARDS / "gossipd.json"
COMPOSE_COORDINATOR = REPO / "docker" / "coord.toml"
SCRAPE_INTERVAL_S = 1
COORDINATOR_JOB = "gossipd-coordinator"  # as in dashboards/prometheus.yml
# Grafana fills these in; the test picks values that cover every node over a few scrapes.
TEMPLATE_VALUES = {
    "__rate_interval": "10s",
    "mesh": ".*",
    "node": ".*",
    "job": ".*",
    "coordinator": COORDINATOR_JOB,
}
MIN_SCRAPES = 5


def require_tool(name: str) -> str:
    """The tool's path; fails (never skips) without it: the checks would silently vanish."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"{name} is not on PATH; CI installs it with `apt-get install prometheus` "
            "(Debian's package ships prometheus and promtool); install it the same way"
        )
    return path


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) for every target of every panel, rows' nested panels included."""
    found = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            found.extend((panel["title"], t["expr"]) for t in panel.get("targets", []))
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    return found


def substitute(expr: str) -> str:
    """``expr`` with Grafana's template variables replaced; an unknown one is an error."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in TEMPLATE_VALUES:
            raise AssertionError(f"no test value for template variable ${name} in {expr!r}")
        return TEMPLATE_VALUES[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, expr)


def test_committed_dashboard_json_is_what_build_py_generates() -> None:
    done = subprocess.run(
        [sys.executable, str(DASHBOARDS / "build.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_compose_scrape_config_passes_promtool_and_names_the_compose_sites() -> None:
    promtool = require_tool("promtool")
    config = DASHBOARDS / "prometheus.yml"
    done = subprocess.run(
        [promtool, "check", "config", str(config)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    jobs = {
        job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
        for job in yaml.safe_load(config.read_text())["scrape_configs"]
    }
    for target in ("site-a:9100", "site-b:9100", "site-c:9100"):
        assert target in jobs["gossipd"], f"{config} does not scrape {target} (a compose site)"
    # The coordinator in a job of its own: the dashboard's $coordinator variable finds it.
    assert jobs[COORDINATOR_JOB] == ["coordinator:9100"], jobs


def test_provisioned_datasource_uid_is_the_dashboards_default() -> None:
    dashboard = json.loads(DASHBOARD_JSON.read_text())
    (var,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    provisioned = (DASHBOARDS / "grafana/provisioning/datasources/prometheus.yml").read_text()
    assert re.search(rf"^\s*uid:\s*{re.escape(var['current']['value'])}\s*$", provisioned, re.M)
    assert "url: http://prometheus:9090" in provisioned
    provider = (DASHBOARDS / "grafana/provisioning/dashboards/gossipd.yml").read_text()
    assert "path: /var/lib/grafana/dashboards" in provider


def test_template_substitution_covers_every_variable_the_dashboard_uses() -> None:
    queries = dashboard_queries(json.loads(DASHBOARD_JSON.read_text()))
    assert len(queries) > 20
    for _, expr in queries:
        assert "$" not in substitute(expr)


def test_render_py_draws_panels_the_dashboard_has() -> None:
    """render.py picks panels by title: a renamed panel must fail here, not at render time."""
    loaded = importlib.util.spec_from_file_location("render", DASHBOARDS / "render.py")
    assert loaded is not None and loaded.loader is not None
    render = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(render)
    titles = {title for title, _ in dashboard_queries(json.loads(DASHBOARD_JSON.read_text()))}
    assert set(render.PANELS) <= titles, set(render.PANELS) - titles


# -- the live mesh --------------------------------------------------------------------------


def metrics_ports(mesh: LocalMesh, timeout_s: float = 60.0) -> list[int]:
    """Each node's chosen metrics port, from its ``node.json`` (written once it listens)."""
    paths = [mesh.node_dir(i) / "node.json" for i in range(mesh.spec.nodes)]
    wait_until(lambda: all(p.exists() for p in paths), "node.json", timeout_s, mesh.check_alive)
    return [json.loads(p.read_text())["metrics_port"] for p in paths]


def write_scrape_config(path: Path, ports: list[int], coordinator_port: int) -> None:
    """The compose config's shape (the sites' job and the coordinator's, no relabeling),
    aimed at the local ports."""
    targets = ", ".join(f'"127.0.0.1:{p}"' for p in ports)
    path.write_text(
        f"global:\n  scrape_interval: {SCRAPE_INTERVAL_S}s\n"
        f"  evaluation_interval: {SCRAPE_INTERVAL_S}s\n"
        f"scrape_configs:\n  - job_name: gossipd\n"
        f"    static_configs:\n      - targets: [{targets}]\n"
        f"  - job_name: {COORDINATOR_JOB}\n"
        f'    static_configs:\n      - targets: ["127.0.0.1:{coordinator_port}"]\n'
    )


@contextmanager
def running_coordinator(mesh: LocalMesh, workdir: Path) -> Iterator[tuple[str, int]]:
    """``gossipd coordinator`` with docker/coord.toml, its paths and ports made local, a
    coordinator certificate from the mesh's CA; yields (address, metrics port); reaped."""
    tls_dir = mesh.root / "tls"  # LocalMesh's throwaway CA
    cert, key = certs.issue("coordinator", tls_dir, coordinator=True)
    config = tomllib.loads(COMPOSE_COORDINATOR.read_text())
    config.update(mesh_id=mesh.mesh_id, listen="127.0.0.1:0", data_dir=str(workdir / "coord"))
    config["metrics"] = {"listen": "127.0.0.1:0"}
    config["tls"] = {"ca": str(tls_dir / certs.CA_CERT_FILE), "cert": str(cert), "key": str(key)}
    with coordinator_process(config, workdir) as bound:
        yield bound["address"], bound["metrics_port"]


def drive_coordinator(mesh: LocalMesh, address: str) -> None:
    """node-0 and node-1 (their certificates, their addresses) register; node-0 is granted
    a pull from node-1 and reports it, then reports a pull from itself (refused); node-1
    is granted node-0 and reports that pull failed."""

    def client(i: int) -> CoordinatorClient:
        tls_dir = mesh.root / "tls"
        tls = Credentials(
            ca=tls_dir / certs.CA_CERT_FILE,
            cert=tls_dir / f"node-{i}.pem",
            key=tls_dir / f"node-{i}.key",
        )
        return CoordinatorClient(
            address, mesh_id=mesh.mesh_id, advertise=mesh.addresses[i], tls=tls
        )

    async def run() -> None:
        clients = [client(0), client(1)]
        try:
            for c in clients:
                await c.start()
            for c in clients:
                await asyncio.wait_for(c.wait_available(True), 30.0)
            granted = await clients[0].start_time(end_in_s=1.0)
            assert granted is not None and granted[0] == "node-1", granted
            await clients[0].report("node-1", 0.05)
            with pytest.raises(CoordinatorUnavailable, match="from itself"):
                await clients[0].report("node-0", 0.05)
            granted = await clients[1].start_time(end_in_s=1.0)
            assert granted is not None and granted[0] == "node-0", granted
            await clients[1].report("node-0", math.inf)  # a failed pull
        except CoordinatorUnavailable as err:
            raise AssertionError(f"the coordinator refused a valid request: {err}") from None
        finally:
            for c in clients:
                await c.close()

    asyncio.run(run())


@contextmanager
def running_prometheus(binary: str, config: Path, workdir: Path) -> Iterator[str]:
    """A real Prometheus on a free loopback port; yields its base URL; always reaped."""
    (port,) = free_ports(1)
    log_path = workdir / "prometheus.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        def alive() -> None:
            if proc.poll() is not None:
                raise AssertionError(f"prometheus exited:\n{log_path.read_text()[-3000:]}")

        wait_until(ready, "prometheus to be ready", 30.0, alive)
        yield url
    finally:
        stop_process(proc, 15.0)


def instant_query(url: str, expr: str) -> list[dict[str, Any]]:
    query = urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(f"{url}/api/v1/query?{query}", timeout=10) as r:
        body = json.load(r)
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def provoke_rejection_and_dial_failure(mesh: LocalMesh, port: int) -> None:
    """Make node-0 refuse one request and fail one dial, with the launcher's certificate.

    A Handshake claiming to be node-1 over the launcher's certificate is refused
    (IdentityMismatch); a Handshake as the launcher at an address nobody listens
    on makes node-0 dial that address back, which fails as unreachable.
    """
    address = mesh.addresses[0]
    fingerprint = mesh.plan.fingerprint
    code, _, details = handshake_tls(
        mesh.tls,
        address,
        node_info("node-1", mesh.addresses[1], 1),
        fingerprint=fingerprint,
        mesh_id=mesh.mesh_id,
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED, (code, details)
    code, _, details = handshake_tls(
        mesh.tls,
        address,
        node_info("launcher", dead_address(0), 1),
        fingerprint=fingerprint,
        mesh_id=mesh.mesh_id,
    )
    assert code == grpc.StatusCode.OK, (code, details)

    def counted() -> bool:
        names = scrape_metrics(port)
        return any(k.startswith("gossipd_rejected_payloads_total{") for k in names) and any(
            k.startswith("gossipd_dial_failures_total{") for k in names
        )

    wait_until(counted, "node-0 to count the rejection and the dial failure", 30.0)


@pytest.mark.timeout(240)
def test_every_dashboard_query_returns_series_from_a_live_mesh(tmp_path: Path) -> None:
    prometheus = require_tool("prometheus")
    queries = dashboard_queries(json.loads(DASHBOARD_JSON.read_text()))
    spec = MeshSpec(
        nodes=3,
        job="digits",
        duration_s=60.0,  # training outlasts the queries; the mesh is stopped right after
        eval_every_steps=20,  # gossipd_eval{metric="test_accuracy"}
        checkpoint_every_steps=50,  # checkpoint age and write-time panels
        quiet=True,
    )
    with LocalMesh(spec, tmp_path / "mesh", fork_node) as mesh:
        try:
            for i in range(spec.nodes):
                mesh.start(i)
            mesh.load_plan()
            asyncio.run(mesh.wait_ready(120.0))
            ports = metrics_ports(mesh)
            provoke_rejection_and_dial_failure(mesh, ports[0])
            with running_coordinator(mesh, tmp_path) as (coordinator, coordinator_port):
                drive_coordinator(mesh, coordinator)
                config = tmp_path / "prometheus.yml"
                write_scrape_config(config, ports, coordinator_port)
                with running_prometheus(prometheus, config, tmp_path) as url:

                    def scraped() -> bool:
                        mesh.check_alive()
                        counts = instant_query(url, "count_over_time(up[1m])")
                        ups = instant_query(url, "up")
                        return (
                            len(ups) == spec.nodes + 1
                            and all(float(u["value"][1]) == 1 for u in ups)
                            and len(counts) == spec.nodes + 1
                            and all(float(c["value"][1]) >= MIN_SCRAPES for c in counts)
                        )

                    wait_until(scraped, f"{MIN_SCRAPES} scrapes of every target", 45.0)
                    empty = [
                        f"{title}: {expr}"
                        for title, expr in queries
                        if not instant_query(url, substitute(expr))
                    ]
        finally:
            # Stop all three at once: their shutdowns overlap instead of queueing.
            for proc in mesh.procs.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
    assert not empty, "panels whose query returned no series:\n" + "\n".join(empty)


def test_substitute_refuses_a_variable_it_has_no_value_for() -> None:
    assert substitute('rate(x{a=~"$node"}[$__rate_interval])') == 'rate(x{a=~".*"}[10s])'
    with pytest.raises(AssertionError, match=r"\$interval"):
        substitute("rate(x[$interval])")
