"""The dashboard's rows for the overlap protocol: the trainers' waits, and the coordinator.

Apart from ``panels.py`` (the rows every protocol fills) to keep each file short; the
same dataclasses and PromQL helpers. The trainer's wait is a node metric, named by
``node_id`` through the same ``gossipd_node_info`` join. The coordinator is no node: it
exports no ``gossipd_node_info`` and no mesh label, so its panels select it by scrape
job (the ``$coordinator`` variable: every job that exports ``gossipd_coordinator_epoch``)
and the ``$mesh`` and ``$node`` variables do not filter them.
"""

from __future__ import annotations

from panels import RATE, Panel, Query, Row, per_node, quantile

COORDINATOR_JOB = 'job=~"$coordinator"'


def coordinator(metric: str, selector: str = "") -> str:
    """``metric`` of the coordinators picked by ``$coordinator``, with extra label matchers."""
    return f"{metric}{{{COORDINATOR_JOB}{', ' + selector if selector else ''}}}"


def coordinator_rate(metric: str, by: str) -> str:
    """Per-second rate of the counter ``metric``, summed by the ``by`` labels."""
    return f"sum by ({by}) (rate({coordinator(metric)}[{RATE}]))"


OVERLAP = Row(
    "Overlap and waits",
    [
        Panel(
            "Trainer wait fraction",
            "gossipd_trainer_wait_fraction: the share of wall time since each node's first step "
            "that its trainer stood at a step boundary waiting for a pull due there (overlap "
            "protocol). Scheduled overlap aims to keep it under 0.03; mode none waits a whole "
            "transfer every period. Protocols that push never wait, and show 0.",
            [Query(per_node("gossipd_trainer_wait_fraction"))],
            unit="percentunit",
        ),
        Panel(
            "Waiting share, last minute",
            "rate(gossipd_trainer_wait_seconds[1m]): seconds waited per second of wall time over "
            "the last minute, so a change shows at once where the wait fraction (since start) "
            "moves slowly. A rising line means pulls land late: slower links, a busy peer, or "
            "transfer-time estimates still being learned.",
            [Query(per_node("rate(gossipd_trainer_wait_seconds[1m])"))],
            unit="percentunit",
        ),
        Panel(
            "Push time vs step time (p50)",
            "The median time one outbound push takes to settle next to the median time of one "
            "local step (log scale). For the push protocols, how many steps a push spans; the "
            "overlap protocol's pulls show as waits instead (the two panels before).",
            [
                Query(quantile(0.5, "gossipd_push_seconds"), "{{node_id}} push p50"),
                Query(quantile(0.5, "gossipd_step_seconds"), "{{node_id}} step p50"),
            ],
            unit="s",
            log_scale=True,
        ),
    ],
)

COORDINATOR = Row(
    "Coordinator and scheduler",
    [
        Panel(
            "Coordinator up",
            "Prometheus's up series for the coordinator's metrics endpoint: 0 means it does not "
            "answer. The sites go on training without it (they schedule their pulls themselves) "
            "and register again when it returns.",
            [Query(f"up{{{COORDINATOR_JOB}}}", "{{instance}}")],
            width=6,
        ),
        Panel(
            "Members in the view",
            "Nodes registered with the coordinator and sending heartbeats "
            "(gossipd_coordinator_members), and open Membership streams. A node silent for "
            "drop_after_s leaves the view.",
            [
                Query(coordinator("gossipd_coordinator_members"), "{{instance}} members"),
                Query(coordinator("gossipd_coordinator_subscribers"), "{{instance}} streams"),
            ],
            width=6,
        ),
        Panel(
            "View epoch",
            "gossipd_coordinator_epoch: grows by one with every change of the view (a node "
            "registers, leaves or is dropped) and survives restarts (state.json).",
            [Query(coordinator("gossipd_coordinator_epoch"), "{{instance}}")],
            width=6,
        ),
        Panel(
            "Learned transfer times and busy peers",
            "Pairs (i, j) with a learned transfer time c_ij, and peers handed out for a pull "
            "whose transfer is not reported yet (freed by the report, or after "
            "scheduler.lease_s).",
            [
                Query(coordinator("gossipd_coordinator_estimates"), "{{instance}} c_ij learned"),
                Query(coordinator("gossipd_coordinator_busy_peers"), "{{instance}} busy peers"),
            ],
            width=6,
        ),
        Panel(
            "Start-time answers and reports per second",
            "StartTime answers by result (granted: a peer and a start time; wait: no peer "
            "free) and transfer reports by result (ok: a measured time; failed: the pull "
            "failed). Many waits mean more nodes ask than peers are free at once.",
            [
                Query(
                    coordinator_rate("gossipd_coordinator_grants_total", "result"),
                    "start time {{result}}",
                ),
                Query(
                    coordinator_rate("gossipd_coordinator_reports_total", "result"),
                    "report {{result}}",
                ),
            ],
            unit="reqps",
        ),
        Panel(
            "Pairings: pulls granted per second (node ← peer)",
            "gossipd_coordinator_pairings_total: which peer the scheduler sent each node to "
            "pull from. Its fair queue sends every node to every peer in turn, so the lines of "
            "one node sit close together; a pair missing for long means that peer is rarely "
            "free or not in the view.",
            [
                Query(
                    coordinator_rate("gossipd_coordinator_pairings_total", "node, peer"),
                    "{{node}} ← {{peer}}",
                )
            ],
            unit="reqps",
        ),
        Panel(
            "Coordinator rejections by reason",
            "Requests the coordinator refused, per second, by reason (unknown_node, self, "
            "scheduler, bad_time, bad_address, wrong_mesh, not_a_node, full: "
            "docs/coordinator.md); each is answered with a status naming the value and the "
            "fix, and serving goes on.",
            [
                Query(
                    coordinator_rate("gossipd_coordinator_rejected_total", "reason"),
                    "{{reason}}",
                )
            ],
            unit="reqps",
            no_value="none since the coordinator started",
        ),
    ],
)
