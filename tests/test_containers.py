"""The container files in docker/ are lint-clean, valid compose, and agree with the daemon.

No container engine runs here: hadolint and docker-compose read the files without building
or starting anything, docker/make-certs.sh runs for real into a temporary directory, and
the site configs are checked with the daemon's own config loader, certificate checks and
CLI parser, the coordinator's config with its own loader. The health checks that compose
states itself run for real: the coordinator's against a real ``gossipd coordinator`` with
the script's certificate, the broker's against Debian's Mosquitto reading
docker/mosquitto.conf. Each test names the files whose agreement it protects.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from gossipd.node.cli.main import build_parser
from gossipd.node.shared.certs import check_pair, describe
from tests.compose_files import (
    BASE_SITES,
    BROKER,
    COMPOSE,
    COMPOSE_JOIN,
    COORDINATOR,
    DOCKER,
    DOCKERFILES,
    JOIN_SITES,
    MAKE_CERTS,
    REPO,
    _binds,
    _compose_config,
    _coordinator_config,
    _host,
    _host_path,
    _instructions,
    _named_volumes,
    _one,
    _port,
    _run,
    _seconds,
    _site_config,
    _site_config_path,
    _sites,
    _tool,
    _yaml,
    make_certs,
)

# docker/make-certs.sh's operator certificate: it signs control commands, no service mounts it.
OPERATOR = "operator"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """compose.yaml with the join override: every service, site-d included."""
    return _compose_config(COMPOSE, COMPOSE_JOIN)["services"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What docker/make-certs.sh writes: its default run, then the join command for site-d."""
    out = tmp_path_factory.mktemp("compose")
    for args in ([], JOIN_SITES, ["site-a"]):
        done = make_certs(out, *args)
    assert "site-a: kept" in done.stdout, "a second run must keep an existing site's files"
    return out


# ---------------------------------------------------------------------------
# the tools


def test_dockerfiles_pass_hadolint_with_no_finding_at_any_level() -> None:
    done = _run([_tool("hadolint"), "--failure-threshold", "style", *map(str, DOCKERFILES)])
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr
    for path in DOCKERFILES:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if "hadolint ignore" in line:
                before = lines[i - 1].strip() if i else ""
                assert before.startswith("#") and "hadolint" not in before, (
                    f"{path.name}:{i + 1}: an ignore pragma needs a comment above it saying why"
                )


def test_compose_files_are_valid_modern_compose_for_docker_compose() -> None:
    base = _compose_config(COMPOSE)["services"]
    assert sorted(base) == sorted([*BASE_SITES, COORDINATOR, BROKER, "prometheus", "grafana"])
    joined = _compose_config(COMPOSE, COMPOSE_JOIN)["services"]
    assert sorted(joined) == sorted([*base, *JOIN_SITES])
    for path in (COMPOSE, COMPOSE_JOIN):
        raw = _yaml(path.read_text())
        assert "version" not in raw, f"{path.name}: the Compose Specification has no version key"
    for name in (BROKER, "prometheus", "grafana"):
        image = base[name]["image"]
        assert re.search(r":v?\d+\.\d+\.\d+$", image), f"{name}: pin the image tag ({image})"
    published = {p for s in base.values() for p in s.get("ports", [])}
    assert {str(p).split(":")[-1].split("/")[0] for p in published} == {"9090", "3000"}


# ---------------------------------------------------------------------------
# compose <-> the repository and make-certs.sh


def test_every_mount_and_build_context_exists_and_certs_are_exactly_what_the_script_makes(
    compose: dict[str, Any], certs: Path
) -> None:
    mounted_certs: set[str] = set()
    for name, service in compose.items():
        if "build" in service:
            context = Path(service["build"]["context"])
            assert context == REPO, f"{name}: build context {context}"
            assert (context / service["build"]["dockerfile"]) == DOCKERFILES[0]
        for target, source in _binds(service).items():
            if source.is_relative_to(DOCKER / "certs"):
                relative = source.relative_to(DOCKER / "certs")
                mounted_certs.add(str(relative))
                assert (certs / "certs" / relative).is_dir(), f"{name}: {source} -> {target}"
            else:
                assert source.exists(), f"{name}: {source} (mounted at {target}) is missing"
    made = {p.name for p in (certs / "certs").iterdir() if p.name not in ("ca", OPERATOR)}
    assert mounted_certs == made, "compose mounts exactly the certificate directories made"
    assert COORDINATOR in made, "the script's default run issues the coordinator's"
    assert "ca" not in mounted_certs, "the CA key must never be mounted into a site"
    assert OPERATOR not in mounted_certs, "the operator's key must never be mounted into a site"
    assert sorted(os.listdir(certs / "certs" / "ca")) == ["ca.key", "ca.pem"]
    for site in made:
        files = sorted(os.listdir(certs / "certs" / site))
        assert files == sorted(["ca.pem", f"{site}.pem", f"{site}.key"]), f"{site}: {files}"


def test_the_script_issues_an_operator_certificate_of_the_mesh_ca_in_its_own_directory(
    certs: Path,
) -> None:
    """Sites obey only control commands signed by an operator certificate of their CA, so
    the default run issues one, in a directory of its own that no service mounts, beside
    the CA certificate that gossipd control checks the sites' signed replies against."""
    directory = certs / "certs" / OPERATOR
    assert sorted(os.listdir(directory)) == ["ca.pem", f"{OPERATOR}.key", f"{OPERATOR}.pem"]
    info = describe(directory / f"{OPERATOR}.pem")
    assert info["role"] == "operator" and info["subject"] == f"CN={OPERATOR}", info
    assert info["issuer"] == describe(certs / "certs" / "ca" / "ca.pem")["subject"], info
    assert info["valid_now"] and info["node_id"] is None, "it names no site"


def test_the_image_user_owns_each_site_key_and_its_default_uid_agrees_everywhere(
    compose: dict[str, Any], certs: Path
) -> None:
    default_uid = int(re.search(r"default_uid=(\d+)", MAKE_CERTS.read_text()).group(1))
    for path in (COMPOSE, COMPOSE_JOIN):
        defaults = re.findall(r"\$\{GOSSIPD_UID:-(\d+)\}", path.read_text())
        assert defaults and {int(d) for d in defaults} == {default_uid}, path.name
    for path in DOCKERFILES:
        arg = re.search(r"^ARG GOSSIPD_UID=(\d+)$", path.read_text(), re.M)
        assert arg and int(arg.group(1)) == default_uid, path.name
        assert _one(path, "USER").startswith("${GOSSIPD_UID}:"), path.name
    # A key is 0600: readable in the container only if the image user's uid owns it.
    env_file = certs / ".env"
    if os.getuid() == 0:
        expected = default_uid
        assert not env_file.exists(), "root's uid 0 must not become the image user"
    else:
        expected = os.getuid()
        assert env_file.read_text().strip() == f"GOSSIPD_UID={expected}"
    keys = {n: _host_path(_site_config(s).tls.key, s, certs) for n, s in _sites(compose).items()}
    coordinator = compose[COORDINATOR]
    keys[COORDINATOR] = _host_path(_coordinator_config(coordinator).tls.key, coordinator, certs)
    # `compose run` signs control commands with it as the image's user (docs/containers.md).
    keys[OPERATOR] = certs / "certs" / OPERATOR / f"{OPERATOR}.key"
    for name, key in keys.items():
        assert key.stat().st_uid == expected, f"{name}: {key} unreadable in the container"
        assert key.stat().st_mode & 0o077 == 0, f"{name}: {key} is readable by others"


# ---------------------------------------------------------------------------
# compose <-> the site configs


def test_each_site_config_names_its_service_and_its_certificate_checks_out(
    compose: dict[str, Any], certs: Path
) -> None:
    sites = _sites(compose)
    assert sorted(sites) == sorted([*BASE_SITES, *JOIN_SITES])
    mesh_ids = set()
    for name, service in sites.items():
        config = _site_config(service)
        mesh_ids.add(config.mesh_id)
        assert config.node_id == name
        assert not config.tls.insecure
        files = [_host_path(p, service, certs) for p in (config.tls.ca, config.tls.cert)]
        key = _host_path(config.tls.key, service, certs)
        assert check_pair(*files, key) == name, f"{name}: certificate names another node"
        assert config.join == (name in JOIN_SITES)
    assert len(mesh_ids) == 1, f"one mesh: {mesh_ids}"


def test_seeds_and_advertise_addresses_are_service_names_and_exposed_ports(
    compose: dict[str, Any],
) -> None:
    sites = _sites(compose)
    configs = {name: _site_config(s) for name, s in sites.items()}
    for name, config in configs.items():
        exposed = {int(p) for p in sites[name]["expose"]}
        assert _host(config.advertise or "") == name, f"{name}: advertise {config.advertise}"
        assert _port(config.advertise or "") == _port(config.listen) in exposed
        assert config.bulk_port in exposed, f"{name}: peers dial its bulk lane there"
        assert _host(config.listen) == "0.0.0.0", f"{name}: listen on every interface"
        for seed in config.seeds:
            peer = _host(seed)
            assert peer in configs and peer != name, f"{name}: seed {seed} is no other site"
            assert seed == configs[peer].advertise, f"{name}: seed {seed} is not {peer}'s address"
            assert _port(seed) in {int(p) for p in sites[peer]["expose"]}
    for name in BASE_SITES:
        others = {configs[o].advertise for o in BASE_SITES if o != name}
        assert set(configs[name].seeds) == others, f"{name} seeds every other site"
    for name in JOIN_SITES:
        seeds = configs[name].seeds
        assert seeds and all(_host(s) in BASE_SITES for s in seeds), f"{name}: seeds {seeds}"
        depends = sites[name].get("depends_on", {})
        for seed in seeds:
            assert depends.get(_host(seed), {}).get("condition") == "service_healthy", (
                f"{name} starts once its seed {_host(seed)} answers"
            )


def test_data_dir_is_the_named_volume_and_the_image_volume(compose: dict[str, Any]) -> None:
    volumes = [json.loads(_one(path, "VOLUME")) for path in DOCKERFILES]
    for name, service in _sites(compose).items():
        config = _site_config(service)
        assert list(_named_volumes(service)) == [str(config.data_dir)], name
        assert all(v == [str(config.data_dir)] for v in volumes), volumes
        grace = _seconds(service["stop_grace_period"])
        assert grace > config.shutdown_timeout_s, (
            f"{name}: docker stop must wait longer than the daemon's graceful shutdown"
        )


# ---------------------------------------------------------------------------
# compose <-> dashboards/


def test_prometheus_scrapes_each_sites_metrics_port(compose: dict[str, Any]) -> None:
    prometheus = compose["prometheus"]
    scrape = _yaml(_binds(prometheus)["/etc/prometheus/prometheus.yml"].read_text())
    targets = [
        t for job in scrape["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    ]
    by_host = {_host(t): _port(t) for t in targets}
    sites = _sites(compose)
    for name in BASE_SITES:
        config = _site_config(sites[name])
        assert config.metrics.listen is not None, f"{name}: metrics off"
        assert by_host.get(name) == _port(config.metrics.listen), f"{name}: targets {targets}"
        assert str(by_host[name]) in sites[name]["expose"]
    coordinator = compose[COORDINATOR]
    metrics = _coordinator_config(coordinator).metrics.listen
    assert metrics, "coordinator: metrics off"
    assert by_host.get(COORDINATOR) == _port(metrics), f"coordinator: targets {targets}"
    assert str(_port(metrics)) in coordinator["expose"]
    scraped = {*sites, COORDINATOR}
    assert set(by_host) <= scraped, f"targets that are no compose service: {targets}"


def test_grafana_provisioning_points_at_the_mounted_dashboard_and_prometheus(
    compose: dict[str, Any],
) -> None:
    binds = _binds(compose["grafana"])
    provisioning = binds["/etc/grafana/provisioning"]
    dashboards = [t for t, s in binds.items() if s.suffix == ".json"]
    assert dashboards, "a dashboard JSON is mounted"
    providers = [
        p
        for f in sorted((provisioning / "dashboards").glob("*.yml"))
        for p in _yaml(f.read_text())["providers"]
    ]
    paths = {p["options"]["path"].rstrip("/") for p in providers}
    assert {str(Path(t).parent) for t in dashboards} <= paths
    sources = [
        d
        for f in sorted((provisioning / "datasources").glob("*.yml"))
        for d in _yaml(f.read_text())["datasources"]
    ]
    published = {str(p).split(":")[-1].split("/")[0] for p in compose["prometheus"]["ports"]}
    urls = {d["url"] for d in sources if d["type"] == "prometheus"}
    assert urls == {f"http://prometheus:{port}" for port in published}


# ---------------------------------------------------------------------------
# the Dockerfiles <-> the site configs, the CLI and the package


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_ports_command_and_health_check_match_the_site_configs(
    path: Path, compose: dict[str, Any]
) -> None:
    configs = [_site_config(s) for s in _sites(compose).values()]
    listen = {_port(c.listen) for c in configs}
    metrics = {_port(c.metrics.listen or "") for c in configs}
    bulk = {c.bulk_port for c in configs}
    assert len(listen) == len(metrics) == len(bulk) == 1, "every site uses the image's ports"
    assert 0 not in bulk, "a container's bulk lane has a fixed port to map"
    exposed = {int(p.split("/")[0]) for p in _one(path, "EXPOSE").split()}
    assert exposed == listen | metrics | bulk

    entrypoint, cmd = json.loads(_one(path, "ENTRYPOINT")), json.loads(_one(path, "CMD"))
    assert entrypoint == ["gossipd", "node"]
    args = build_parser().parse_args([*entrypoint[1:], *cmd])
    assert str(args.config) == _site_config_path()
    for name, service in _sites(compose).items():
        assert _site_config_path() in _binds(service), f"{name} mounts its config there"

    options, _, check = _one(path, "HEALTHCHECK").partition(" CMD ")
    flags = dict(re.findall(r"--([\w-]+)=(\S+)", options))
    probe = json.loads(check)
    assert probe[0] == "gossipd"
    args = build_parser().parse_args(probe[1:])
    assert args.command == "health"
    assert _host(args.address) == "127.0.0.1" and {_port(args.address)} == listen
    assert str(args.config) == _site_config_path(), "it presents the site's own certificate"
    assert args.timeout_s < _seconds(flags["timeout"])


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_build_copies_every_package_dir_and_dockerignore_lets_it_through(path: Path) -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    needed = {"pyproject.toml", project["project"]["readme"]}
    needed |= set(project["tool"]["setuptools"]["package-dir"].values())
    copied: set[str] = set()
    for word, rest in _instructions(path):
        if word == "COPY" and not rest.startswith("--from"):
            copied |= {s.rstrip("/") for s in rest.split()[:-1]}
    assert copied == needed, f"{path.name} copies {sorted(copied)}, the package needs {needed}"
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for source in copied:
        assert (REPO / source).exists(), source
        assert not _dockerignored(source, patterns), f"{source} is kept out of the context"
    for secret in (
        ".git/config",
        ".venv/bin/python",
        "tests/test_containers.py",
        "docker/certs/ca/ca.key",
        "docker/certs/site-a/site-a.key",
        "docker/certs/operator/operator.key",
        "docker/.env",
        "gossipd-state/checkpoint.pt",
        "node/__pycache__/cli.cpython-311.pyc",
    ):
        assert _dockerignored(secret, patterns), f"{secret} must not enter the build context"


def _dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule, as far as the file uses it: the last matching pattern
    wins, a pattern matches a path or any of its parent directories, ``!`` keeps."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        keep = pattern.startswith("!")
        glob = pattern.removeprefix("!")
        globs = [glob, glob.removeprefix("**/")] if glob.startswith("**/") else [glob]
        if any(fnmatch.fnmatchcase(p, g) for p in prefixes for g in globs):
            ignored = not keep
    return ignored


def test_git_ignores_every_file_make_certs_writes(certs: Path) -> None:
    written = [p.relative_to(certs) for p in certs.rglob("*") if p.is_file()]
    assert Path(".env") in written or os.getuid() == 0
    paths = [str(Path("docker") / p) for p in written] + ["docker/.env"]
    done = _run(["git", "-C", str(REPO), "check-ignore", "--no-index", *paths])
    ignored = set(done.stdout.splitlines())
    assert ignored == set(paths), f"not ignored by git: {sorted(set(paths) - ignored)}"


def test_sites_stop_restarting_after_a_few_failed_starts(compose: dict[str, Any]) -> None:
    """A start-up mistake exits 2 and would again on every restart: a site (or the
    coordinator) restarts a few times at most (on-failure:N, never `always` or
    `unless-stopped`), so its last log line, the reason, stays readable instead of
    scrolling by forever."""
    for name, service in {**_sites(compose), COORDINATOR: compose[COORDINATOR]}.items():
        policy, _, tries = service["restart"].partition(":")
        assert policy == "on-failure" and 1 <= int(tries) <= 5, f"{name}: {service['restart']}"
