"""The control commands of a running site (MQTT's pause, resume, checkpoint, leave), and
the MQTT agent that carries them, put together from the site's parts."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from gossipd.node.net.peers.mqtt import MqttAgent, Presences
from gossipd.node.net.telemetry.metrics import NodeMetrics
from gossipd.node.shared.config import NodeConfig
from gossipd.node.shared.tls import Material

if TYPE_CHECKING:
    from gossipd.node.site.checkpoints import Written


class Checkpoints(Protocol):
    """The site's checkpoint writer: writes one now, off the loop (raises
    CheckpointWriteError), and notes it on the loop once written."""

    def write(self) -> Written: ...

    def saved(self, step: int) -> None: ...


class StepCount(Protocol):
    @property
    def steps(self) -> int: ...


class SiteControls:
    """Pause and resume the trainer thread at a step boundary, write a checkpoint off the
    event loop, and leave the mesh the way SIGTERM does (``stop``)."""

    def __init__(
        self,
        resumed: threading.Event,
        steps: StepCount,
        checkpoints: Checkpoints,
        stop: asyncio.Event,
    ) -> None:
        self.resumed = resumed
        self.steps = steps
        self.checkpoints = checkpoints
        self.stop = stop

    def pause(self) -> str:
        self.resumed.clear()
        return (
            f"training pauses at the next step boundary (step {self.steps.steps}); gossip goes on"
        )

    def resume(self) -> str:
        was_paused = not self.resumed.is_set()
        self.resumed.set()
        return "training resumes" if was_paused else "training was not paused"

    async def checkpoint(self) -> str:
        written = await asyncio.to_thread(self.checkpoints.write)  # an error: a reply
        self.checkpoints.saved(written.step)
        return f"wrote {written.path} at step {written.step}"

    def leave(self) -> str:
        self.stop.set()
        return "leaving: handing this node's weight to a peer, then exiting"


def start_mqtt(
    config: NodeConfig,
    *,
    address: str,
    incarnation: int,
    peers: Presences,
    controls: SiteControls,
    metrics: NodeMetrics,
    material: Callable[[], Material | None],
) -> MqttAgent | None:
    """The site's MQTT agent, started; None when ``[mqtt]`` is not set."""
    if config.mqtt is None:
        return None
    agent = MqttAgent(
        config,
        address=address,
        incarnation=incarnation,
        peers=peers,
        controls=controls,
        metrics=metrics,
        material=material,
    )
    agent.start()
    return agent
