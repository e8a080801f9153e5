"""The dashboard's row for reach: which sites are reached through relays, and what the
relays forward and refuse (docs/nat.md).

Apart from ``panels.py`` to keep each file short; the same dataclasses and PromQL
helpers. The relay's counters carry labels, so each exports nothing until its first
event: their panels show an explicit 0 per node until then.
"""

from __future__ import annotations

from panels import INFO, RATE, Panel, Query, Row, per_node


def per_node_or_zero(expr: str, by: str) -> str:
    """:func:`per_node` of a labelled counter, or an explicit 0 per node while it has no
    series yet (a counter with labels exports nothing until its first event)."""
    return f"{per_node(expr, by)} or on (node_id) sum by (node_id) (0 * {INFO})"


REACH = Row(
    "Reach (sites behind NAT and their relays)",
    [
        Panel(
            "Reach per site",
            "gossipd_reach_relayed: 0 for a site dialled directly, 1 for an outbound-only site "
            "(behind NAT or a firewall, or reach.reachable = false), reached through relays. "
            "gossipd_relays_attached: the relays an outbound-only site holds now (reach.relays, "
            "default 2; always 0 on a direct site). An outbound-only site at 0 relays cannot be "
            "dialled by anyone: its seeds must name sites that can be dialled, with reach.relay "
            "on.",
            [
                Query(per_node("gossipd_reach_relayed"), "{{node_id}} relayed"),
                Query(per_node("gossipd_relays_attached"), "{{node_id}} relays attached"),
            ],
        ),
        Panel(
            "Relayed bytes per second",
            "Bytes each relay forwarded between a dialling site and a site attached to it, per "
            "second, by direction (to_site, to_dialer). Each such byte enters and leaves the "
            "relay's network interface, so its NIC carries twice this, plus the TLS and gRPC "
            "framing of both legs. Capped per relay by reach.rate_mbit (0: no cap). A node "
            "that relays for nobody shows 0.",
            [
                Query(
                    per_node_or_zero(f"rate(gossipd_relay_bytes_total[{RATE}])", "direction"),
                    "{{node_id}} {{direction}}",
                )
            ],
            unit="Bps",
        ),
        Panel(
            "Relay sessions and attached sites",
            "gossipd_relay_sessions: connections each relay joins now between a dialling site "
            "and an attached one (capped by reach.max_sessions, and reach.max_sessions_per_origin "
            "for one dialling site). gossipd_relay_attached_sites: outbound-only sites attached "
            "to it now (capped by reach.max_sites).",
            [
                Query(per_node("gossipd_relay_sessions"), "{{node_id}} sessions"),
                Query(per_node("gossipd_relay_attached_sites"), "{{node_id}} attached sites"),
            ],
        ),
        Panel(
            "Relay refusals by reason",
            "Relay requests each node refused, per second: absent (the site named is not "
            "attached here; normal for a moment after a site changed relays), loop (a dial naming "
            "the relay itself or the dialler), busy (a "
            "reach.max_* cap is full), forged (a Take with a token not given to that site), "
            "not_relaying (this node cannot be dialled or has reach.relay off, or a site "
            "attached with a direct address). Each is also in 'Rejected payloads by reason'. "
            "An explicit 0 per node when there are none.",
            [
                Query(
                    per_node_or_zero(f"rate(gossipd_relay_refused_total[{RATE}])", "reason"),
                    "{{node_id}} {{reason}}",
                )
            ],
            unit="reqps",
        ),
        Panel(
            "Connections to relayed sites by result",
            "Connections each node opened to an outbound-only site through its relays, per "
            "second: connected (a relay joined it), refused (one relay refused or did not join "
            "within 5 s; the next is tried), failed (none of the site's relays joined it). An "
            "explicit 0 per node when there are none.",
            [
                Query(
                    per_node_or_zero(f"rate(gossipd_relay_dials_total[{RATE}])", "result"),
                    "{{node_id}} {{result}}",
                )
            ],
            unit="reqps",
        ),
    ],
)
