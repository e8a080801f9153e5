"""Whether this site can be dialled, found at start, and its relays if it cannot.

``reach.reachable = auto`` asks the seeds, in turn, to dial this site back at its
advertised address (:mod:`gossipd.node.net.relay.reach`); ``false`` skips the question,
``true`` skips it the other way. A site that can be dialled relays for those that
cannot (``reach.relay``). One that cannot runs outbound-only: it advertises
``relay://SITE@RELAYS``, keeps its attachments (:mod:`gossipd.node.net.relay.attach`),
and when they change it tells its peers (a Handshake, which makes each of them verify
the new address) and the coordinator. The operator reads one INFO line saying what
was found and what the site does about it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from gossipd.node.net.peers.peering import Peering
from gossipd.node.net.relay.attach import Attachments
from gossipd.node.net.relay.hub import RelayHub
from gossipd.node.net.relay.reach import Finding, ReachChecker, ask_reach
from gossipd.node.net.telemetry.metrics import NodeMetrics
from gossipd.node.net.wire.identity import Identity
from gossipd.node.net.wire.tasks import LoopTasks
from gossipd.node.shared.config import NodeConfig
from gossipd.node.shared.config_reach import ReachConfig
from gossipd.node.shared.relay_address import is_relayed, reach_of
from gossipd.node.shared.tls import Credentials

log = logging.getLogger(__name__)

# An outbound-only site with no relay this long after start says so at WARNING.
NO_RELAY_WARN_S = 15.0
# A site no peer could dial back at start asks again this often until one answers.
RECHECK_S = 10.0


def loopback_of(bound: str) -> str:
    """How this site dials its own server: a wildcard host becomes loopback."""
    host, _, port = bound.rpartition(":")
    if host in ("", "0.0.0.0", "[::]", "::"):
        host = "127.0.0.1"
    return f"{host}:{port}"


class Reach:
    """This site's reach: direct, or outbound-only through its attachments."""

    def __init__(
        self,
        *,
        config: ReachConfig,
        seeds: list[str],
        tls: Credentials,
        hub: RelayHub,
        metrics: NodeMetrics,
        peering: Peering,
        tasks: LoopTasks,
        readvertise: Callable[[str], None],
    ) -> None:
        """``seeds``: the peers asked to dial this site back, and its first relays;
        ``readvertise``: the node's own hook for a new address (its identity, the
        coordinator's registration)."""
        self.config = config
        self.seeds = seeds
        self.tls = tls
        self.hub = hub
        self.metrics = metrics
        self.peering = peering
        self.tasks = tasks
        self.readvertise = readvertise
        self.attachments: Attachments | None = None
        self.finding: Finding | None = None
        self.checked_at = ""
        self._said = False

    @property
    def relayed(self) -> bool:
        return self.attachments is not None

    async def settle(self, identity: Identity, bound: str) -> str:
        """Find this site's reach; returns the address it advertises from now on."""
        wanted = self.config.reachable
        self.checked_at = identity.address
        if wanted == "auto":
            seeds = [s for s in self.seeds if s != identity.address]
            self.finding = await ask_reach(self.tls, identity.mesh_id, identity.info(), seeds)
            if self.finding.reachable is None:
                log.info(
                    "reach: %s; taken as direct at %s for now, asked again every %.0f s "
                    "until a peer answers",
                    self.finding.detail,
                    identity.address,
                    RECHECK_S,
                )
                self.tasks.spawn(self._ask_again(identity, bound), "reach-check")
            wanted = self.finding.reachable is not False
        if wanted:
            self._go_direct(identity)
            return identity.address
        return self._go_outbound(identity, bound)

    def _go_direct(self, identity: Identity) -> None:
        self.hub.enabled = self.config.relay
        self.metrics.reach_relayed.set(0)
        if self.finding is not None and self.finding.reachable:
            log.info(
                "reach: dialled back at %s by %s: direct%s",
                identity.address,
                self.finding.peer,
                ", relaying for sites that cannot be dialled" if self.hub.enabled else "",
            )

    async def _ask_again(self, identity: Identity, bound: str) -> None:
        """No peer could be asked at start (this site came up before its seeds): ask the
        seeds and the peers that turned up since, until one answers."""
        while True:
            await asyncio.sleep(RECHECK_S)
            live = [p.address for p in self.peering.membership.live() if not is_relayed(p.address)]
            asked = [a for a in dict.fromkeys([*live, *self.seeds]) if a != identity.address]
            finding = await ask_reach(self.tls, identity.mesh_id, identity.info(), asked)
            if finding.reachable is None:
                continue
            self.finding = finding
            if finding.reachable:
                self._go_direct(identity)
            else:
                self.hub.enabled = False
                self.readvertise(self._go_outbound(identity, bound))
            return

    def _go_outbound(self, identity: Identity, bound: str) -> str:
        self.metrics.reach_relayed.set(1)
        self.attachments = Attachments(
            node_id=identity.node_id,
            mesh_id=identity.mesh_id,
            tls=self.tls,
            local=loopback_of(bound),
            config=self.config,
            metrics=self.metrics,
            candidates=self._candidates,
            on_change=self._changed,
        )
        self.tasks.spawn(self.attachments.run(), "relay-attachments")
        self.tasks.spawn(self._warn_if_alone(), "relay-watch")
        return self.attachments.address()

    def _why(self, address: str) -> str:
        if self.finding is None:
            return "reach.reachable = false"
        return f"not reachable at {address} from {self.finding.peer} ({self.finding.detail})"

    def _candidates(self) -> list[tuple[str, str]]:
        live = [(p.node_id, p.address) for p in self.peering.membership.live()]
        return live + [("", seed) for seed in self.seeds]

    def _changed(self, address: str) -> None:
        if not self._said and self.attachments and self.attachments.active:
            self._said = True
            log.info(
                "reach: %s: outbound-only, %s",
                self._why(self.checked_at),
                reach_of(address),
            )
        else:
            log.info("reach: now %s", reach_of(address))
        self.readvertise(address)
        for peer in self.peering.membership.live():
            self.tasks.spawn(self._tell(peer.address), f"readvertise:{peer.node_id}")

    async def _tell(self, address: str) -> None:
        try:
            await self.peering.handshake(address)
        except Exception as err:
            log.debug("could not tell %s this site's new address: %s", address, err)

    async def _warn_if_alone(self) -> None:
        await asyncio.sleep(NO_RELAY_WARN_S)
        if not self._said:
            log.warning(
                "reach: %s: outbound-only, but no relay yet after %.0f s: no reachable peer "
                "accepted an attachment (give seeds that can be dialled, with reach.relay = "
                "true); still trying",
                self._why(self.checked_at),
                NO_RELAY_WARN_S,
            )


def build_reach(
    config: NodeConfig,
    tls: Credentials,
    metrics: NodeMetrics,
    peering: Peering,
    tasks: LoopTasks,
    readvertise: Callable[[str], None],
) -> tuple[RelayHub, ReachChecker, Reach]:
    """A node's relay, its answer to reach checks, and its own reach."""
    hub = RelayHub(config.node_id, config.mesh_id, config.reach, metrics)
    reach = Reach(
        config=config.reach,
        seeds=config.seeds,
        tls=tls,
        hub=hub,
        metrics=metrics,
        peering=peering,
        tasks=tasks,
        readvertise=readvertise,
    )
    return hub, ReachChecker(tls, config.mesh_id), reach
