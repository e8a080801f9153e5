"""The bulk lane: segment payloads as raw bytes on a plain TCP (or TLS) socket beside gRPC.

grpc.aio moves a megabyte chunk through several copies and Python objects on the
event loop's one thread; on a 2-core machine a bare grpc.aio stream tops out near
half of what a TCP socket moves, and gossip's own work comes on top. The lane
takes the bytes off that path: the push (or pull) itself still runs on gRPC,
with every frame, check, refusal and reply as before, but a header marked
``bulk`` says that its payload follows on the sender's lane connection instead
of in chunk frames. The receiver reads exactly ``payload_bytes`` from that
socket straight into the segment's buffer (``recv_into``, in a worker thread
that releases the GIL), then checks it as it checks chunks.

A connection starts with TLS 1.3 and the site certificates the gRPC port uses
(the peer's node id is its certificate's, and ``tls.allow`` applies), then a
hello: ``GDB1`` and a 16-byte token the dialer chose. Over TLS a dialer whose peer
advertises ``HandshakeReply.bulk_sealed`` says ``GDB2`` instead, with a key seed; the
server answers with its own seed, and from there the connection carries sealed
records on the bare socket (:mod:`gossipd.node.net.sealing`: the same certificates and
secrecy, at a fraction of Python ``ssl``'s CPU). A push names the token in
``PushOpen.bulk_token``; the connection must belong to the push's sender and
carries one push at a time, its payloads in header order. Anything that goes
wrong mid-push (a refusal, a stall, a cut) closes the connection, since bytes
may be left unread on it; a clean push leaves it for the next one.

Every connection counts against ``limits.max_inbound_pushes_per_peer`` and
``limits.max_inbound_pushes`` (as ``Exchange`` streams do, separately), a
handshake or hello must finish within ``limits.stream_idle_timeout_s``, and a
connection idle that long, or closed by its peer, is closed here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

from gossipd.node.errors import BulkClosed, ConfigError, GossipdError, InvalidFrame, StreamIdle
from gossipd.node.net.admission import PeerSlots, Slots
from gossipd.node.net.sealing import SEED_BYTES, Seal, new_seed, recv_exact
from gossipd.node.shared import certs
from gossipd.node.shared.tls import Credentials, IdentityMismatch
from gossipd.node.trainer.torchthreads import worker_pool

if TYPE_CHECKING:
    from gossipd.node.net.metrics import NodeMetrics

T = TypeVar("T")

MAGIC = b"GDB1"
MAGIC_SEALED = b"GDB2"  # then a key seed; the connection leaves TLS for sealed records
TOKEN_BYTES = 16
HELLO_BYTES = len(MAGIC) + TOKEN_BYTES
RECV_PIECE = 8 << 20  # one recv_into asks for at most this much
SEND_PIECE = 4 << 20  # each piece gets the socket's whole timeout, and counts as progress
SWEEP_S = 1.0  # how often idle and closed connections are looked for
IDLE_S = 2.0  # a dialled connection unused this long is closed rather than reused


def _secure_socket_options(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _wake(fd: int, family: int) -> None:
    """Shut down the connection behind ``fd`` (still open: its owner has not returned),
    which wakes a thread blocked in it, through a duplicate descriptor."""
    with contextlib.suppress(OSError), socket.fromfd(fd, family, socket.SOCK_STREAM) as dup:
        dup.shutdown(socket.SHUT_RDWR)


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


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
    """``callback`` on ``loop`` from a worker thread; nothing once the loop has closed."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback)


# ---------------------------------------------------------------------------
# The receiving side: a listener, the connections peers opened, claimed by pushes


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

    def _spawn(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[arg-type]
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

    async def _admit(self, sock: socket.socket, where: str, slot: object) -> None:
        """TLS, the hello, the per-peer cap; then the connection waits for a push.

        The handshake and hello together get ``stream_idle_timeout_s`` (a socket
        timeout alone bounds each read, and a hello dribbled a byte per timeout would
        hold a slot and a thread twenty times that). Until admitted the connection is
        this coroutine's alone, and it closes whichever socket the worker left.
        """
        release = [slot.release]  # type: ignore[attr-defined]
        held = [sock]  # the socket to close on refusal: the TLS one once wrapped
        fd, family = sock.fileno(), sock.family
        admitted = False
        try:
            sock.setblocking(True)
            sock.settimeout(self.idle_s)
            _secure_socket_options(sock)
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
            peer = peer_node_id(sock)  # type: ignore[arg-type]
            if not self.tls.allows(peer):
                raise IdentityMismatch(
                    f"bulk-lane connection from {peer!r}, which tls.allow does not list"
                )
        hello = _read_hello(sock, HELLO_BYTES)
        token = hello[len(MAGIC) :]
        if hello.startswith(MAGIC):
            return BulkConn(sock, token, peer)
        if not hello.startswith(MAGIC_SEALED):
            raise InvalidFrame(f"a bulk-lane connection began with {hello[:4]!r}, not GDB1 or GDB2")
        if not isinstance(sock, ssl.SSLSocket):
            raise InvalidFrame("a GDB2 (sealed) hello on a plaintext bulk lane; sealing needs TLS")
        dialer_seed, seed = _read_hello(sock, SEED_BYTES), new_seed()
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


def _read_hello(sock: socket.socket, size: int) -> bytes:
    """``size`` bytes of a hello or a seed (blocking, within the socket's timeout)."""
    data = bytearray(size)
    recv_exact(sock, memoryview(data), "the hello or its answer")
    return bytes(data)


# ---------------------------------------------------------------------------
# The sending side: a peer client's connections to one receiver's lane


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
            _secure_socket_options(sock)
            if not self.tls.insecure:
                sock = self.tls.ssl_context(server_side=False).wrap_socket(sock)
                peer = peer_node_id(sock)  # type: ignore[arg-type]
                if self.expected is not None and peer != self.expected:
                    raise IdentityMismatch(
                        f"bulk lane {self.host}:{self.port} is {peer!r}, not {self.expected!r}"
                    )
            token = os.urandom(TOKEN_BYTES)
            seal = None
            if self.sealed:
                seed = new_seed()
                sock.sendall(MAGIC_SEALED + token + seed)
                seal = Seal.derive(seed, _read_hello(sock, SEED_BYTES), token, dialer=True)
                sock = leave_tls(sock)  # type: ignore[arg-type]
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
