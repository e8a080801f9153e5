"""`gossipd bench wan`: the rules behind its numbers on hand-made histories, its options,
site configs and table (the real runs are in tests/test_bench_wan_runs.py)."""

from __future__ import annotations

import io
import math
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gossipd.bench.wan import add_speedups, build_parser, run, runs_of
from gossipd.bench.wan_options import _codecs, _site_ranks, check
from gossipd.bench.wan_report import print_table
from gossipd.bench.wan_results import (
    DEFAULT_TARGETS,
    Target,
    bytes_at,
    clipped_share,
    eval_every_steps,
    final_metric,
    first_reached_unix_s,
    mean_curve,
    speedup,
    target_for,
    time_to_target_s,
    weight_shares,
)
from gossipd.bench.wan_scenarios import scenario
from gossipd.bench.wan_sites import WanSpec, site_toml
from gossipd.node.errors import ConfigError
from gossipd.node.shared.config import parse_config
from gossipd.node.shared.config_ranks import BASELINE_SECTIONS

ACCURACY = Target("test_accuracy", 0.9, lower_is_better=False)
LOSS = Target("test_loss", 0.02, lower_is_better=True)


def rows(*points: tuple[float, float], metric: str = "test_accuracy") -> list[dict[str, Any]]:
    return [{"unix_s": t, "step": 10 * k, metric: v} for k, (t, v) in enumerate(points)]


# -- the rules, on hand-made histories ---------------------------------------------------
def test_time_to_target_waits_for_the_last_site_to_reach_it() -> None:
    early = rows((101.0, 0.5), (102.0, 0.91), (103.0, 0.85))
    late = rows((101.5, 0.6), (104.0, 0.89), (107.5, 0.92))
    assert first_reached_unix_s(early, ACCURACY) == 102.0
    assert time_to_target_s([early, late], ACCURACY, t0_unix_s=100.0) == 7.5


def test_time_to_target_is_none_when_one_site_never_reaches_it() -> None:
    reached = rows((101.0, 0.95))
    never = rows((101.0, 0.5), (105.0, 0.899))
    assert time_to_target_s([reached, never], ACCURACY, 100.0) is None
    assert time_to_target_s([reached, []], ACCURACY, 100.0) is None
    assert time_to_target_s([], ACCURACY, 100.0) is None


def test_a_loss_target_is_reached_from_above() -> None:
    a = rows((11.0, 0.5), (12.0, 0.019), metric="test_loss")
    b = rows((11.0, 0.02), metric="test_loss")
    assert time_to_target_s([a, b], LOSS, 10.0) == 2.0
    assert LOSS.reached({"test_loss": math.nan}) is False


def test_final_metric_is_the_mean_of_each_sites_last_evaluation() -> None:
    a = rows((1.0, 0.5), (2.0, 0.8))
    b = rows((1.0, 0.9), (3.0, 1.0))
    assert final_metric([a, b], "test_accuracy") == pytest.approx(0.9)
    assert final_metric([a, []], "test_accuracy") is None


def test_speedup_is_allreduce_time_over_the_protocols() -> None:
    assert speedup(50.0, 10.0) == 5.0
    assert speedup(None, 10.0) is None and speedup(50.0, None) is None
    table = {
        "allreduce": {"time_to_target_s": 40.0},
        "sumweight": {"time_to_target_s": 8.0},
        "persyn": {"time_to_target_s": None},
    }
    add_speedups(table)
    assert [r["speedup_vs_allreduce"] for r in table.values()] == [1.0, 5.0, None]
    lone = {"sumweight": {"time_to_target_s": 8.0}}
    add_speedups(lone)
    assert lone["sumweight"]["speedup_vs_allreduce"] is None


def test_each_job_has_its_target_and_a_bad_bar_is_refused() -> None:
    assert target_for("digits") == Target("test_accuracy", 0.90, lower_is_better=False)
    assert target_for("synthetic") == Target("test_loss", 0.02, lower_is_better=True)
    assert target_for("digits", 0.95).value == 0.95
    assert target_for("mnist1d") == Target("test_accuracy", 0.80, lower_is_better=False)
    assert target_for("shakespeare") == Target("test_loss", 1.74, lower_is_better=True)
    assert set(DEFAULT_TARGETS) == {"digits", "mnist1d", "shakespeare", "synthetic"}
    with pytest.raises(ConfigError, match=r"--target 1\.5 .* 0 to 1"):
        target_for("digits", 1.5)
    with pytest.raises(ConfigError, match="no target known for job 'mnist'"):
        target_for("mnist")


def test_mean_curve_starts_once_every_site_evaluated() -> None:
    a = rows((11.0, 0.2), (13.0, 0.6))
    b = rows((12.0, 0.4))
    times, values = mean_curve([a, b], "test_accuracy", 10.0)
    assert times == [2.0, 3.0]
    assert values == pytest.approx([0.3, 0.5])


def test_allreduce_evaluates_every_step_at_50ms_and_gossip_less_often() -> None:
    assert eval_every_steps("allreduce", 8, 50.0) == 1  # 0.7 s a step
    assert eval_every_steps("allreduce", 8, 5.0) == 6  # 72 ms a step
    assert eval_every_steps("sumweight", 8, 50.0) > eval_every_steps("allreduce", 8, 5.0)
    assert eval_every_steps("diloco", 8, 50.0, inner_steps=40) == 40  # at each outer step


def test_bytes_to_target_interpolate_the_counters_sampled_during_the_run() -> None:
    samples = [(10.0, 0.0), (12.0, 200.0), (14.0, 600.0)]
    assert bytes_at(samples, 11.0) == pytest.approx(100.0)
    assert bytes_at(samples, 13.5) == pytest.approx(500.0)
    assert bytes_at(samples, 9.0) == 0.0  # before the first sample: its count
    assert bytes_at(samples, 15.0) is None  # past the last: unknown, not extrapolated
    assert bytes_at([], 11.0) is None and bytes_at(samples, None) is None


def test_weight_shares_are_each_sites_share_times_the_number_of_sites() -> None:
    summaries = [{"sum_weights": [0.5, 1.5]}, {"sum_weights": [1.0, 1.0]}, {"sum_weights": [0, 0]}]
    assert weight_shares(summaries) == pytest.approx([1.5, 1.5, 0.0])
    assert weight_shares([{"sum_weights": []}, {"sum_weights": [1.0]}]) is None  # a baseline
    assert weight_shares([{}, {"sum_weights": [1.0]}]) is None  # a site wrote nothing


def _site_config(spec: WanSpec, protocol: str, index: int = 0) -> dict[str, Any]:
    """Site ``index``'s config as the bench writes it (a baseline's rendezvous: site 0)."""
    addresses = [f"127.0.0.1:{9000 + i}" for i in range(spec.sites)]
    master = addresses[0] if protocol in BASELINE_SECTIONS else None
    text = site_toml(spec, protocol, index, addresses, 20.0, None, spec.workdir, master=master)
    return tomllib.loads(text)


def test_weight_balance_reaches_the_gossip_sites_configs_and_no_baselines(tmp_path: Path) -> None:
    spec = WanSpec(
        scenario=scenario("mixed"), sites=4, job="digits", budget_s=1.0, workdir=tmp_path
    )

    def gossip_table(spec: WanSpec, protocol: str) -> dict[str, Any]:
        return _site_config(spec, protocol)["gossip"]

    assert "weight_balance" not in gossip_table(spec, "sumweight")  # the config's default: on
    bare = replace(spec, weight_balance=False)
    assert gossip_table(bare, "pushsum-expgraph")["weight_balance"] is False
    assert "weight_balance" not in gossip_table(bare, "allreduce")


def test_a_lossy_codec_reaches_the_gossip_sites_with_error_feedback_and_no_baseline(
    tmp_path: Path,
) -> None:
    spec = WanSpec(
        scenario=scenario("mixed"), sites=2, job="digits", budget_s=1.0, workdir=tmp_path
    )

    def gossip_table(spec: WanSpec, protocol: str) -> dict[str, Any]:
        return _site_config(spec, protocol)["gossip"]

    assert "codec" not in gossip_table(spec, "sumweight")
    int8 = replace(spec, codec="int8")
    table = gossip_table(int8, "pushsum-expgraph")
    assert (table["codec"], table["error_feedback"]) == ("int8", True)
    for baseline in ("allreduce", "diloco"):
        assert "codec" not in gossip_table(int8, baseline)
    outer = replace(spec, persyn_outer=True, inner_steps=30)
    persyn = gossip_table(outer, "persyn")["persyn"]
    assert persyn == {
        "average_every_steps": 30,
        "outer_learning_rate": 0.7,
        "outer_momentum": 0.9,
    }
    assert "persyn" not in gossip_table(spec, "persyn")


def test_a_clip_factor_or_credit_reaches_the_gossip_sites_limits_and_no_baseline(
    tmp_path: Path,
) -> None:
    spec = WanSpec(
        scenario=scenario("mixed"), sites=2, job="digits", budget_s=1.0, workdir=tmp_path
    )

    def limits(spec: WanSpec, protocol: str) -> dict[str, Any]:
        return _site_config(spec, protocol)["limits"]

    assert limits(spec, "sumweight") == {}  # the config's default
    assert limits(replace(spec, clip_factor=4.0), "persyn") == {"clip_factor": 4.0}
    off = replace(spec, clip_factor=math.inf)
    assert limits(off, "crossover") == {"clip_factor": math.inf}  # TOML's inf, not JSON's
    assert limits(off, "diloco") == {}
    both = replace(off, peer_credit=1 / 3)
    assert limits(both, "persyn") == {"clip_factor": math.inf, "peer_credit": 1 / 3}
    assert limits(both, "allreduce") == {}
    config = parse_config(_site_config(both, "persyn"), "site.toml")  # as the site reads it
    assert (config.limits.peer_credit, config.limits.clip_factor) == (1 / 3, math.inf)


def test_the_clipped_share_is_over_every_sites_merged_segments() -> None:
    summaries = [
        {"merged_segments": 90, "clipped_segments": 1},
        {"merged_segments": 10, "clipped_segments": 0},
        {},  # a site that wrote no summary
    ]
    assert clipped_share(summaries) == pytest.approx(0.01)
    assert clipped_share([{}, {"merged_segments": 0}]) is None


def test_a_seed_moves_every_sites_job_and_gossip_seed_apart(tmp_path: Path) -> None:
    spec = WanSpec(
        scenario=scenario("mixed"), sites=2, job="digits", budget_s=1.0, workdir=tmp_path
    )

    def seeds(spec: WanSpec, protocol: str, index: int) -> tuple[int, int]:
        table = _site_config(spec, protocol, index)
        return table["job"]["seed"], table["gossip"]["seed"]

    assert seeds(spec, "sumweight", 1) == (1, 1)  # seed 0: the runs measured before it
    assert seeds(replace(spec, seed=2), "sumweight", 1) == (2001, 2001)
    assert seeds(replace(spec, seed=2), "diloco", 0) == (2000, 2000)


def test_each_gossip_protocol_runs_once_per_codec_and_a_baseline_once() -> None:
    assert runs_of(["sumweight", "diloco"], ["raw", "int8", "int4"]) == [
        ("sumweight", "sumweight", "raw"),
        ("sumweight+int8", "sumweight", "int8"),
        ("sumweight+int4", "sumweight", "int4"),
        ("diloco", "diloco", "raw"),
    ]
    assert runs_of(["persyn", "diloco"], ["raw", "int8"], persyn_outer=True) == [
        ("persyn+outer", "persyn", "raw"),
        ("persyn+outer+int8", "persyn", "int8"),
        ("diloco", "diloco", "raw"),
    ]
    assert _codecs(" int8 ,raw") == ["int8", "raw"]
    for bad in ("", "zstd", "int8,int8"):
        with pytest.raises(ConfigError, match="--codecs"):
            _codecs(bad)


def test_site_ranks_are_one_whole_number_per_site() -> None:
    assert _site_ranks("", 4) == ()  # one rank each
    assert _site_ranks("2,1,1,1", 4) == (2, 1, 1, 1)
    for bad in ("2,1,1", "2,1,1,1,1", "0,1,1,1", "two,1,1,1", "2,,1,1"):
        with pytest.raises(ConfigError, match=r"--site-ranks .* 4 whole numbers"):
            _site_ranks(bad, 4)


@pytest.mark.parametrize(
    ("flag", "value"), [("--peer-credit", "0"), ("--peer-credit", "-1"), ("--clip-factor", "0")]
)
def test_a_credit_or_clip_factor_not_over_0_is_refused_before_anything_starts(
    tmp_path: Path, flag: str, value: str
) -> None:
    work = tmp_path / "work"
    args = build_parser().parse_args(["--scenario", "mixed", "--workdir", str(work), flag, value])
    with pytest.raises(ConfigError, match=f"{flag} {value}: give"):
        run(args, io.StringIO())
    assert not work.exists()


def test_natted_sites_are_the_last_ones_run_tls_and_refuse_the_baselines(
    tmp_path: Path,
) -> None:
    def args(*more: str) -> Any:
        return build_parser().parse_args(["--scenario", "mixed", "--sites", "4", *more])

    assert (args().natted, args().tls) == (0, False)
    check(args("--natted", "2", "--protocols", "persyn"))
    for bad, said in (
        (["--natted", "4", "--protocols", "sumweight"], "give 0 to 3"),
        (["--natted", "-1", "--protocols", "sumweight"], "give 0 to 3"),
        (["--natted", "1"], "rendezvous needs every site reachable"),  # the default has both
        (["--natted", "1", "--protocols", "sumweight,diloco"], "with diloco"),
    ):
        with pytest.raises(ConfigError, match=f"--natted {bad[1]} .*{said}"):
            check(args(*bad))
    spec = WanSpec(
        scenario=scenario("mixed"), sites=4, job="digits", budget_s=1.0, workdir=tmp_path
    )
    assert _site_config(spec, "sumweight")["tls"] == {"insecure": True}  # as before
    natted = replace(spec, natted=2)
    addresses = [f"127.0.0.1:{9000 + i}" for i in range(4)]
    text = site_toml(natted, "sumweight", 3, addresses, 20.0, 10.0, tmp_path, unreachable=True)
    table = tomllib.loads(text)
    assert table["seeds"] == addresses[:2]  # the public sites only
    assert table["reach"] == {"reachable": False}  # loopback: nothing stops a dial
    assert table["tls"]["cert"] == str(tmp_path / "ca" / "site-3.pem")
    assert _site_config(natted, "sumweight", 0)["seeds"] == addresses[1:2]
    assert "reach" not in _site_config(natted, "sumweight", 0)


def test_the_table_has_a_relayed_column_only_with_natted_sites() -> None:
    row = {
        "time_to_target_s": 12.0,
        "speedup_vs_allreduce": None,
        "speedup_vs_diloco": None,
        "final_accuracy": 1.7,
        "bytes_per_site": 5e6,
        "bytes_per_site_to_target": 2e6,
        "wait_fraction": 0.0,
        "steps_per_site": 300,
        "weight_shares": [1.0, 1.0],
        "load_average": 1.0,
        "relay_bytes": {"site-0": 3_000_000, "site-1": None},
    }
    result: dict[str, Any] = {
        "date": "2026-12-02",
        "machine": "x86_64, 2 CPUs",
        "scenario": "uniform-10mbit-50ms",
        "sites": 4,
        "job": "shakespeare",
        "target": {"describe": "test_loss <= 1.74", "lower_is_better": True},
        "testbed": "network namespaces",
        "natted": 2,
        "tls": True,
        "protocols": {"persyn+outer": row},
    }
    out = io.StringIO()
    print_table(result, out)
    text = out.getvalue()
    assert "sites 2-3 natted (reached through relays) · mutual TLS" in text
    head = next(line for line in text.splitlines() if line.startswith("protocol"))
    assert head.split()[-1] == "MB/relay"
    assert "persyn+outer: relayed (both directions) by site-0 3.0 MB, site-1 - MB" in text
    plain = io.StringIO()
    print_table({**result, "natted": 0, "tls": False}, plain)
    assert "MB/relay" not in plain.getvalue() and "TLS" not in plain.getvalue()
