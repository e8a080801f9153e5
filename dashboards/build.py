"""The gossipd Grafana dashboard as code: ``python dashboards/build.py [--check]``.

Writes ``dashboards/gossipd.json`` (committed, so Grafana provisioning and a
manual import need no Python). ``--check`` exits 1 when the committed file is not
what this script generates, so an edit to the JSON by hand, or to this file
without regenerating, fails CI instead of drifting.

Node names come from ``gossipd_node_info`` by a join, not from scrape relabeling:
every query multiplies by ``gossipd_node_info`` (value 1) ``on (job, instance)``
and takes its ``node_id``. The name is then the one the node itself reports (the
one in its logs, ``gossipd status`` and its certificate), it follows the node
when its address changes, and the dashboard works with whatever scrape config or
service discovery an operator already has, with no label to keep in sync by hand.
The same join filters by the ``$mesh`` and ``$node`` variables. The cost is
longer PromQL, written once by :func:`per_node` and :func:`quantiles`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    DataTransformerConfig,
    VariableOption,
    VariableRefresh,
    VariableSort,
)

OUTPUT = Path(__file__).resolve().parent / "gossipd.json"
DASHBOARD_UID = "gossipd"
# The provisioned datasource (grafana/provisioning/datasources/prometheus.yml) has this uid,
# so the dashboard opens on it without asking; the variable lets a user pick another.
DATASOURCE_UID = "gossipd-prometheus"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")

INFO = 'gossipd_node_info{mesh_id=~"$mesh", node_id=~"$node"}'
MESH_INFO = 'gossipd_node_info{mesh_id=~"$mesh"}'
RATE = "$__rate_interval"


def per_node(expr: str, by: str = "") -> str:
    """``expr`` summed per node (and the ``by`` labels), named by the node's own node_id."""
    labels = f"node_id, {by}" if by else "node_id"
    return f"sum by ({labels}) (({expr}) * on (job, instance) group_left (node_id) {INFO})"


def quantile(q: float, histogram: str) -> str:
    """The ``q`` quantile of ``histogram`` per node, over the rate window."""
    return f"histogram_quantile({q}, {per_node(f'rate({histogram}_bucket[{RATE}])', 'le')})"


def quantiles(histogram: str, qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> list[Query]:
    return [Query(quantile(q, histogram), f"{{{{node_id}}}} p{round(q * 100)}") for q in qs]


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = "{{node_id}}"


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    queries: list[Query]
    unit: str = "short"
    kind: str = "timeseries"  # or "stat", "table"
    width: int = 8
    no_value: str | None = None
    log_scale: bool = False  # for series that differ by orders of magnitude


@dataclass(frozen=True)
class Row:
    title: str
    panels: list[Panel] = field(default_factory=list)


MESH_OVERVIEW = Row(
    "Mesh overview",
    [
        Panel(
            "Nodes",
            "One row per scraped node, from gossipd_node_info. Nodes whose fingerprint (model "
            "layout) or protocol differ never merge each other's pushes: their dials fail as "
            "'mismatch' (Health row).",
            [Query(INFO, "")],
            kind="table",
            width=12,
        ),
        Panel(
            "Live and suspected peers",
            "Peers each node considers live (verified, pushed to) and suspected (failed recently, "
            "not pushed to; declared dead after membership.drop_after_s). In a full mesh of N "
            "nodes every node sees N-1 live.",
            [
                Query(per_node("gossipd_live_peers"), "{{node_id}} live"),
                Query(per_node("gossipd_suspected_peers"), "{{node_id}} suspected"),
            ],
            width=12,
        ),
        Panel(
            "Sum of weights per segment (mesh total)",
            "Σ over the nodes of the mesh (not filtered by $node) of each segment's sum-weight. "
            "Sum-weight gossip conserves it: at rest it equals the number of nodes that started "
            "with weight 1 (a joiner starts at 0). While pushes are in flight it wobbles a "
            "little either way: a share merged but not yet acknowledged counts at both ends, "
            "each node publishes its weights at its own step boundaries, and Prometheus scrapes "
            "the nodes at slightly different moments (each node's weight is averaged over the "
            "rate window to smooth that). A lasting drift means weight was lost or duplicated.",
            [
                Query(
                    f"sum by (segment) (avg_over_time(gossipd_sum_weight[{RATE}]) "
                    f"* on (job, instance) group_left () {MESH_INFO})",
                    "segment {{segment}}",
                )
            ],
        ),
        Panel(
            "Round",
            "The protocol core's round on each node. Rounds advance with local steps "
            "(gossip.round_steps); nodes may drift a few rounds apart, nothing waits.",
            [Query(per_node("gossipd_round"))],
        ),
        Panel(
            "Distinct membership views",
            "How many different views of the live members the nodes of the mesh hold "
            "(gossipd_membership_epoch is a digest of the view). 1: every node agrees; more "
            "for a while after a join, leave or failure, until gossip converges.",
            [
                Query(
                    'count(count_values("epoch", gossipd_membership_epoch * on (job, instance) '
                    f"group_left () {MESH_INFO}))",
                    "views",
                )
            ],
        ),
    ],
)

TRAINING = Row(
    "Training (per site)",
    [
        Panel(
            "Steps per second",
            "Local optimizer steps per second, from the step-time histogram's count: it starts "
            "at 0 with each process, so a restart is an ordinary counter reset. "
            "gossipd_steps_total continues from the checkpoint's step after a restart, which a "
            "rate() would read as a reset and show as a spike; it is plotted as progress instead.",
            [Query(per_node(f"rate(gossipd_step_seconds_count[{RATE}])"))],
            unit="ops",
        ),
        Panel(
            "Step (progress)",
            "gossipd_steps_total: the node's step count, kept across restarts from checkpoints.",
            [Query(per_node("gossipd_steps_total"))],
        ),
        Panel(
            "Samples per second",
            "Training samples per second (steps x batch size).",
            [Query(per_node(f"rate(gossipd_samples_total[{RATE}])"))],
            unit="ops",
        ),
        Panel(
            "Training loss",
            "Loss of each node's last step, on its own batch: noisy by nature.",
            [Query(per_node("gossipd_loss"))],
        ),
        Panel(
            "Test accuracy",
            "gossipd_eval{metric=test_accuracy}: the job's evaluation every job.eval_every_steps "
            "(classification jobs only; a regression job reports test_loss).",
            [Query(per_node('gossipd_eval{metric="test_accuracy"}'))],
            unit="percentunit",
        ),
        Panel(
            "Step time quantiles",
            "Wall time of one local step including the gossip bookkeeping, p50/p90/p99 over the "
            "rate window.",
            quantiles("gossipd_step_seconds"),
            unit="s",
        ),
    ],
)

GOSSIP = Row(
    "Gossip traffic",
    [
        Panel(
            "Bytes per second by direction and kind",
            "Payload bytes (all results) sent and received, by kind: push, pull, handoff (a "
            "leaving node's weight).",
            [
                Query(
                    per_node(f"rate(gossipd_gossip_bytes_total[{RATE}])", "direction, kind"),
                    "{{node_id}} {{direction}} {{kind}}",
                )
            ],
            unit="Bps",
        ),
        Panel(
            "Messages per second by direction and kind",
            "Messages (all results) by direction and kind; a refused inbound request counts as "
            "received, kind 'request', result 'rejected'.",
            [
                Query(
                    per_node(f"rate(gossipd_gossip_messages_total[{RATE}])", "direction, kind"),
                    "{{node_id}} {{direction}} {{kind}}",
                )
            ],
            unit="reqps",
        ),
        Panel(
            "Failed and retried sends",
            "Outbound messages that failed (weight folded back) or were retried, per second. "
            "A healthy mesh has none, so this panel shows an explicit 0 per node when nothing "
            "failed, rather than no data.",
            [
                Query(
                    per_node(
                        "rate(gossipd_gossip_messages_total"
                        f'{{direction="sent", result=~"failed|retry"}}[{RATE}])',
                        "result",
                    )
                    + f" or on (node_id) sum by (node_id) (0 * {INFO})",
                    "{{node_id}} {{result}}",
                )
            ],
            unit="reqps",
        ),
        Panel(
            "Push time quantiles",
            "One outbound push from its first attempt until it settled (acknowledged or folded "
            "back), retries included.",
            quantiles("gossipd_push_seconds"),
            unit="s",
        ),
        Panel(
            "Merges per second",
            "Segments merged into the local model per second.",
            [Query(per_node(f"rate(gossipd_merges_total[{RATE}])"))],
            unit="ops",
        ),
        Panel(
            "Pushes in flight",
            "Outbound pushes not yet settled (bounded by gossip.max_pushes_in_flight).",
            [Query(per_node("gossipd_pushes_in_flight"))],
        ),
    ],
)

OVERLAP = Row(
    "Overlap and waits",
    [
        Panel(
            "Push time vs step time (p50)",
            "NOT YET MEASURED: the overlap protocol (training steps running while pushes are in "
            "flight, and how long a step waits on gossip) does not exist yet, so there is no "
            "wait metric. What exists is shown: the median time one outbound push takes to "
            "settle next to the median time of one local step (log scale).",
            [
                Query(quantile(0.5, "gossipd_push_seconds"), "{{node_id}} push p50"),
                Query(quantile(0.5, "gossipd_step_seconds"), "{{node_id}} step p50"),
            ],
            unit="s",
            log_scale=True,
            width=12,
        ),
        Panel(
            "Steps per push (p50 push time / p50 step time)",
            "How many local steps one push lasts. Above 1, a push spans several steps: that gap "
            "is what an overlap protocol would hide, and what a wait metric would report once "
            "one exists (it does not yet).",
            [
                Query(
                    f"{quantile(0.5, 'gossipd_push_seconds')} / "
                    f"{quantile(0.5, 'gossipd_step_seconds')}",
                )
            ],
            width=12,
        ),
    ],
)

HEALTH = Row(
    "Health and rejections",
    [
        Panel(
            "Rejected payloads by reason",
            "Inbound requests refused per second, by reason (every limit's and validation's "
            "refusals: InvalidFrame, PayloadTooLarge, MeshMismatch, UnknownPeer, Busy, ...).",
            [
                Query(
                    per_node(f"rate(gossipd_rejected_payloads_total[{RATE}])", "reason"),
                    "{{node_id}} {{reason}}",
                )
            ],
            unit="reqps",
            no_value="none since the node started",
        ),
        Panel(
            "Dial failures by reason",
            "Handshakes this node made that failed, per second: tls (certificate refused, wrong "
            "CA), unreachable, mismatch (other mesh, model or protocol: a config to fix), other.",
            [
                Query(
                    per_node(f"rate(gossipd_dial_failures_total[{RATE}])", "reason"),
                    "{{node_id}} {{reason}}",
                )
            ],
            unit="reqps",
            no_value="none since the node started",
        ),
        Panel(
            "Checkpoint age",
            "Seconds since each node's newest good checkpoint.pt (nodes that have written none "
            "yet are not shown). Alert when it exceeds a few checkpoint.every_steps intervals.",
            [Query(per_node("time() - (gossipd_checkpoint_last_success_timestamp_seconds > 0)"))],
            unit="s",
        ),
        Panel(
            "Checkpoint failures (since start)",
            "Checkpoint writes that failed (disk full, read-only, I/O error) since the process "
            "started; the previous checkpoint stays and training goes on.",
            [Query(per_node("gossipd_checkpoint_failures_total"))],
        ),
        Panel(
            "Checkpoint write time (p90)",
            "Wall time of one successful checkpoint write (capture, serialize, fsync, rename).",
            quantiles("gossipd_checkpoint_write_seconds", (0.9,)),
            unit="s",
        ),
        Panel(
            "Scrape targets up",
            "Prometheus's own up series for the jobs that export gossipd metrics: 0 means the "
            "node's metrics endpoint did not answer (the node is down or metrics.listen moved).",
            [Query('up{job=~"$job"}', "{{instance}}")],
        ),
    ],
)

ROWS = [MESH_OVERVIEW, TRAINING, GOSSIP, OVERLAP, HEALTH]


def _panel(spec: Panel, panel_id: int) -> db.Panel:
    """One SDK panel builder from ``spec`` (refIds A, B, ... in query order)."""
    if spec.kind == "table":
        builder = (
            table.Panel()
            .show_header(True)
            .with_transformation(
                DataTransformerConfig(
                    id_val="organize",
                    options={"excludeByName": {"Time": True, "Value": True, "__name__": True}},
                )
            )
        )
    elif spec.kind == "stat":
        builder = stat.Panel()
    else:
        builder = (
            timeseries.Panel()
            .legend(
                cb.VizLegendOptions()
                .show_legend(True)
                .display_mode(common.LegendDisplayMode.LIST)
                .placement(common.LegendPlacement.BOTTOM)
            )
            .tooltip(
                cb.VizTooltipOptions()
                .mode(common.TooltipDisplayMode.MULTI)
                .sort(common.SortOrder.DESCENDING)
            )
        )
        if spec.log_scale:
            builder = builder.scale_distribution(
                cb.ScaleDistributionConfig().type(common.ScaleDistribution.LOG).log(10)
            )
    builder = (
        builder.id(panel_id)
        .title(spec.title)
        .description(spec.description)
        .datasource(DATASOURCE)
        .unit(spec.unit)
        .span(spec.width)
        .height(8)
    )
    if spec.no_value is not None:
        builder = builder.no_value(spec.no_value)
    for i, query in enumerate(spec.queries):
        target = prometheus.Dataquery().expr(query.expr).ref_id(chr(ord("A") + i))
        target = target.datasource(DATASOURCE)
        if spec.kind == "table":
            target = target.instant().format("table")
        else:
            target = target.legend_format(query.legend)
        builder = builder.with_target(target)
    return builder


def _variables() -> list[db.DatasourceVariable | db.QueryVariable]:
    def query_var(name: str, label: str, query: str, *, multi: bool) -> db.QueryVariable:
        var = (
            db.QueryVariable(name)
            .label(label)
            .datasource(DATASOURCE)
            .query(query)
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(VariableSort.ALPHABETICAL_ASC)
            .multi(multi)
        )
        return var.include_all(True).all_value(".*") if multi else var

    return [
        db.DatasourceVariable("datasource")
        .label("Prometheus")
        .type("prometheus")
        .current(VariableOption(text=DATASOURCE_UID, value=DATASOURCE_UID)),
        query_var("mesh", "Mesh", "label_values(gossipd_node_info, mesh_id)", multi=False),
        query_var(
            "node",
            "Node",
            'label_values(gossipd_node_info{mesh_id=~"$mesh"}, node_id)',
            multi=True,
        ),
        query_var("job", "Scrape job", "label_values(gossipd_node_info, job)", multi=True),
    ]


def build() -> dict[str, object]:
    """The dashboard as a JSON-ready dict."""
    dash = (
        db.Dashboard("gossipd mesh")
        .uid(DASHBOARD_UID)
        .description("gossipd: mesh, training, gossip traffic, overlap and health per site")
        .tags(["gossipd"])
        .time("now-30m", "now")
        .refresh("10s")
        .timezone("browser")
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .editable()
    )
    for var in _variables():
        dash = dash.with_variable(var)
    panel_id = 0
    for row in ROWS:
        panel_id += 1
        dash = dash.with_row(db.Row(row.title).id(panel_id))
        for spec in row.panels:
            panel_id += 1
            dash = dash.with_panel(_panel(spec, panel_id))
    return json.loads(json.dumps(dash.build(), cls=JSONEncoder))


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help=f"exit 1 if {OUTPUT.name} is not up to date"
    )
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUTPUT.read_text() if OUTPUT.exists() else ""
        if current != text:
            print(
                f"{OUTPUT} is not what dashboards/build.py generates; run "
                "`python dashboards/build.py` and commit the result",
                file=sys.stderr,
            )
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
