"""A coordinator, where one is configured: this node registers there and follows its view
of the mesh, whose addresses are dialled like seeds (:meth:`Peering.heard_view`); the
overlap protocol asks it for pulls (:mod:`..gossip.port`).

It never holds the node up: unreachable, the node schedules alone until it answers.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gossipd.coordinator.client import CoordinatorClient
    from gossipd.node.net.peers.peering import Peering
    from gossipd.node.shared.tls import Credentials

log = logging.getLogger(__name__)


async def follow_coordinator(
    address: str, mesh_id: str, advertise: str, tls: Credentials, peering: Peering
) -> CoordinatorClient:
    """The client of the coordinator at ``address``, registering in the background as
    ``advertise``; its view goes to ``peering``."""
    from gossipd.coordinator.client import CoordinatorClient

    coordinator = CoordinatorClient(
        address, mesh_id=mesh_id, advertise=advertise, tls=tls, on_view=peering.heard_view
    )
    await coordinator.start()
    log.info(
        "coordinator %s: registering (until it answers, this node schedules its pulls alone)",
        address,
    )
    return coordinator
