"""An MQTT broker inside the process that asks for one: amqtt (pure Python) on loopback.

`gossipd demo --discovery mqtt` uses it so the demo still needs nothing installed;
a real mesh points ``[mqtt] broker`` at its own broker (Mosquitto, say). The
broker runs on a thread of its own with its own event loop, so a caller with no
loop (the demo, a test) starts and stops it with plain calls. It accepts
anonymous clients on 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Iterator
from types import TracebackType
from typing import Any

from gossipd.node.errors import GossipdError
from gossipd.node.launch.localmesh import free_ports

START_TIMEOUT_S = 30.0


class _Snapshots(dict):  # type: ignore[type-arg]
    """amqtt's table of subscriptions, iterated over a copy.

    amqtt 0.12 awaits inside its loops over this table (sending a connecting client the
    retained messages of every subscribed topic; fanning a publish out to subscribers), so
    a client subscribing to a new topic meanwhile ended the loop with "dictionary changed
    size during iteration": the connecting client was dropped without a CONNACK and the
    caller timed out. Each loop over a copy sees the table as it was when the loop began.
    """

    def __iter__(self) -> Iterator[Any]:
        return iter(list(dict.keys(self)))

    def items(self) -> list[tuple[Any, Any]]:  # type: ignore[override]
        return list(dict.items(self))


class EmbeddedBroker:
    def __init__(self, port: int | None = None) -> None:
        """``port``: where to listen on 127.0.0.1; None picks a free one."""
        self.port = port or free_ports(1)[0]
        self.address = f"127.0.0.1:{self.port}"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Event | None = None

    def start(self) -> str:
        """Serve; returns ``HOST:PORT``. Raises GossipdError if it does not come up."""
        ready = threading.Event()
        failure: list[BaseException] = []
        self._thread = threading.Thread(
            target=self._run, args=(ready, failure), name="mqtt-broker", daemon=True
        )
        self._thread.start()
        if not ready.wait(START_TIMEOUT_S) or failure:
            self.stop()
            why = failure[0] if failure else f"not up within {START_TIMEOUT_S} s"
            raise GossipdError(f"the embedded MQTT broker on {self.address} did not start: {why}")
        return self.address

    def _run(self, ready: threading.Event, failure: list[BaseException]) -> None:
        # amqtt logs every connection at INFO; the demo's output is about training.
        for name in ("amqtt", "transitions"):
            logging.getLogger(name).setLevel(logging.WARNING)
        from amqtt.broker import Broker

        async def serve() -> None:
            self._stopped = asyncio.Event()
            broker = Broker(
                {
                    "listeners": {"default": {"type": "tcp", "bind": self.address}},
                    "plugins": {
                        "amqtt.plugins.authentication.AnonymousAuthPlugin": {
                            "allow_anonymous": True
                        }
                    },
                }
            )
            if type(getattr(broker, "_subscriptions", None)) is dict:
                broker._subscriptions = _Snapshots()
            try:
                await broker.start()
            except BaseException as err:
                failure.append(err)
                ready.set()
                return
            ready.set()
            try:
                await self._stopped.wait()
            finally:
                await broker.shutdown()

        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(serve())
        finally:
            self._loop.close()

    def stop(self) -> None:
        """Stop serving (clients see the connection drop) and end the thread."""
        loop, stopped = self._loop, self._stopped
        if loop is not None and stopped is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # closed in between: it stopped already
                loop.call_soon_threadsafe(stopped.set)
        if self._thread is not None:
            self._thread.join(START_TIMEOUT_S)
            self._thread = None

    def __enter__(self) -> EmbeddedBroker:
        self.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        err: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
