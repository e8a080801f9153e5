"""The sending side of the bulk lane: a peer client's connections to one receiver's lane
(:mod:`gossipd.node.net.bulk.lane`), dialled when needed and reused push after push, and
when a payload goes there at all (:class:`PeerLane`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from gossipd.node.errors import BulkClosed, GossipdError
from gossipd.node.model.torchthreads import worker_pool
from gossipd.node.net.bulk.connection import (
    MAGIC,
    MAGIC_SEALED,
    TOKEN_BYTES,
    BulkConn,
    leave_tls,
    peer_node_id,
    read_hello,
    run_in,
    secure_socket_options,
)
from gossipd.node.net.bulk.sealing import SEED_BYTES, Seal, new_seed
from gossipd.node.shared.tls import Credentials, IdentityMismatch

if TYPE_CHECKING:
    from gossipd.proto import gossip_pb2 as pb

log = logging.getLogger(__name__)
T = TypeVar("T")

IDLE_S = 2.0  # a dialled connection unused this long is closed rather than reused
BULK_RECHECK_S = 60.0  # a peer without a lane (or unreachable there) is asked again after this
BULK_DIAL_S = 5.0  # the most a lane's Handshake or connection set-up may take


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
    """``callback`` on ``loop`` from a worker thread; nothing once the loop has closed."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback)


class BulkDialer:
    """A peer client's idle bulk-lane connections to one node, reused push after push."""

    def __init__(
        self,
        host: str,
        port: int,
        tls: Credentials,
        expected: str | None,
        workers: int,
        *,
        sealed: bool = False,
    ) -> None:
        """``sealed``: the peer advertised sealed records (only used over TLS)."""
        self.host = host.strip("[]")
        self.port = port
        self.tls = tls
        self.expected = expected
        self.sealed = sealed and not tls.insecure
        self.executor = worker_pool(workers, "bulk-out")
        self._idle: list[BulkConn] = []

    async def take(self, timeout_s: float) -> BulkConn:
        """An idle connection still open, or a new one (GossipdError if none can be had)."""
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            worn = conn.seal is not None and conn.seal.worn
            if now - conn.used_s < IDLE_S and not worn and not conn.peer_closed():
                conn.busy = True
                return conn
            conn.abort()
        loop = asyncio.get_running_loop()
        try:
            conn = await asyncio.wait_for(
                loop.run_in_executor(self.executor, self._dial, timeout_s), timeout_s
            )
        except (OSError, ssl.SSLError, TimeoutError) as err:
            raise BulkClosed(f"bulk lane {self.host}:{self.port}: cannot connect: {err}") from None
        conn.busy = True
        return conn

    def _dial(self, timeout_s: float) -> BulkConn:
        sock = socket.create_connection((self.host, self.port), timeout=timeout_s)
        try:
            secure_socket_options(sock)
            if not self.tls.insecure:
                sock = self.tls.ssl_context(server_side=False).wrap_socket(sock)
                peer = peer_node_id(sock)
                if self.expected is not None and peer != self.expected:
                    raise IdentityMismatch(
                        f"bulk lane {self.host}:{self.port} is {peer!r}, not {self.expected!r}"
                    )
            token = os.urandom(TOKEN_BYTES)
            seal = None
            if self.sealed:
                seed = new_seed()
                sock.sendall(MAGIC_SEALED + token + seed)
                seal = Seal.derive(seed, read_hello(sock, SEED_BYTES), token, dialer=True)
                assert isinstance(sock, ssl.SSLSocket), "sealed records are keyed inside TLS"
                sock = leave_tls(sock)
            else:
                sock.sendall(MAGIC + token)
            # From here the push's or pull's own deadlines bound every read and write: they
            # close the connection, which wakes the worker. A socket timeout would also
            # cap each whole sendall, which a slow link can honestly take longer than.
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        return BulkConn(sock, token, self.expected, seal)

    def put_back(self, conn: BulkConn) -> None:
        conn.busy = False
        conn.used_s = time.monotonic()
        self._idle.append(conn)

    async def send(self, conn: BulkConn, view: memoryview, progressed: Callable[[], None]) -> None:
        """Write ``view`` on ``conn``, each piece sent counting as progress."""
        loop = asyncio.get_running_loop()
        await run_in(
            self.executor,
            conn,
            lambda: conn.send_all(view, lambda: _call_soon(loop, progressed)),
        )

    async def read(self, conn: BulkConn, view: memoryview) -> None:
        await run_in(self.executor, conn, lambda: conn.recv_exact(view))

    def verify(self, check: Callable[[], T]) -> asyncio.Future[T]:
        """A pulled segment's ``check`` in a worker thread, while the pull reads on."""
        return asyncio.get_running_loop().run_in_executor(self.executor, check)

    def close(self) -> None:
        for conn in self._idle:
            conn.abort()
        self._idle.clear()
        self.executor.shutdown(wait=False, cancel_futures=True)


class PeerLane:
    """A peer client's way onto one peer's bulk lane, shared by its pushes and pulls: the
    dialer, once the peer's Handshake named a lane port, and when to ask again."""

    def __init__(
        self,
        address: str,
        tls: Credentials,
        expected: str | None,
        workers: int,
        *,
        enabled: bool,
        min_bytes: int,
        handshake: Callable[[float], Awaitable[pb.HandshakeReply]],
    ) -> None:
        """``enabled``: the node's ``bulk``, and no ``[link]`` shaping (shaping paces chunk
        frames, which the lane would bypass); a payload under ``min_bytes`` goes in chunk
        frames; ``handshake``: the client's Handshake to the peer, which names its lane;
        ``workers``: the dialer's worker threads."""
        self.address = address
        self.tls = tls
        self.expected = expected
        self.workers = workers
        self.enabled = enabled
        self.min_bytes = min_bytes
        self._handshake = handshake
        self.dialer: BulkDialer | None = None
        self._asked_s = -BULK_RECHECK_S

    async def conn(self, nbytes: int, timeout_s: float) -> BulkConn | None:
        """A connection to the peer's bulk lane for ``nbytes`` of payload, or None: the
        payload then goes in chunk frames (small, shaped, no lane, or the lane failed).

        The lane's port comes from the peer's Handshake, asked once (again after
        ``BULK_RECHECK_S`` when it had none or could not be reached).
        """
        if not self.enabled or nbytes < self.min_bytes:
            return None  # shaping paces chunk frames
        loop = asyncio.get_running_loop()
        if self.dialer is None:
            if loop.time() - self._asked_s < BULK_RECHECK_S:
                return None
            self._asked_s = loop.time()
            try:
                reply = await self._handshake(min(timeout_s, BULK_DIAL_S))
            except GossipdError:
                return None
            if not reply.bulk_port:
                return None
            host = self.address.rpartition(":")[0]
            self.dialer = BulkDialer(
                host,
                reply.bulk_port,
                self.tls,
                self.expected,
                self.workers,
                sealed=reply.bulk_sealed,
            )
        try:
            return await self.dialer.take(min(timeout_s, BULK_DIAL_S))
        except GossipdError as err:
            log.info(
                "bulk lane of %s: %s; this push goes in gRPC frames, the lane is tried "
                "again in %.0f s",
                self.address,
                err,
                BULK_RECHECK_S,
            )
            self.dialer.close()
            self.dialer = None
            return None

    def close(self) -> None:
        if self.dialer is not None:
            self.dialer.close()
