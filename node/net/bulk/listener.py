"""The receiving side of the bulk lane: a listener, the connections peers opened, each
claimed by the push (or pull) that names its token (:mod:`gossipd.node.net.bulk.lane`).

Every connection counts against ``limits.max_inbound_pushes_per_peer`` and
``limits.max_inbound_pushes`` (as ``Exchange`` streams do, separately), a
handshake or hello must finish within ``limits.stream_idle_timeout_s``, and a
connection idle that long, or closed by its peer, is closed here.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from gossipd.node.errors import BulkClosed, ConfigError, GossipdError, InvalidFrame, StreamIdle
from gossipd.node.model.torchthreads import worker_pool
from gossipd.node.net.bulk.connection import (
    HELLO_BYTES,
    MAGIC,
    MAGIC_SEALED,
    BulkConn,
    leave_tls,
    peer_node_id,
    read_hello,
    run_in,
    secure_socket_options,
)
from gossipd.node.net.bulk.sealing import SEED_BYTES, Seal, new_seed
from gossipd.node.net.limits.admission import PeerSlots, Slot, Slots
from gossipd.node.shared.tls import Credentials, IdentityMismatch

if TYPE_CHECKING:
    from gossipd.node.net.telemetry.metrics import NodeMetrics

T = TypeVar("T")

SWEEP_S = 1.0  # how often idle and closed connections are looked for


def _wake(fd: int, family: int) -> None:
    """Shut down the connection behind ``fd`` (still open: its owner has not returned),
    which wakes a thread blocked in it, through a duplicate descriptor."""
    with contextlib.suppress(OSError), socket.fromfd(fd, family, socket.SOCK_STREAM) as dup:
        dup.shutdown(socket.SHUT_RDWR)


class BulkServer:
    """Accepts bulk-lane connections and hands each to the push (or pull) that names it."""

    def __init__(
        self,
        tls: Credentials,
        *,
        idle_s: float,
        per_peer: int,
        total: int,
        on_rejected: Callable[[str, GossipdError], None],
        metrics: NodeMetrics,
    ) -> None:
        self.tls = tls
        self.metrics = metrics
        self.idle_s = idle_s
        self.on_rejected = on_rejected
        self.peer_slots = PeerSlots(
            per_peer, "bulk-lane connections", "limits.max_inbound_pushes_per_peer"
        )
        self.slots = Slots(total, "bulk-lane connections", "limits.max_inbound_pushes")
        # Reads, writes and handshakes; one per connection at most, so never queued.
        self.executor = worker_pool(total, "bulk")
        self.conns: dict[bytes, BulkConn] = {}
        metrics.bulk_connections.set_function(lambda: len(self.conns))
        self._releases: dict[bytes, list[Callable[[], None]]] = {}
        self._admitted = asyncio.Condition()
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: any free port); the port bound."""
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.bind((host.strip("[]"), port))
        except OSError as err:
            listener.close()
            raise ConfigError(
                f"bulk_port {port} on {host}: cannot bind it ({err.strerror}); pick another "
                "port, or 0 for any free one"
            ) from None
        listener.listen(64)
        listener.setblocking(False)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._spawn(self._accept_loop())
        self._spawn(self._sweep_loop())
        return self.port

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
        for token in list(self.conns):
            self._drop(token)
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            sock, addr = await loop.sock_accept(self._listener)
            where = f"{addr[0]}:{addr[1]}"
            try:
                slot = self.slots.take()
            except GossipdError as err:
                sock.close()
                self.on_rejected(where, err)
                continue
            self._spawn(self._admit(sock, where, slot))

    async def _admit(self, sock: socket.socket, where: str, slot: Slot) -> None:
        """TLS, the hello, the per-peer cap; then the connection waits for a push.

        The handshake and hello together get ``stream_idle_timeout_s`` (a socket
        timeout alone bounds each read, and a hello dribbled a byte per timeout would
        hold a slot and a thread twenty times that). Until admitted the connection is
        this coroutine's alone, and it closes whichever socket the worker left.
        """
        release = [slot.release]
        held = [sock]  # the socket to close on refusal: the TLS one once wrapped
        fd, family = sock.fileno(), sock.family
        admitted = False
        try:
            sock.setblocking(True)
            sock.settimeout(self.idle_s)
            secure_socket_options(sock)
            work = asyncio.get_running_loop().run_in_executor(
                self.executor, self._hello, sock, held
            )
            try:
                async with asyncio.timeout(self.idle_s):
                    conn = await asyncio.shield(work)
            except TimeoutError:
                _wake(fd, family)  # the worker is still in the socket: shut it down
                with contextlib.suppress(BaseException):
                    await work
                raise self._no_hello() from None
            if conn.token in self.conns:
                raise InvalidFrame("a bulk-lane hello reused a token that is in use")
            if conn.peer is not None:
                release.append(self.peer_slots.take(conn.peer).release)
            admitted = True
        except (GossipdError, OSError, ssl.SSLError) as err:
            if isinstance(err, TimeoutError):  # a read in the worker timed out first
                error: GossipdError = self._no_hello()
            else:
                error = err if isinstance(err, GossipdError) else BulkClosed(f"bulk lane: {err}")
            self.on_rejected(where, error)
        finally:
            if not admitted:
                with contextlib.suppress(OSError):
                    held[0].close()
                for undo in release:
                    undo()
        if admitted:
            self.conns[conn.token] = conn
            self._releases[conn.token] = release
            async with self._admitted:
                self._admitted.notify_all()

    def _no_hello(self) -> StreamIdle:
        return StreamIdle(
            f"no TLS handshake and hello within {self.idle_s:g} s "
            "(limits.stream_idle_timeout_s); the bulk-lane connection was closed"
        )

    def _hello(self, sock: socket.socket, held: list[socket.socket]) -> BulkConn:
        """TLS handshake and hello, blocking (a worker thread); ``held[0]`` is left the
        socket to close if this raises."""
        peer: str | None = None
        if not self.tls.insecure:
            sock = held[0] = self.tls.ssl_context(server_side=True).wrap_socket(
                sock, server_side=True
            )
            peer = peer_node_id(sock)
            if not self.tls.allows(peer):
                raise IdentityMismatch(
                    f"bulk-lane connection from {peer!r}, which tls.allow does not list"
                )
        hello = read_hello(sock, HELLO_BYTES)
        token = hello[len(MAGIC) :]
        if hello.startswith(MAGIC):
            return BulkConn(sock, token, peer)
        if not hello.startswith(MAGIC_SEALED):
            raise InvalidFrame(f"a bulk-lane connection began with {hello[:4]!r}, not GDB1 or GDB2")
        if not isinstance(sock, ssl.SSLSocket):
            raise InvalidFrame("a GDB2 (sealed) hello on a plaintext bulk lane; sealing needs TLS")
        dialer_seed, seed = read_hello(sock, SEED_BYTES), new_seed()
        if sock.pending():  # refused before this node's seed goes out
            raise InvalidFrame("a bulk-lane peer sent more in TLS than its hello")
        sock.sendall(seed)
        seal = Seal.derive(dialer_seed, seed, token, dialer=False)
        bare = held[0] = leave_tls(sock)
        return BulkConn(bare, token, peer, seal)

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            now = time.monotonic()
            for token, conn in list(self.conns.items()):
                if conn.busy:
                    continue
                if conn.peer_closed() or now - conn.used_s > self.idle_s:
                    self._drop(token)

    def _drop(self, token: bytes) -> None:
        conn = self.conns.pop(token, None)
        if conn is not None:
            conn.abort()
        for undo in self._releases.pop(token, []):
            undo()

    async def claim(self, token: bytes, sender: str) -> contextlib.AbstractContextManager[BulkConn]:
        """The connection ``token`` names, for one push or pull of ``sender``'s.

        Its dialer sends the push right after the hello, so a connection this node
        is still admitting is waited for (up to ``limits.stream_idle_timeout_s``).
        """
        if token not in self.conns:
            async with self._admitted:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.idle_s):
                        await self._admitted.wait_for(lambda: token in self.conns)
        return self._claimed(token, sender)

    @contextlib.contextmanager
    def _claimed(self, token: bytes, sender: str) -> Iterator[BulkConn]:
        """It comes back for the next push if the block ends cleanly, and is closed if
        it raises (bytes may be left unread on it)."""
        conn = self.conns.get(token)
        if conn is None or conn.closed:
            raise BulkClosed(
                f"{sender!r} named a bulk-lane connection this node does not hold (closed "
                f"idle after {self.idle_s:g} s, or never opened); retry on a new one"
            )
        if conn.peer is None:
            conn.peer = sender  # plaintext: the first sender to use it owns it
        elif conn.peer != sender:
            raise IdentityMismatch(
                f"{sender!r} named a bulk-lane connection that belongs to {conn.peer!r}"
            )
        if conn.busy:
            raise InvalidFrame(f"{sender!r} named a bulk-lane connection already in use")
        conn.busy = True
        try:
            yield conn
        except BaseException:
            self._drop(token)
            raise
        finally:
            conn.busy = False
            conn.used_s = time.monotonic()

    async def read(self, conn: BulkConn, view: memoryview) -> None:
        """Fill ``view`` from ``conn`` (a worker thread)."""
        await run_in(self.executor, conn, lambda: conn.recv_exact(view))
        self.metrics.bulk_bytes.labels("received").inc(len(view))

    def verify(self, check: Callable[[], T]) -> asyncio.Future[T]:
        """A segment's ``check`` (checksum, finiteness) in a worker thread, while the
        stream reads on: both release the GIL, and the bytes are still in the cache."""
        return asyncio.get_running_loop().run_in_executor(self.executor, check)

    async def write(self, conn: BulkConn, view: memoryview) -> None:
        """Write a pulled segment's payload whole on ``conn`` (a worker thread)."""
        await run_in(self.executor, conn, lambda: conn.send_all(view))
        self.metrics.bulk_bytes.labels("sent").inc(len(view))
