"""Membership over the network: the view (sans-IO :mod:`.membership`), how peers have been
answering (:mod:`.health`), verifying claims by dialling and anti-entropy
(:mod:`.peering`), Leaves checked and peers dropped (:mod:`.departures`), a coordinator's
view followed (:mod:`.coordinator_view`), and MQTT discovery and signed control
(:mod:`.mqtt`).

May import :mod:`..dial`, :mod:`..wire` and :mod:`..telemetry` of ``net``.
"""
