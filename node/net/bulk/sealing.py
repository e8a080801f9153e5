"""Sealed bulk-lane records: AES-128-GCM over the lane's TCP socket, keyed inside TLS.

Python's ``ssl`` hands a TLS stream over one 16 KiB record per ``recv`` call, decrypts
into its own buffer and copies out, and the system OpenSSL (3.0 here) runs AES-GCM at
about 4.5 GB/s a core; a 256 MiB push over a TLS lane cost about twice the CPU of the
same push in plaintext. ``cryptography``'s AES-GCM (its own OpenSSL, with the VAES
code where the CPU has it) runs at about 12 GB/s a core on the same machine, and
``decrypt_into`` writes straight into the segment's buffer. So a lane connection uses
TLS 1.3 for what TLS is for — both certificates, the peer's node id, and a secret
exchange — and then carries its payloads in records of its own:

* **Keys.** The dialer's hello (inside TLS) carries 32 random bytes, the server's
  reply (inside TLS) 32 more. HKDF-SHA256 over both, bound to the connection's token,
  gives one AES-128 key per direction. Nobody outside the mutually authenticated TLS
  session sees either seed, so only the two certified peers hold the keys, and every
  connection's keys are fresh.
* **Records.** A 4-byte big-endian plaintext length (1 .. ``RECORD_BYTES``), then the
  ciphertext and its 16-byte tag. The length is the associated data; the nonce is the
  direction's record counter (never sent, never reused under a key). A record altered,
  dropped, reordered or replayed fails its tag, and the connection is closed: what
  follows on it can no longer be trusted. One cut short never completes: the peer's
  close ends the read, or the lane's idle timeout does.
* **Limits.** A direction carries at most ``MAX_SEALED_BYTES`` (64 GiB: AES-GCM's
  confidentiality bound stays below 2^-64 there); a dialer stops reusing a connection
  at half of that, and a record past it is refused. A record's length is checked
  before a byte of it is read.

The segment checksum is then redundant on a sealed payload (the tags authenticate
every byte as the peer sent it), so the receiver skips it.
"""

from __future__ import annotations

import os
import socket
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from gossipd.node.errors import BulkClosed, InvalidFrame

SEED_BYTES = 32  # each side's share of the key material
KEY_BYTES = 16  # AES-128
TAG_BYTES = 16
RECORD_BYTES = 1 << 20  # most plaintext per record: the staging buffer stays in the L2 cache
MAX_SEALED_BYTES = 1 << 36  # most bytes one direction of a connection carries
LENGTH = struct.Struct(">I")
INFO = b"gossipd bulk lane v2 "  # HKDF's context: these keys are for nothing else


def new_seed() -> bytes:
    return os.urandom(SEED_BYTES)


def _nonce(counter: int) -> bytes:
    return b"\0\0\0\0" + counter.to_bytes(8, "big")


def recv_exact(sock: socket.socket, view: memoryview, what: str) -> None:
    """Fill ``view`` from ``sock`` (blocking, within its timeout); BulkClosed at EOF,
    saying the peer closed ``what`` after how many of its bytes."""
    got, size = 0, len(view)
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise BulkClosed(f"the peer closed the bulk lane inside {what} ({got}/{size} bytes)")
        got += n


class Seal:
    """One connection's two directions of sealed records. A direction is used by one
    thread at a time (a connection carries one push or pull at a time)."""

    def __init__(self, send_key: bytes, recv_key: bytes) -> None:
        self._send, self._recv = AESGCM(send_key), AESGCM(recv_key)
        self.sent = self.received = 0  # plaintext bytes, each direction
        self._send_count = self._recv_count = 0  # records: the nonces
        self._out: bytearray | None = None  # a record being written
        self._in: bytearray | None = None  # a record's ciphertext being read
        self._spill: memoryview | None = None  # plaintext of a record the reader asked part of

    @classmethod
    def derive(cls, dialer_seed: bytes, server_seed: bytes, token: bytes, *, dialer: bool) -> Seal:
        """The keys both ends derive from the two seeds they exchanged inside TLS."""
        keys = HKDF(
            algorithm=hashes.SHA256(), length=2 * KEY_BYTES, salt=None, info=INFO + token
        ).derive(dialer_seed + server_seed)
        outbound, inbound = keys[:KEY_BYTES], keys[KEY_BYTES:]  # the dialer's view
        return cls(outbound, inbound) if dialer else cls(inbound, outbound)

    @property
    def worn(self) -> bool:
        """Past half of what a direction may carry: dial a fresh connection instead."""
        return max(self.sent, self.received) > MAX_SEALED_BYTES // 2

    def send(self, sock: socket.socket, view: memoryview) -> None:
        """Seal ``view`` into records and write them whole."""
        if self.sent + len(view) > MAX_SEALED_BYTES:
            raise BulkClosed("this bulk-lane connection has carried its limit; dial a new one")
        if self._out is None:
            self._out = bytearray(LENGTH.size + RECORD_BYTES + TAG_BYTES)
        out = memoryview(self._out)
        for start in range(0, len(view), RECORD_BYTES):
            piece = view[start : start + RECORD_BYTES]
            n = len(piece)
            LENGTH.pack_into(out, 0, n)
            sealed = out[LENGTH.size :][: n + TAG_BYTES]
            self._send.encrypt_into(_nonce(self._send_count), piece, out[: LENGTH.size], sealed)
            self._send_count += 1
            sock.sendall(out[: LENGTH.size + n + TAG_BYTES])
            self.sent += n

    def recv(self, sock: socket.socket, view: memoryview) -> None:
        """Fill ``view`` with the next plaintext: records decrypt straight into it; the
        rest of a record longer than ``view`` asks for is kept for the next call."""
        got, size = 0, len(view)
        while got < size:
            if self._spill is not None:
                n = min(len(self._spill), size - got)
                view[got : got + n] = self._spill[:n]
                self._spill = self._spill[n:] if n < len(self._spill) else None
                got += n
                continue
            if self._in is None:
                self._in = bytearray(LENGTH.size + RECORD_BYTES + TAG_BYTES)
            record = memoryview(self._in)
            recv_exact(sock, record[: LENGTH.size], "a sealed record")
            (n,) = LENGTH.unpack_from(record)
            if not 0 < n <= RECORD_BYTES:
                raise InvalidFrame(
                    f"a sealed bulk-lane record says {n} bytes; records carry 1 to {RECORD_BYTES}"
                )
            if self.received + n > MAX_SEALED_BYTES:
                raise InvalidFrame(
                    f"the peer sealed more than {MAX_SEALED_BYTES} bytes on one bulk-lane "
                    "connection; it must dial a new one"
                )
            body = record[LENGTH.size :][: n + TAG_BYTES]
            recv_exact(sock, body, "a sealed record")
            into = view[got : got + n] if n <= size - got else memoryview(bytearray(n))
            try:
                self._recv.decrypt_into(_nonce(self._recv_count), body, record[: LENGTH.size], into)
            except InvalidTag:
                raise InvalidFrame(
                    "a sealed bulk-lane record failed authentication (bytes altered, "
                    "dropped, reordered or replayed on the way); the connection is closed"
                ) from None
            self._recv_count += 1
            self.received += n
            if n <= size - got:
                got += n
            else:
                self._spill = into
