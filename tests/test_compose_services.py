"""The compose services beside the sites, the coordinator and the MQTT broker, and every
service's health check.

Apart from tests/test_containers.py (the sites, the images, the scripts), with its
helpers: ``compose`` is docker-compose's merged config, ``certs`` what
docker/make-certs.sh's default run writes. The coordinator's config goes through the coordinator's
own loader and its command through gossipd's parser. The health checks that compose
states itself run for real: the coordinator's Python program asks a real
``gossipd coordinator`` holding the script's certificate, and the broker's
``mosquitto_sub`` asks Debian's Mosquitto reading docker/mosquitto.conf, each with
only its address made local. The operator's control command of docs/containers.md is
parsed with gossipd's parser, signed by ``gossipd control``'s own code with the script's
operator certificate and checked by each site's own verifier.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from gossipd.node.cli.control import mesh_ca, signed_payload
from gossipd.node.cli.main import build_parser
from gossipd.node.launch.localmesh import free_ports, stop_process
from gossipd.node.shared.cert_files import load_cert
from gossipd.node.shared.certs import check_pair
from gossipd.node.shared.control_signing import ControlVerifier
from tests.compose_files import (
    BASE_SITES,
    BROKER,
    CERTS_TARGET,
    COMPOSE,
    COMPOSE_JOIN,
    COORDINATOR,
    DOCKER,
    DOCKERFILES,
    MOSQUITTO_CONF,
    REPO,
    TIMEOUT_S,
    _binds,
    _compose_config,
    _coordinator_config,
    _host,
    _host_path,
    _named_volumes,
    _one,
    _port,
    _seconds,
    _site_config,
    _sites,
    make_certs,
)
from tests.conftest import coordinator_process, wait_until
from tests.mqttbrokers import MOSQUITTO

WAIT_S = 30.0
# The `docker compose run` options the docs' control command may use: name -> takes a value.
RUN_OPTIONS = {"--rm": False, "-v": True, "--entrypoint": True}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """compose.yaml with the join override: every service, site-d included."""
    return _compose_config(COMPOSE, COMPOSE_JOIN)["services"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What docker/make-certs.sh writes by default: the CA, site-a..c, the coordinator."""
    out = tmp_path_factory.mktemp("compose")
    make_certs(out)
    return out


def _health_test(service: dict[str, Any]) -> list[str]:
    """The service's own health check command (``CMD`` form), as the container runs it:
    ``docker-compose config`` keeps compose's escape ``$$`` for a literal ``$``."""
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD", f"exec form, no shell: {test}"
    return [a.replace("$$", "$") for a in test[1:]]


# ---------------------------------------------------------------------------
# every service


def test_every_service_has_a_health_check_and_only_sites_use_the_images(
    compose: dict[str, Any],
) -> None:
    """``docker compose ps`` shows each service healthy or not: a site by the image's
    HEALTHCHECK (``gossipd health`` with site.toml); any other service by its own."""
    image_check = _one(DOCKERFILES[0], "HEALTHCHECK")
    assert "site.toml" in image_check, "the image's health check is a site's"
    sites = _sites(compose)
    for name, service in compose.items():
        check = service.get("healthcheck")
        if check is None:
            assert name in sites and "build" in service, f"{name}: no health check"
            continue
        assert not check.get("disable"), f"{name}: health check disabled"
        argv = _health_test(service)
        assert argv and argv != ["NONE"], f"{name}: {check['test']}"
        assert _seconds(check["timeout"]) < _seconds(check["interval"]), name
        assert int(check["retries"]) >= 1, name
    assert "healthcheck" in compose[COORDINATOR], "the image's site check would fail there"


# ---------------------------------------------------------------------------
# the coordinator


def test_the_coordinator_runs_gossipd_coordinator_on_its_config_volume_and_certificate(
    compose: dict[str, Any], certs: Path
) -> None:
    service = compose[COORDINATOR]
    sites = _sites(compose)
    assert service["build"] == sites["site-a"]["build"], "the sites' image"
    config = _coordinator_config(service)
    assert {config.mesh_id} == {_site_config(s).mesh_id for s in sites.values()}
    assert _host(config.listen) == "0.0.0.0", "listen on every interface"
    assert str(_port(config.listen)) in service["expose"]
    assert list(_named_volumes(service)) == [str(config.data_dir)], "state.json survives"
    assert config.tls.allow is None, "every site of the mesh CA"
    files = [_host_path(p, service, certs) for p in (config.tls.ca, config.tls.cert)]
    key = _host_path(config.tls.key, service, certs)
    assert check_pair(*files, key, coordinator=True) == COORDINATOR, "a coordinator certificate"
    assert sorted(os.listdir(key.parent)) == sorted(
        ["ca.pem", f"{COORDINATOR}.pem", f"{COORDINATOR}.key"]
    )
    for name, site in sites.items():
        site_config = _site_config(site)
        expected = f"{COORDINATOR}:{_port(config.listen)}"
        assert site_config.coordinator == expected, f"{name} dials the coordinator"
        # The protocol whose pulls it schedules (a mismatch is refused at the handshake).
        assert site_config.gossip.protocol == "overlap", f"{name}: {site_config.gossip.protocol}"


@contextmanager
def _coordinator(
    service: dict[str, Any], certs: Path, workdir: Path
) -> Iterator[tuple[str, list[str]]]:
    """``gossipd coordinator`` on the service's config and certificate, listening on a
    free loopback port; yields its address and the service's health check argv made
    local (this interpreter, that address, the certificate files on the host)."""
    config = _coordinator_config(service)
    data = json.loads(config.model_dump_json())
    data.update(listen="127.0.0.1:0", data_dir=str(workdir / "coord"), metrics={"listen": ""})
    local = {
        str(getattr(config.tls, k)): str(_host_path(getattr(config.tls, k), service, certs))
        for k in ("ca", "cert", "key")
    }
    data["tls"] = {k: local[v] for k, v in data["tls"].items() if v is not None}
    with coordinator_process(data, workdir) as bound:
        address = bound["address"]
        argv = _health_test(service)
        assert argv[0] == "python", argv
        served = f"127.0.0.1:{_port(config.listen)}"
        assert served in argv, f"the check asks the port it listens on: {argv}"
        argv = [sys.executable, *(address if a == served else local.get(a, a) for a in argv[1:])]
        assert not [a for a in argv if a.startswith(CERTS_TARGET)], argv
        yield address, argv


def test_the_coordinators_health_check_gets_serving_from_a_real_coordinator(
    compose: dict[str, Any], certs: Path, tmp_path: Path
) -> None:
    with _coordinator(compose[COORDINATOR], certs, tmp_path) as (_, argv):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S)
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.strip() == "SERVING"
    # The same check once nothing listens there: unhealthy.
    done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode != 0, done.stdout
    assert "UNAVAILABLE" in done.stderr, done.stderr[-2000:]


# ---------------------------------------------------------------------------
# the broker


def _broker_port(compose: dict[str, Any]) -> tuple[Path, int]:
    """docker/mosquitto.conf (where compose mounts it) and the one port it listens on."""
    service = compose[BROKER]
    conf = _binds(service)[MOSQUITTO_CONF]
    listeners = re.findall(r"^listener (\d+)\s*$", conf.read_text(), re.M)
    assert len(listeners) == 1, f"{conf}: one listener on every interface: {listeners}"
    port = int(listeners[0])
    assert str(port) in service["expose"], f"{conf} listens on {port}, not exposed"
    assert not service.get("ports"), "anonymous plaintext MQTT: the compose network only"
    return conf, port


def test_every_site_finds_the_broker_by_service_name_and_port(compose: dict[str, Any]) -> None:
    _, port = _broker_port(compose)
    for name, service in _sites(compose).items():
        mqtt = _site_config(service).mqtt
        assert mqtt is not None, f"{name}: no [mqtt]"
        assert mqtt.broker == f"{BROKER}:{port}", f"{name}: broker {mqtt.broker}"
        assert mqtt.topic_prefix == "gossipd"


def test_mosquitto_runs_the_brokers_config_and_its_health_check_answers(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    conf, port = _broker_port(compose)
    mosquitto_sub = shutil.which("mosquitto_sub")
    if mosquitto_sub is None:
        pytest.fail(
            "mosquitto_sub is not on PATH; tests/run.sh installs it with "
            "`apt-get install mosquitto-clients`; install it the same way"
        )
    (local_port,) = free_ports(1)
    text = re.sub(
        rf"^listener {port}\s*$", f"listener {local_port} 127.0.0.1", conf.read_text(), flags=re.M
    )
    # Started as root, mosquitto would switch to user mosquitto, who cannot read tmp_path.
    local = tmp_path / "mosquitto.conf"
    local.write_text(f"{text}\nuser {getpass.getuser()}\n")
    log_path = tmp_path / "mosquitto.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([MOSQUITTO, "-c", str(local)], stdout=log, stderr=subprocess.STDOUT)
    try:

        def listening() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"mosquitto refused {conf}:\n{log_path.read_text()}")
            with socket.socket() as s:
                s.settimeout(1.0)
                return s.connect_ex(("127.0.0.1", local_port)) == 0

        wait_until(listening, "mosquitto to listen", WAIT_S)
        argv = _health_test(compose[BROKER])
        assert argv[0] == "mosquitto_sub" and argv[argv.index("-p") + 1] == str(port), argv
        argv[0], argv[argv.index("-p") + 1] = mosquitto_sub, str(local_port)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S)
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.startswith("mosquitto version"), done.stdout
    finally:
        stop_process(proc, 15.0)


# ---------------------------------------------------------------------------
# the operator's control command


def _docs_control_command() -> tuple[dict[str, list[str]], str, list[str]]:
    """docs/containers.md's ``docker compose run`` of ``gossipd control``, as the shell
    splits it: (its run options, the service, the command after the service)."""
    page = (REPO / "docs" / "containers.md").read_text()
    blocks = [b.split("```")[0] for b in page.split("```bash\n")[1:]]
    [block] = [b for b in blocks if " run " in b and " control " in b]
    argv = shlex.split(block.replace("\\\n", " "))
    assert argv[:5] == ["docker", "compose", "-f", str(COMPOSE.relative_to(REPO)), "run"], argv
    rest = argv[5:]
    options: dict[str, list[str]] = {}
    while rest[0].startswith("-"):
        option = rest.pop(0)
        assert option in RUN_OPTIONS, f"{option}: a run option this test does not read"
        options.setdefault(option, []).append(rest.pop(0) if RUN_OPTIONS[option] else "")
    service, *command = rest
    return options, service, command


def test_the_docs_control_command_is_signed_so_that_every_site_obeys_it(
    compose: dict[str, Any], certs: Path
) -> None:
    """Sites refuse unsigned commands, so the docs sign one in a one-off container of the
    site image that alone mounts the operator's key (read-only): its broker, mesh and
    topic prefix are the sites', and each site's own verifier accepts what it signs."""
    options, service, command = _docs_control_command()
    assert "--rm" in options, "a one-off container, removed when done"
    sites = _sites(compose)
    assert service in sites, f"{service}: the site image, on the compose network"
    entrypoint = json.loads(_one(DOCKERFILES[0], "ENTRYPOINT"))
    assert options.get("--entrypoint") == entrypoint[:1], f"gossipd, not {entrypoint}"
    [volume] = options["-v"]
    source, target, *mode = volume.split(":")
    assert mode == ["ro"], f"{volume}: the operator's key read-only"
    for bound in map(Path, _binds(sites[service])):
        assert not (bound.is_relative_to(target) or bound in Path(target).parents), volume
    # The docs run it from the repository root, as their -f docker/compose.yaml says.
    mounted = Path(source.replace("$PWD", str(REPO)))
    host_dir = certs / "certs" / mounted.relative_to(DOCKER / "certs")
    assert command[0] == "control", command
    args = build_parser().parse_args(command)
    assert args.node is None, "every site"
    for name, site in sites.items():
        config = _site_config(site)
        assert config.mqtt is not None and args.broker == config.mqtt.broker, name
        assert (args.mesh_id, args.topic_prefix) == (config.mesh_id, config.mqtt.topic_prefix)
    page = (REPO / "docs" / "containers.md").read_text()
    assert f"did not answer within {args.timeout_s:g} s" in page
    args.cert = host_dir / args.cert.relative_to(target)
    args.key = host_dir / args.key.relative_to(target)
    signed, _ = signed_payload(args, "docs-r1")
    payload = json.loads(signed)
    # The replies are checked against the ca.pem the script puts beside the operator's
    # certificate: the sites' own CA.
    assert mesh_ca(args) == load_cert(host_dir / "ca.pem")
    for name in BASE_SITES:
        config = _site_config(sites[name])
        assert config.mqtt is not None and config.mqtt.control_requires_signature, name
        verifier = ControlVerifier(
            load_cert(_host_path(config.tls.ca, sites[name], certs)),
            mesh_id=config.mesh_id,
            node_id=config.node_id,
            window_s=config.mqtt.control_window_s,
        )
        assert verifier.check(payload, time.time()) == args.cert.stem, name
