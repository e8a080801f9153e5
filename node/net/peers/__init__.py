"""Membership over the network: the view (sans-IO :mod:`.membership`), how peers have been
answering (:mod:`.health`), verifying claims by dialling, Leaves and anti-entropy
(:mod:`.peering`), and MQTT discovery and signed control (:mod:`.mqtt`).

May import :mod:`..dial`, :mod:`..wire` and :mod:`..telemetry` of ``net``.
"""
