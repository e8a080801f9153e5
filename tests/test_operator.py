"""An operator's first hour with one TLS site daemon, started as the README says (no flags).

One daemon (module scope) serves the log, status and refusal tests; the start-up
failures need no daemon at all: they must fail before torch is even imported.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gossipd.node.launch.localmesh import free_ports, stop_process
from tests.conftest import (
    DaemonHandle,
    answering,
    check_alive,
    scrape_metrics,
    status_of,
    wait_until,
    write_node_config,
)
from tests.fakepeer import push_tls, synthetic_plan
from tests.tls_mesh import PLAINTEXT, FilesTls, Pki

CORE_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d", re.MULTILINE)


def _gossipd(*argv: str, log_path: Path | None = None) -> subprocess.Popen[bytes]:
    """``gossipd ARGV`` as an operator types it: no --log-level."""
    out = open(log_path, "ab") if log_path else subprocess.PIPE  # noqa: SIM115
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "gossipd.node.cli", *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    finally:
        if log_path:
            out.close()  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki.create(tmp_path_factory.mktemp("pki"), ["site", "peer"])


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[DaemonHandle]:
    root = tmp_path_factory.mktemp("operator")
    (port,) = free_ports(1)
    data_dir = root / "site"
    config = write_node_config(
        root, "site", port, data_dir, tls=pki.tls_config("site"), progress_interval_s=0.3
    )
    data_dir.mkdir()
    proc = _gossipd("node", "--config", str(config), log_path=data_dir / "node.log")
    handle = answering(
        DaemonHandle("site", f"127.0.0.1:{port}", data_dir, config, proc, pki.creds("site"))
    )
    yield handle
    handle.stop()


def test_default_log_level_is_info_and_a_progress_line_comes_each_interval(
    site: DaemonHandle,
) -> None:
    def two_lines() -> bool:
        return len(re.findall(r"INFO progress: step \d+", site.log())) >= 2

    wait_until(two_lines, "two progress lines", 60, lambda: check_alive([site]))
    line = re.findall(r"progress: .*", site.log())[-1]
    for part in ("steps/s", "loss", "live peers", "weight 1", "pushes acknowledged/s"):
        assert part in line, line


def test_a_client_without_a_certificate_is_a_counted_refusal_not_a_grpc_core_line(
    site: DaemonHandle, pki: Pki
) -> None:
    from tests.fakepeer import status_tls

    no_cert = FilesTls(pki.ca)
    for tls in (no_cert, PLAINTEXT, no_cert):
        code, _, _ = status_tls(tls, site.address)
        assert code.name == "UNAVAILABLE"
    wait_until(
        lambda: status_of(site)["rejected"].get("TlsHandshake", 0) >= 3,
        "three counted TLS handshake refusals",
        30,
        lambda: check_alive([site]),
    )
    log = site.log()
    assert not CORE_LINE.search(log), log[-3000:]
    assert "Handshake failed with error" not in log
    lines = [ln for ln in log.splitlines() if "TLS handshake failed" in ln]
    assert len(lines) == 1, lines  # one line per interval, however many clients
    assert "WARNING refused a request from a TLS client" in lines[0]
    assert "--config SITE.toml" in lines[0]


def test_a_push_before_the_handshake_rejoin_race_is_counted_and_logged_once_at_info(
    site: DaemonHandle, pki: Pki
) -> None:
    numel = synthetic_plan().segments[0].numel
    outcomes = [
        push_tls(
            pki.creds("peer"),
            site.address,
            sender="peer",
            incarnation=1,
            sequence=sequence,
            weight=0.5,
            values=torch.zeros(numel),
        )
        for sequence in (1, 2, 3)
    ]
    assert not any(o.merged for o in outcomes)
    assert status_of(site)["rejected"]["UnknownPeer"] == 3
    lines = [ln for ln in site.log().splitlines() if "is not a verified peer" in ln]
    assert len(lines) == 1, lines
    assert " INFO refused a request from " in lines[0]
    assert "usual for a moment after that peer starts or rejoins" in lines[0]
    assert status_of(site)["sum_weights"] == [1.0]  # nothing merged, nothing lost


def test_status_prints_a_table_and_json_on_request(site: DaemonHandle, pki: Pki) -> None:
    argv = ["status", "--address", site.address, "--config", str(site.config_path)]
    argv += ["--timeout-s", "60"]  # a busy test machine; the default is for people
    table = subprocess.run(
        [sys.executable, "-m", "gossipd.node.cli", *argv], capture_output=True, text=True
    )
    assert table.returncode == 0, (table.stdout, table.stderr)
    assert re.search(r"^node\s+site \(mesh test-mesh, sumweight\)$", table.stdout, re.M)
    assert re.search(r"^sum-weight\s+1 \(all \d+ segments\)$", table.stdout, re.M)
    assert re.search(r"^pushes\s+\d+ acknowledged, ", table.stdout, re.M), table.stdout
    assert re.search(r"^test\s+(– \(no evaluation yet\)|\w+ [\d.]+)", table.stdout, re.M)
    assert "{" not in table.stdout and "[" not in table.stdout, table.stdout  # no reprs
    as_json = subprocess.run(
        [sys.executable, "-m", "gossipd.node.cli", *argv, "--json"],
        capture_output=True,
        text=True,
    )
    assert as_json.returncode == 0, (as_json.stdout, as_json.stderr)
    assert as_json.stdout.lstrip().startswith("{"), (as_json.stdout, as_json.stderr)
    assert json.loads(as_json.stdout)["node_id"] == "site"


def _start_failure(tmp_path: Path, data_dir: Path | None = None, **config: object) -> str:
    """stderr of `gossipd node` with ``config``; it must exit 2 before torch is imported."""
    (port,) = free_ports(1)
    path = write_node_config(tmp_path, "bad", port, data_dir or tmp_path / "bad", **config)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "gossipd.node.cli",
            "node",
            "--config",
            path,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        stop_process(proc)
    assert proc.returncode == 2, err[-3000:]
    imported = [ln.rsplit("|", 1)[-1].strip() for ln in err.splitlines() if "import time:" in ln]
    assert "gossipd.node.shared.config" in imported  # -X importtime did report
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")]
    return "\n".join(ln for ln in err.splitlines() if "import time:" not in ln)


def test_a_wrong_certificate_path_fails_before_torch_is_imported(tmp_path: Path, pki: Pki) -> None:
    tls = {**pki.tls_config("site"), "cert": str(tmp_path / "missing.pem")}
    err = _start_failure(tmp_path, tls=tls)
    assert f"gossipd: error: cannot read certificate {tmp_path / 'missing.pem'}" in err


def test_a_certificate_of_another_node_fails_before_torch_is_imported(
    tmp_path: Path, pki: Pki
) -> None:
    err = _start_failure(tmp_path, tls=pki.tls_config("peer"))
    assert "is for node 'peer', but node_id is 'bad'" in err


def test_a_taken_port_and_an_unwritable_data_dir_fail_before_torch_is_imported(
    tmp_path: Path, site: DaemonHandle
) -> None:
    err = _start_failure(tmp_path, listen=site.address)
    assert f"listen = '{site.address}': cannot listen there" in err
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    err = _start_failure(tmp_path, data_dir=blocker / "state")
    assert f"data_dir = {blocker / 'state'}: cannot write there" in err


def test_metrics_export_the_reserved_weight_beside_the_sum_weight(site: DaemonHandle) -> None:
    """The dashboard's bracket for the mesh total, Σ(weight − reserved) ≤ total ≤ Σ weight,
    needs what each node has promised to pushes in flight, per segment."""
    metrics = scrape_metrics(site.node_json()["metrics_port"])
    status = status_of(site)
    segments = len(status["sum_weights"])
    reserved = [metrics[f'gossipd_sum_weight_reserved{{segment="{i}"}}'] for i in range(segments)]
    weights = [metrics[f'gossipd_sum_weight{{segment="{i}"}}'] for i in range(segments)]
    assert reserved == status["reserved_weights"] == [0.0] * segments  # alone: nothing out
    assert weights == status["sum_weights"] == [1.0] * segments
