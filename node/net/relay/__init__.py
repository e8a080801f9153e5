"""Reach: sites that cannot be dialled take part over connections they dialled themselves.

A site behind NAT or a firewall attaches to one or more reachable peers, its relays
(:mod:`.attach`); a connection meant for it goes to one of them, which asks the site
over its attachment to dial a second stream back and joins the two (:mod:`.hub`). What
crosses a relay is the two end sites' own TLS: the relay cannot read, alter, replay or
forge it. A dialler reaches a relayed site through a loopback port of its own
(:mod:`.routes`), so gRPC's channels and everything keyed on the peer's certificate
work as on a direct link. :mod:`.reach` is how a site learns whether it can be dialled.

May import ``limits``, ``telemetry`` and ``wire``; ``serve``, ``dial`` and what is
above them import this room.
"""
