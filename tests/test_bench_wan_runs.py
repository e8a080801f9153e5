"""`gossipd bench wan` run for real: real `gossipd node` processes in real network
namespaces shaped by tc (one run with a site behind the testbed's NAT router), and on
loopback.

The namespace runs need root and iproute2 (and nftables for the NAT) and are skipped,
with the reason, where those are missing; the loopback run works everywhere.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gossipd.bench import wan_nat, wan_net
from tests.conftest import left_running

ROOT, WHY_NOT = wan_net.have_root()
NFT_MISSING = wan_nat.nft_missing()
RUN_TIMEOUT_S = 400.0
ROW_FIELDS = {
    "time_to_target_s",
    "final_accuracy",
    "bytes_per_site",
    "wait_fraction",
    "speedup_vs_allreduce",
    "speedup_vs_diloco",
    "steps_per_site",
    "outer_steps_per_site",
    "bytes_per_site_to_target",
    "weight_shares",
}
TOP_FIELDS = {"scenario", "sites", "job", "target", "testbed", "protocols", "throughput"}


def bench(tmp_path: Path, *args: str) -> tuple[dict[str, Any], subprocess.Popen[str], str]:
    """`gossipd bench wan ... --json`, bounded: on timeout it gets SIGTERM (it then stops
    its sites and removes its testbed) and is reaped."""
    argv = [sys.executable, "-m", "gossipd.node.cli", "bench", "wan", *args, "--json"]
    argv += ["--workdir", str(tmp_path / "work"), "--plot", str(tmp_path / "wan.png")]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        pytest.fail(f"bench wan did not end in {RUN_TIMEOUT_S:.0f} s:\n{err[-3000:]}")
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), proc, err


def check_fields(result: dict[str, Any], protocols: list[str]) -> None:
    assert set(result) >= TOP_FIELDS
    assert list(result["protocols"]) == protocols
    for name in protocols:
        assert set(result["protocols"][name]) >= ROW_FIELDS, name


@pytest.mark.skipif(not ROOT, reason=f"the testbed needs namespaces: {WHY_NOT}")
def test_namespace_run_compares_sumweight_with_both_baselines_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    result, proc, err = bench(
        tmp_path,
        "--scenario",
        "uniform-100mbit-5ms",
        "--sites",
        "2",
        "--protocols",
        "sumweight,allreduce,diloco",
        "--budget-s",
        "2",
        "--inner-steps",
        "50",
        "--no-throughput",
    )
    check_fields(result, ["sumweight", "allreduce", "diloco"])
    assert result["testbed"].startswith("network namespaces on ")
    assert result["sites"] == 2 and result["job"] == "digits"
    assert result["throughput"] is None
    rows_ = result["protocols"]
    assert rows_["allreduce"]["speedup_vs_allreduce"] in (1.0, None)
    assert rows_["sumweight"]["outer_steps_per_site"] == 0  # no outer optimizer
    assert rows_["allreduce"]["outer_steps_per_site"] is None
    assert rows_["diloco"]["outer_steps_per_site"] is not None
    for name, row in rows_.items():
        assert row["bytes_per_site"] > 0, name
        assert row["steps_per_site"] > 0, name
        assert 0.0 <= row["wait_fraction"] <= 1.0, name
        assert 0.0 < row["final_accuracy"] <= 1.0, name
        if row["time_to_target_s"] is not None:
            assert 0 <= row["bytes_per_site_to_target"] <= row["bytes_per_site"], name
        over_time = row["bytes_per_site_over_time"]
        assert over_time and [b for _, b in over_time] == sorted(b for _, b in over_time), name
        assert over_time[-1][1] <= row["bytes_per_site"], name
    assert sum(rows_["sumweight"]["weight_shares"]) == pytest.approx(2.0)
    assert rows_["allreduce"]["weight_shares"] is None and rows_["diloco"]["weight_shares"] is None
    # DiLoCo all-reduces the model once per 50 steps, DDP its gradient every step.
    assert rows_["diloco"]["bytes_per_site"] < rows_["allreduce"]["bytes_per_site"]
    # DDP waits on the 5 ms latency hook every step; gossip never waits for the network.
    assert rows_["allreduce"]["wait_fraction"] > rows_["sumweight"]["wait_fraction"]
    assert "running allreduce" in err and str(tmp_path / "work" / "allreduce") in err
    assert Path(result["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert wan_net.leftovers(wan_net.process_prefix(proc.pid)) == []
    assert left_running(tmp_path / "work") == []


def test_loopback_run_says_so_and_counts_no_bytes(tmp_path: Path) -> None:
    result, _proc, err = bench(
        tmp_path,
        "--scenario",
        "uniform-100mbit-5ms",
        "--sites",
        "2",
        "--protocols",
        "sumweight",
        "--budget-s",
        "2",
        "--loopback",
    )
    check_fields(result, ["sumweight"])
    assert result["testbed"].startswith("loopback: in-process shaping")
    row = result["protocols"]["sumweight"]
    assert row["bytes_per_site"] is None and row["bytes_per_site_over_time"] is None
    assert row["speedup_vs_allreduce"] is None  # no allreduce run to compare with
    throughput = result["throughput"]
    assert throughput["protocol"] == "sumweight"
    assert throughput["on_steps_per_s"] > 0 and throughput["off_steps_per_s"] > 0
    assert throughput["ratio"] == pytest.approx(
        throughput["on_steps_per_s"] / throughput["off_steps_per_s"]
    )
    assert 0.0 < throughput["alone_final_accuracy"] <= 1.0
    assert "testbed: loopback: in-process shaping" in err
    assert "each site alone (no gossip): to target" in err
    assert left_running(tmp_path / "work") == []
    assert os.path.exists(result["plot"])


@pytest.mark.skipif(
    not ROOT or NFT_MISSING is not None,
    reason=f"the NAT router needs namespaces and nftables: {WHY_NOT if not ROOT else NFT_MISSING}",
)
def test_a_natted_site_is_reached_through_a_relay_and_the_bytes_relayed_are_counted(
    tmp_path: Path,
) -> None:
    result, proc, err = bench(
        tmp_path,
        "--scenario",
        "uniform-100mbit-5ms",
        "--sites",
        "3",
        "--natted",
        "1",
        "--protocols",
        "sumweight",
        "--budget-s",
        "4",
        "--no-throughput",
    )
    check_fields(result, ["sumweight"])
    assert (result["natted"], result["tls"]) == (1, True)
    row = result["protocols"]["sumweight"]
    assert set(row["relay_bytes"]) == {"site-0", "site-1"}  # the public sites
    assert sum(row["relay_bytes"].values()) > 0
    assert sum(row["weight_shares"]) == pytest.approx(3.0)
    log = (tmp_path / "work" / "sumweight" / "site-2" / "node.log").read_text()
    assert "outbound-only, relayed by " in log
    assert "site 2 natted (reached through relays)" in err and "MB/relay" in err
    assert wan_net.leftovers(wan_net.process_prefix(proc.pid)) == []
    assert left_running(tmp_path / "work") == []
