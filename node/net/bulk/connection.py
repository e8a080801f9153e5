"""One bulk-lane connection and the hello that opens it, shared by both ends of the lane.

The lane itself (why it exists, what a connection carries) is described in
:mod:`gossipd.node.net.bulk.lane`; the listener is :mod:`gossipd.node.net.bulk.listener`, the
dialer :mod:`gossipd.node.net.bulk.dialer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import ssl
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from gossipd.node.errors import BulkClosed, InvalidFrame, StreamIdle
from gossipd.node.net.bulk.sealing import Seal, recv_exact
from gossipd.node.shared import certs
from gossipd.node.shared.tls import IdentityMismatch

T = TypeVar("T")

MAGIC = b"GDB1"
MAGIC_SEALED = b"GDB2"  # then a key seed; the connection leaves TLS for sealed records
TOKEN_BYTES = 16
HELLO_BYTES = len(MAGIC) + TOKEN_BYTES
RECV_PIECE = 8 << 20  # one recv_into asks for at most this much
SEND_PIECE = 4 << 20  # each piece gets the socket's whole timeout, and counts as progress


def secure_socket_options(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def leave_tls(sock: ssl.SSLSocket) -> socket.socket:
    """The bare socket under ``sock``, once both ends have keyed their sealed records:
    nothing more is sent in TLS either way, so nothing is lost (OpenSSL reads a record
    at a time and reads no further ahead)."""
    if sock.pending():
        raise InvalidFrame("a bulk-lane peer sent more in TLS than its hello")
    timeout, family = sock.gettimeout(), sock.family
    bare = socket.socket(family, socket.SOCK_STREAM, fileno=sock.detach())
    bare.settimeout(timeout)
    return bare


def peer_node_id(sock: ssl.SSLSocket) -> str:
    """The node id the peer's (CA-checked) certificate names."""
    der = sock.getpeercert(binary_form=True)
    node_id = certs.node_id_of(ssl.DER_cert_to_PEM_cert(der).encode()) if der else None
    if node_id is None:
        raise IdentityMismatch("the bulk-lane peer's certificate names no node id")
    return node_id


def read_hello(sock: socket.socket, size: int) -> bytes:
    """``size`` bytes of a hello or a seed (blocking, within the socket's timeout)."""
    data = bytearray(size)
    recv_exact(sock, memoryview(data), "the hello or its answer")
    return bytes(data)


class BulkConn:
    """One bulk-lane socket; blocking reads and writes run in worker threads.

    ``abort`` may come from any thread while a worker is blocked in the socket:
    it shuts the socket down (which wakes the worker) and the worker closes it.
    """

    def __init__(
        self, sock: socket.socket, token: bytes, peer: str | None, seal: Seal | None = None
    ) -> None:
        self.sock = sock
        self.token = token
        self.peer = peer  # the certificate's node id; in plaintext the first sender using it
        self.seal = seal  # sealed records on the bare socket (None: plaintext or TLS bytes)
        self.busy = False
        self.used_s = time.monotonic()
        self._lock = threading.Lock()
        self._closed = False
        self._inside = False

    @property
    def closed(self) -> bool:
        return self._closed

    def _run(self, work: Callable[[], None]) -> None:
        with self._lock:
            if self._closed:
                raise BulkClosed("the bulk-lane connection is closed")
            self._inside = True
        try:
            work()
        except TimeoutError:
            raise StreamIdle(
                f"no byte moved on the bulk lane for {self.sock.gettimeout():g} s "
                "(limits.stream_idle_timeout_s); the connection was closed"
            ) from None
        except (OSError, ValueError) as err:
            raise BulkClosed(f"bulk-lane connection failed: {err}") from None
        finally:
            with self._lock:
                self._inside = False
                if self._closed:
                    self.sock.close()

    def recv_exact(self, view: memoryview) -> None:
        """Fill ``view`` from the socket (a worker thread); BulkClosed at EOF or error."""

        def work() -> None:
            if self.seal is not None:
                self.seal.recv(self.sock, view)
                return
            got, size = 0, len(view)
            while got < size:
                n = self.sock.recv_into(view[got:], min(size - got, RECV_PIECE))
                if n == 0:
                    raise BulkClosed(f"the peer closed the bulk lane after {got} of {size} bytes")
                got += n

        self._run(work)

    def send_all(self, view: memoryview, sent: Callable[[], None] | None = None) -> None:
        """Write ``view`` whole (a worker thread), ``SEND_PIECE`` at a time: ``sendall``'s
        timeout bounds one whole call, so each piece has ``stream_idle_timeout_s`` of its
        own (a rate floor, not a deadline for the payload); ``sent`` is called after each.
        One worker call for the whole payload: a hop per piece cost more than the send."""

        def work() -> None:
            for start in range(0, len(view), SEND_PIECE):
                piece = view[start : start + SEND_PIECE]
                if self.seal is not None:
                    self.seal.send(self.sock, piece)
                else:
                    self.sock.sendall(piece)
                if sent is not None:
                    sent()

        self._run(work)

    def peer_closed(self) -> bool:
        """Whether the peer has closed its side; never blocks. Bytes waiting are not a
        close: a sender's payload may arrive before its header on gRPC does."""
        if self._closed:
            return True
        try:
            # A socket with a timeout waits for readability before any recv: ask first.
            if not select.select([self.sock], [], [], 0)[0]:
                return False
            data = socket.socket.recv(self.sock, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return False
        except (OSError, ValueError):
            return True
        return data == b""

    def abort(self) -> None:
        """Close it now, waking a worker blocked in it; idempotent, any thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            with contextlib.suppress(OSError):
                # The socket's own shutdown: an SSLSocket's would drop its TLS object
                # under a worker still inside it.
                socket.socket.shutdown(self.sock, socket.SHUT_RDWR)
            if not self._inside:
                self.sock.close()


async def run_in(executor: ThreadPoolExecutor, conn: BulkConn, work: Callable[[], T]) -> T:
    """``work`` on ``conn`` in ``executor``; if the awaiting task is cancelled (a deadline),
    the connection is closed so the worker returns at once."""
    future = asyncio.get_running_loop().run_in_executor(executor, work)
    try:
        return await asyncio.shield(future)
    except BaseException:
        conn.abort()
        with contextlib.suppress(BaseException):
            await future
        raise


class InOrder:
    """A push's or pull's lane payloads, each written in a worker while the caller makes
    the next segment's header and checksum: a payload starts once the one before it is
    written (the reader takes them in header order). Leaving the block normally waits for
    the last one; leaving it by an error or a cancellation cancels it, which closes the
    lane (:func:`run_in`)."""

    def __init__(self) -> None:
        self._writing: asyncio.Future[None] | None = None

    async def write(self, start: Callable[[], Awaitable[None]]) -> None:
        """Call ``start`` (it returns the payload's write) once the one before is written."""
        if self._writing is not None:
            await self._writing
        self._writing = asyncio.ensure_future(start())

    async def __aenter__(self) -> InOrder:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, *_: object) -> None:
        writing, self._writing = self._writing, None
        if writing is None:
            return
        if kind is None:
            await writing
        elif not writing.done():
            writing.cancel()
            with contextlib.suppress(BaseException):
                await writing
