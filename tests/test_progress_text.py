"""What people read while a mesh trains says what each protocol does, in its own terms.

A pulling protocol (overlap) pushes nothing and keeps no sum-weights: its status table,
progress line and `mesh up`/`demo` tables show pulls merged, waits and who schedules,
never "0 acknowledged"; every status table has a test row; a site of several ranks and
a local coordinator are named; the demo's summary names its weakest site and why. The
renderers are fed hand-built statuses and summaries, so no daemon starts here (the
meshes that run overlap, ranks and the demo assert on their own output elsewhere).
"""

from __future__ import annotations

import io
import math
import re
from pathlib import Path
from typing import Any

from rich.console import Console

from gossipd.node.launch.demo import print_demo, weakest_site
from gossipd.node.launch.launcher import print_table
from gossipd.node.launch.meshspec import MeshSpec
from gossipd.node.launch.progress import MeshProgress
from gossipd.node.net.status.query import render_status, status_dict
from gossipd.node.site.progress_log import ProgressLog
from gossipd.node.trainer.report import Summary
from gossipd.proto import gossip_pb2 as pb

PULLS = {
    "merged": 40,
    "failed": 3,
    "repicked": 2,
    "skipped": 1,
    "coordinator": 30,
    "alone": 14,
    "fallback": 2,
}


def _status(**fields: Any) -> dict[str, Any]:
    """A node's status as `gossipd status` gets it, through the real reply message."""
    given = {"node_id": "node-0", "mesh_id": "m", "step": 120, **fields}
    return status_dict(pb.StatusReply(**given))


def _row(table: str, key: str) -> str:
    found = re.search(rf"^{re.escape(key)}\s\s+(.*)$", table, re.M)
    assert found, f"no {key!r} row in:\n{table}"
    return found.group(1)


def test_status_table_of_an_overlap_node_shows_pulls_waits_and_scheduler_not_pushes() -> None:
    table = render_status(
        _status(
            protocol="overlap",
            pulls=PULLS,
            wait_s=1.5,
            wait_fraction=0.031,
            scheduling="coordinator",
        )
    )
    assert _row(table, "pulls") == (
        "40 merged, 3 failed (2 re-picked another peer), 1 period skipped (no peer free)"
    )
    assert _row(table, "waits") == "1.5 s for pulls at step boundaries (3.1% of training time)"
    assert _row(table, "scheduling") == (
        "coordinator; 30 periods from the coordinator, 14 scheduled alone "
        "(2 times the coordinator did not answer)"
    )
    for push_only in ("pushes", "sum-weight", "reserved", "mass issues"):
        assert not re.search(rf"^{push_only}\s", table, re.M), table
    assert "acknowledged" not in table


def test_status_table_of_a_push_node_shows_its_weights_and_pushes() -> None:
    table = render_status(
        _status(
            protocol="sumweight",
            sum_weights=[0.75, 0.75],
            reserved_weights=[0.25, 0.25],
            pushes_acked=7,
            pushes_failed=1,
            pushes_merged=5,
            pushes_in_flight=1,
        )
    )
    assert _row(table, "sum-weight") == "0.75 (all 2 segments)"
    assert _row(table, "pushes") == "7 acknowledged, 1 failed, 5 merged here, 1 in flight"
    assert _row(table, "mass issues") == "0"
    assert not re.search(r"^(pulls|waits|scheduling|weight cut)\s", table, re.M), table


def test_status_table_of_a_node_whose_merges_met_the_cap_says_how_much_was_cut() -> None:
    table = render_status(_status(protocol="sumweight", sum_weights=[8.0], weight_cut=12.5))
    assert _row(table, "weight cut") == "12.5 (pushes over the cap: see the INFO log)"


def test_every_status_table_has_a_test_row_and_a_multi_rank_site_its_ranks() -> None:
    evaluated = render_status(
        _status(protocol="sumweight", eval={"test_accuracy": 0.9312}, eval_step=100, ranks=2)
    )
    assert _row(evaluated, "test") == "test_accuracy 0.9312 (step 100)"
    assert _row(evaluated, "ranks") == "2 processes train this site; rank 0 gossips for them"
    fresh = render_status(_status(protocol="overlap", pulls=PULLS, ranks=1))
    assert _row(fresh, "test") == "– (no evaluation yet)"
    assert not re.search(r"^ranks\s", fresh, re.M), fresh


def _summary(steps: int, **fields: Any) -> Summary:
    defaults: dict[str, Any] = {
        "loss": 0.25,
        "protocol": "sumweight",
        "round": 0,
        "epoch": 0,
        "weights": (),
        "reserved": (),
        "in_flight": 0,
        "pushes_acked": 0,
        "pushes_failed": 0,
        "pushes_merged": 0,
        "peers": frozenset(),
        "exchanged": {},
    }
    return Summary(steps=steps, **{**defaults, **fields})


def _two_lines(first: Summary, second: Summary, ranks: int = 1) -> tuple[str, str]:
    summaries = iter((first, second))
    log = ProgressLog(60.0, lambda: next(summaries), lambda: 2, ranks=ranks)
    return log.line(now=100.0), log.line(now=110.0)


def test_progress_line_of_a_pulling_node_says_pulls_merged_waits_and_scheduler() -> None:
    pulls = {**PULLS, "merged": 10, "failed": 1}
    first, second = _two_lines(
        _summary(100, protocol="overlap", pulls=pulls, wait_s=0.5, wait_fraction=0.02),
        _summary(
            200,
            protocol="overlap",
            pulls={**pulls, "merged": 15, "failed": 3},
            wait_s=0.8,
            wait_fraction=0.025,
            scheduling="coordinator",
        ),
    )
    assert first == (
        "progress: step 100, loss 0.25, 2 live peers, 10 pulls merged (1 failed), "
        "waiting 2.0% of the time for pulls, not scheduled yet"
    )
    assert second == (
        "progress: step 200 (10.0 steps/s), loss 0.25, 2 live peers, 0.50 pulls merged/s "
        "(2 failed), waiting 3.0% of the time for pulls, scheduled by the coordinator"
    )
    assert "push" not in first + second and "weight" not in first + second


def test_progress_line_of_a_push_node_says_weight_and_pushes_acknowledged_per_second() -> None:
    _, line = _two_lines(
        _summary(100, weights=(1.0,), reserved=(0.0,), pushes_acked=4),
        _summary(130, weights=(0.75,), reserved=(0.25,), pushes_acked=8),
    )
    assert line == (
        "progress: step 130 (3.0 steps/s), loss 0.25, 2 live peers, weight 0.75 "
        "(0.25 in flight), 0.40 pushes acknowledged/s"
    )


def test_progress_line_of_a_multi_rank_site_names_its_ranks() -> None:
    first, second = _two_lines(_summary(0, loss=math.nan), _summary(50), ranks=4)
    assert first.startswith("progress: step 0 on 4 ranks, no step yet,"), first
    assert second.startswith("progress: step 50 (5.0 steps/s) on 4 ranks, loss 0.25,"), second


def _display(spec: MeshSpec) -> tuple[MeshProgress, io.StringIO]:
    out = io.StringIO()  # not a terminal: plain lines, as under a pipe or --json
    return MeshProgress(out, spec, Path("/tmp/mesh")), out


def test_mesh_up_banner_names_the_protocol_the_coordinator_and_the_ranks() -> None:
    display, out = _display(MeshSpec(nodes=3, protocol="overlap", coordinator=True))
    display.starting()
    display.coordinator_started("127.0.0.1:4100", Path("/tmp/mesh/coordinator/coordinator.log"))
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("gossipd: starting 3 nodes on loopback (job digits, protocol "
                               "overlap,"), lines  # fmt: skip
    assert lines[1] == (
        "gossipd: overlap: each node averages with models it pulls; a local coordinator "
        "schedules the pulls (a node that cannot reach it schedules alone)"
    )
    assert re.fullmatch(
        r"\[\s*\d+\.\ds\] coordinator started on 127\.0\.0\.1:4100 "
        r"\(log: /tmp/mesh/coordinator/coordinator\.log\)",
        lines[-1],
    ), lines

    display, out = _display(MeshSpec(nodes=2, protocol="overlap"))
    display.starting()
    assert "each schedules its pulls itself (decentralized; --coordinator local starts a " \
        "coordinator)" in out.getvalue()  # fmt: skip

    display, out = _display(MeshSpec(nodes=2, protocol="sumweight", ranks=2))
    display.starting()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("gossipd: starting 2 nodes of 2 ranks each on loopback"), lines
    assert lines[1] == (
        "gossipd: each node is a site of 2 processes: every rank trains on its slice of the "
        "site's shard, the ranks all-reduce gradients, rank 0 gossips"
    )
    assert "pull" not in out.getvalue() and "coordinator" not in out.getvalue()


def _overlap_states() -> list[dict[str, Any]]:
    return [
        _status(
            node_id=f"node-{i}",
            protocol="overlap",
            loss=0.5,
            pulls={**PULLS, "merged": 10 * (i + 1), "failed": i},
            wait_fraction=0.01 * (i + 1),
            scheduling="coordinator" if i else "decentralized",
            live_peers=["a", "b"],
        )
        for i in range(3)
    ]


def test_plain_progress_rows_of_a_pulling_mesh_add_pulls_merged_and_time_waiting() -> None:
    display, out = _display(MeshSpec(nodes=3, protocol="overlap"))
    display.ready(1.0)
    display.sample(4.0, _overlap_states(), 0.5)
    lines = out.getvalue().splitlines()
    assert "pulls merged by all nodes" in lines[1]
    assert lines[2].split() == ["time_s", "node-0", "node-1", "node-2", "mean_loss",
                                "consensus", "pulls", "waiting"]  # fmt: skip
    assert lines[3].split() == ["4.0", "120", "120", "120", "0.5000", "5.00e-01", "60", "2.0%"]

    display, out = _display(MeshSpec(nodes=3, protocol="sumweight"))
    display.ready(1.0)
    assert out.getvalue().splitlines()[2].split()[-2:] == ["mean_loss", "consensus"]


def _rendered(table: Any) -> dict[str, list[str]]:
    """A rich table as a terminal shows it: its title and header, and each row's cells."""
    console = Console(file=io.StringIO(), width=200, highlight=False)
    console.print(table)
    lines = console.file.getvalue().splitlines()  # type: ignore[attr-defined]
    cells = [
        [c.strip() for c in line.strip()[1:-1].split(line.strip()[0])]
        for line in lines
        if line.strip()[:1] in ("┃", "│")  # the header's, then each row's
    ]
    return {"title": [lines[0].strip()], **{row[0]: row for row in cells}}


def test_live_table_of_a_pulling_mesh_shows_pulls_waits_and_scheduler_not_pushes() -> None:
    display, _ = _display(MeshSpec(nodes=3, protocol="overlap", ranks=2))
    rows = _rendered(display._table(4.0, _overlap_states(), 0.5))
    assert rows["title"] == ["gossipd · overlap · 3 nodes × 2 ranks · digits"]
    assert rows["node"] == ["node", "step", "steps/s", "loss", "round", "pulls", "waiting",
                            "scheduling", "live peers"]  # fmt: skip
    assert rows["node-0"][5:8] == ["10", "1.0%", "decentralized"]
    assert rows["node-2"][5:8] == ["30 (2 failed)", "3.0%", "coordinator"]

    display, _ = _display(MeshSpec(nodes=2, protocol="sumweight"))
    pushing = [_status(node_id=f"node-{i}", pushes_acked=7 + i) for i in range(2)]
    rows = _rendered(display._table(4.0, pushing, 0.5))
    assert rows["node"] == ["node", "step", "steps/s", "loss", "round", "pushes", "live peers"]
    assert rows["node-1"][5] == "8"


def _node(name: str, accuracy: float, steps: int, **fields: Any) -> dict[str, Any]:
    node = {"node_id": name, "steps": steps, "loss": 0.1, "test_accuracy": accuracy}
    node.update({"wait_fraction": 0.0, "scheduling": "", "sum_weight": None, "pulls": {}})
    return {**node, **fields}


def _result(nodes: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    result = {
        "protocol": "sumweight",
        "job": "digits",
        "coordinator": None,
        "nodes": nodes,
        "sum_weight_start": 4.0,
        "sum_weight_end": 4.0,
        "consensus_distance_start": 1.7,
        "consensus_distance_end": 0.003,
        "wall_s": 40.0,
        "job_options": {"partition": "by_label"},
        "demo_wall_s": 90.0,
    }
    return {**result, **fields}


def test_mesh_up_table_of_a_pulling_mesh_adds_pulls_waits_scheduler_and_coordinator() -> None:
    nodes = [
        _node("node-0", 0.95, 900, pulls={"merged": 40, "failed": 2}, wait_fraction=0.031,
              scheduling="coordinator"),
        _node("node-1", 0.96, 950, pulls={"merged": 41}, scheduling="decentralized"),
    ]  # fmt: skip
    out = io.StringIO()
    print_table(
        _result(nodes, protocol="overlap", coordinator="127.0.0.1:4100", sum_weight_end=None),
        out,
    )
    lines = out.getvalue().splitlines()
    assert lines[0].split()[-4:] == ["pulls", "failed", "waiting", "scheduling"]
    assert lines[1].split()[-4:] == ["40", "2", "3.1%", "coordinator"]
    assert lines[2].split()[-4:] == ["41", "0", "0.0%", "decentralized"]
    assert "a local coordinator ran on 127.0.0.1:4100" in lines


def test_demo_summary_names_the_weakest_site_with_its_share_steps_and_skew() -> None:
    nodes = [
        _node("node-0", 0.97, 5000, sum_weight=1.1),
        _node("node-1", 0.88, 4100, sum_weight=0.7),
        _node("node-2", 0.96, 5200, sum_weight=1.2),
        _node("node-3", 0.95, 4900, sum_weight=1.0),
    ]
    assert weakest_site(_result(nodes)) == (
        "weakest site: node-1, test accuracy 0.8800 against the others' median 0.9600: it "
        "held 17.5% of the mesh's sum-weight at the end (an equal share is 25%); it took "
        "4100 steps against the others' median 5000; its data holds only some of the "
        "classes (partition=by_label)"
    )
    out = io.StringIO()
    local = _result([_node(n["node_id"], 0.3, 9000) for n in nodes])
    print_demo({**_result(nodes), "local_only": local}, out)
    assert "weakest site: node-1" in out.getvalue()


def test_weakest_site_of_a_protocol_without_weights_is_told_by_its_pulls() -> None:
    nodes = [
        _node("node-0", 0.90, 800, pulls={"merged": 20}, wait_fraction=0.12),
        _node("node-1", 0.95, 1000, pulls={"merged": 30}),
        _node("node-2", 0.96, 1000, pulls={"merged": 34}),
    ]
    text = weakest_site(_result(nodes, sum_weight_end=None, job_options={}))
    assert text == (
        "weakest site: node-0, test accuracy 0.9000 against the others' median 0.9550: it "
        "merged 20 pulls against the others' median 32, waiting 12.0% of the time; it took "
        "800 steps against the others' median 1000"
    )


def test_no_weakest_site_is_named_without_two_sites_that_evaluated() -> None:
    nodes = [_node("node-0", 0.9, 10), _node("node-1", math.nan, 10)]
    assert weakest_site(_result(nodes)) is None


def test_the_demo_warns_only_on_a_machine_busier_than_its_figures_were_measured_at() -> None:
    from gossipd.node.launch.demo import busy_machine

    assert busy_machine(8.0, 2) is None  # load 8 on 2 cores: the sites still ended at 0.95+
    warning = busy_machine(12.0, 2)
    assert warning is not None and "load average 12.0 on 2 cores" in warning
    assert "names it and why" in warning


def test_status_table_of_a_restarted_site_says_what_the_restart_cost() -> None:
    crash = pb.CrashAudit(
        resumed=True,
        done=True,
        weight_lost=0.112289,
        peers_answered=3,
        peers_asked=3,
        checkpoint_step=700,
    )
    assert _row(render_status(_status(crash=crash)), "restart") == (
        "restarted from its checkpoint of step 700: cost the mesh 0.112289 of sum-weight per "
        "segment (from 3 of 3 peers' accounts)"
    )
    reading = pb.CrashAudit(resumed=True, peers_answered=1, peers_asked=3, checkpoint_step=700)
    assert "being read from its peers (1 of 3 so far)" in _row(
        render_status(_status(crash=reading)), "restart"
    )
    assert "restart" not in render_status(_status())  # a site that did not resume
