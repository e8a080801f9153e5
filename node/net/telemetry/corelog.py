"""gRPC's C core writes its own log lines to file descriptor 2; this routes them.

grpcio's core logs through absl straight to fd 2, in its own format and at its own
levels, bypassing Python's logging: each client that calls a TLS site without a
certificate of the mesh (a plaintext probe, ``gossipd status`` without ``--config``)
printed ``I1123 … ssl_transport_security.cc:…] Handshake failed with error SSL_ERROR_SSL
…`` into the node's log, one per connection. ``GRPC_VERBOSITY`` can only hide them, and
no Python API reports a failed server-side handshake, so the daemon puts a pipe on fd 2
before gRPC starts and reads it on a thread:

- a failed TLS handshake becomes a refusal: counted (``rejected`` in Status,
  ``gossipd_rejected_payloads_total{reason="TlsHandshake"}``) and logged by the node's
  rate-limited rejection log, with what the caller lacks;
- any other core line goes to the ``gossipd.grpc`` logger (its I lines at DEBUG);
- everything else on fd 2 (Python's own stderr, tracebacks) passes through unchanged.

``close`` puts fd 2 back and drains the pipe, so nothing written before exit is lost.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import re
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gossipd.node.net.telemetry.metrics import NodeMetrics
    from gossipd.node.shared.rejections import RejectionLog

log = logging.getLogger("gossipd.grpc")

# absl's prefix: severity letter, MMDD hh:mm:ss.micros, thread id, file:line]
CORE_LINE = re.compile(rb"^([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ ([^\]\s]+)\] (.*)$")
HANDSHAKE_FAILED = re.compile(rb"Handshake failed with error \w+: (?:error:[0-9a-f]+:)?(.*)")
LEVELS = {b"I": logging.DEBUG, b"W": logging.WARNING, b"E": logging.ERROR, b"F": logging.CRITICAL}
ABSL_PREAMBLE = b"WARNING: All log messages before absl::InitializeLog()"
EARLY_MAX = 256  # handshake failures kept until the node's rejection log is attached
TLS_REASON = "TlsHandshake"
TLS_PEER = "a TLS client"  # the core line names no address: one rejection key for all


def _reason(detail: bytes) -> str:
    """``SSL routines:OPENSSL_internal:PEER_DID_NOT_RETURN_A_CERTIFICATE: …`` → the code."""
    parts = detail.decode(errors="replace").split(":")
    codes = [p.strip() for p in parts if p.strip().isupper() and "_" in p]
    return codes[0] if codes else detail.decode(errors="replace").strip()


def describe(code: str) -> str:
    """What an operator reads for one kind of failed handshake."""
    return (
        f"TLS handshake failed ({code}): a client without a certificate of this mesh's CA "
        "(plaintext, no client certificate, or another CA) called; `gossipd status` and "
        "`gossipd health` need --config SITE.toml or --ca/--cert/--key"
    )


class CoreLog:
    """The reader of fd 2; ``attach`` hands handshake failures to the node's rejection log."""

    def __init__(self) -> None:
        self._saved = os.dup(2)
        read_fd, write_fd = os.pipe()
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self._read = os.fdopen(read_fd, "rb", buffering=0)
        self._lock = threading.Lock()
        self._early: collections.deque[str] = collections.deque(maxlen=EARLY_MAX)
        self._sink: tuple[asyncio.AbstractEventLoop, RejectionLog, NodeMetrics] | None = None
        # The reader never writes into its own pipe (a full pipe would stall it): its lines
        # go to the original fd 2, formatted as the root logger's are.
        self._handler = logging.StreamHandler(os.fdopen(os.dup(self._saved), "w", buffering=1))
        root = logging.getLogger()
        if root.handlers:
            self._handler.setFormatter(root.handlers[0].formatter)
        log.addHandler(self._handler)
        log.propagate = False
        self._thread = threading.Thread(target=self._pump, name="grpc-core-log", daemon=True)
        self._thread.start()

    def attach(
        self, loop: asyncio.AbstractEventLoop, rejections: RejectionLog, metrics: NodeMetrics
    ) -> None:
        """From now on failed handshakes are refused on ``loop``; earlier ones are replayed."""
        with self._lock:
            self._sink = (loop, rejections, metrics)
            early, self._early = list(self._early), collections.deque(maxlen=EARLY_MAX)
        for code in early:
            loop.call_soon_threadsafe(self._refuse, code)

    def close(self) -> None:
        """Put the original fd 2 back and forward what is still in the pipe."""
        os.dup2(self._saved, 2)
        self._thread.join(timeout=5.0)
        log.removeHandler(self._handler)
        log.propagate = True
        self._handler.close()
        self._handler.stream.close()
        os.close(self._saved)

    def _refuse(self, code: str) -> None:
        with self._lock:
            sink = self._sink
        if sink is None:
            return
        _loop, rejections, metrics = sink
        metrics.rejected.labels(TLS_REASON).inc()
        metrics.messages.labels("received", "request", "rejected").inc()
        rejections.record(TLS_PEER, TLS_REASON, describe(code))

    def _pump(self) -> None:
        buffer = b""
        while True:
            try:
                chunk = self._read.read(65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                self._route_or_pass(line)
        if buffer:
            self._route_or_pass(buffer)
        self._read.close()

    def _route_or_pass(self, line: bytes) -> None:
        """A line this reader cannot route still reaches the real fd 2: if the reader died,
        every later write to stderr would block once the pipe is full."""
        try:
            self._route(line)
        except Exception:
            with contextlib.suppress(OSError):
                os.write(self._saved, line + b"\n")

    def _route(self, line: bytes) -> None:
        match = CORE_LINE.match(line)
        if match is None:
            if line.startswith(ABSL_PREAMBLE):
                log.debug("%s", line.decode(errors="replace"))
                return
            with contextlib.suppress(OSError):
                os.write(self._saved, line + b"\n")
            return
        failed = HANDSHAKE_FAILED.search(match.group(3))
        if failed is None:
            text = f"{match.group(2).decode()}: {match.group(3).decode(errors='replace')}"
            log.log(LEVELS[match.group(1)], "grpc core: %s", text)
            return
        code = _reason(failed.group(1))
        with self._lock:
            sink = self._sink
            if sink is None:
                self._early.append(code)
                return
        with contextlib.suppress(RuntimeError):  # the loop has closed: shutting down
            sink[0].call_soon_threadsafe(self._refuse, code)
