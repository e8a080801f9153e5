"""The gossipd Grafana dashboard as code: ``python dashboards/build.py [--check]``.

Writes ``dashboards/gossipd.json`` (committed, so Grafana provisioning and a
manual import need no Python). ``--check`` exits 1 when the committed file is not
what this script generates, so an edit to the JSON by hand, or to this file
without regenerating, fails CI instead of drifting.

The panels themselves (PromQL, descriptions, how nodes are named) are in
``panels.py``, ``overlap_panels.py`` and ``reach_panels.py``; this file only puts their
rows in order, maps them onto the SDK and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, table, timeseries
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

# dashboards/*.py: run as a script, this folder is on the path
from overlap_panels import COORDINATOR, OVERLAP
from panels import GOSSIP, HEALTH, MESH_OVERVIEW, TRAINING, Panel
from reach_panels import REACH

OUTPUT = Path(__file__).resolve().parent / "gossipd.json"
DASHBOARD_UID = "gossipd"
# The provisioned datasource (grafana/provisioning/datasources/prometheus.yml) has this uid,
# so the dashboard opens on it without asking; the variable lets a user pick another.
DATASOURCE_UID = "gossipd-prometheus"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
ROWS = [MESH_OVERVIEW, TRAINING, GOSSIP, OVERLAP, COORDINATOR, HEALTH, REACH]


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
    def query_var(
        name: str, label: str, query: str, *, multi: bool, all_value: str | None = ".*"
    ) -> db.QueryVariable:
        """``all_value`` None: All selects each value found (Grafana joins them a|b)."""
        var = (
            db.QueryVariable(name)
            .label(label)
            .datasource(DATASOURCE)
            .query(query)
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(VariableSort.ALPHABETICAL_ASC)
            .multi(multi)
        )
        if not multi:
            return var
        var = var.include_all(True)
        return var if all_value is None else var.all_value(all_value)

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
        # All = each job found, never ".*": that would match the sites' jobs in up{}.
        query_var(
            "coordinator",
            "Coordinator job",
            "label_values(gossipd_coordinator_epoch, job)",
            multi=True,
            all_value=None,
        ),
    ]


def build() -> dict[str, object]:
    """The dashboard as a JSON-ready dict."""
    dash = (
        db.Dashboard("gossipd mesh")
        .uid(DASHBOARD_UID)
        .description("gossipd: mesh, training, gossip traffic, overlap, health and reach per site")
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
