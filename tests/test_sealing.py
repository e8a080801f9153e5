"""Sealed bulk-lane records (``node/net/bulk/sealing.py``) on real socket pairs.

What it protects. Bytes sealed by one end come out of the other exactly, whatever
pieces the reader asks for; and every way a peer or the path can spoil the stream —
a flipped bit in a record or in its length, a record replayed or dropped, a length
out of bounds, a stream cut short, keys from another connection — is refused with a
clear error before the reader hands on a byte of that record, and a direction that
has carried its limit stops.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from gossipd.node.errors import BulkClosed, InvalidFrame
from gossipd.node.net.bulk import sealing
from gossipd.node.net.bulk.sealing import LENGTH, RECORD_BYTES, TAG_BYTES, Seal, new_seed

TOKEN = b"sealing-test-tok"
TIMEOUT_S = 10.0  # every read here is bounded: a bug shows as a timeout, not a hang


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    for s in (a, b):
        s.settimeout(TIMEOUT_S)
    with a, b:
        yield a, b


def _seals(token: bytes = TOKEN) -> tuple[Seal, Seal]:
    dialer_seed, server_seed = new_seed(), new_seed()
    return (
        Seal.derive(dialer_seed, server_seed, token, dialer=True),
        Seal.derive(dialer_seed, server_seed, token, dialer=False),
    )


def _payload(nbytes: int, seed: int = 0) -> bytes:
    return bytes((i * 131 + seed) % 251 for i in range(nbytes))


def sealed_bytes(seal: Seal, data: bytes) -> bytes:
    """What ``seal`` writes for ``data``: the records as they go on the wire."""
    a, b = socket.socketpair()
    with a, b:
        out = bytearray()
        reader = threading.Thread(target=lambda: _drain(b, out))
        reader.start()
        seal.send(a, memoryview(data))
        a.shutdown(socket.SHUT_WR)
        reader.join(TIMEOUT_S)
        assert not reader.is_alive()
    return bytes(out)


def _drain(sock: socket.socket, out: bytearray) -> None:
    while chunk := sock.recv(1 << 20):
        out += chunk


def _receive(seal: Seal, sock: socket.socket, sizes: list[int]) -> bytes:
    got = bytearray()
    for size in sizes:
        buf = bytearray(size)
        seal.recv(sock, memoryview(buf))
        got += buf
    return bytes(got)


def _send_in_thread(sock: socket.socket, data: bytes) -> threading.Thread:
    sender = threading.Thread(target=sock.sendall, args=(data,))
    sender.start()
    return sender


@pytest.mark.parametrize(
    "sizes",
    [
        [2 * RECORD_BYTES + 12345],  # straight into the reader's buffer
        [1000, RECORD_BYTES, 77, RECORD_BYTES + 12345 - 1077],  # spills
        [1] * 5 + [2 * RECORD_BYTES + 12340],
    ],
    ids=["one read", "reads across records", "tiny reads first"],
)
def test_what_one_end_seals_the_other_reads_exactly_in_any_pieces(
    pair: tuple[socket.socket, socket.socket], sizes: list[int]
) -> None:
    dialer, server = _seals()
    data = _payload(2 * RECORD_BYTES + 12345)
    assert sum(sizes) == len(data)
    wire = sealed_bytes(dialer, data)
    assert len(wire) == len(data) + 3 * (LENGTH.size + TAG_BYTES)
    assert data[:4096] not in wire, "the payload travels in the clear"
    sender = _send_in_thread(pair[0], wire)
    assert _receive(server, pair[1], sizes) == data
    sender.join(TIMEOUT_S)
    assert dialer.sent == server.received == len(data)


def test_each_direction_has_its_own_key_and_counter(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    dialer, server = _seals()
    one, two = _payload(5000, 1), _payload(7000, 2)
    pair[1].sendall(sealed_bytes(server, one))
    assert _receive(dialer, pair[0], [len(one)]) == one
    pair[0].sendall(sealed_bytes(dialer, two))
    assert _receive(server, pair[1], [len(two)]) == two
    # A record sealed for one direction does not open in the other.
    pair[0].sendall(sealed_bytes(dialer, one))
    with pytest.raises(InvalidFrame, match="failed authentication"):
        _receive(dialer, pair[1], [len(one)])


def test_keys_from_another_connection_do_not_open_its_records(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    dialer, _ = _seals(TOKEN)
    _, stranger = _seals(b"another-token-00")
    data = _payload(3000)
    pair[0].sendall(sealed_bytes(dialer, data))
    with pytest.raises(InvalidFrame, match="failed authentication"):
        _receive(stranger, pair[1], [len(data)])


@pytest.mark.parametrize("where", ["ciphertext", "tag", "length"])
def test_a_flipped_bit_anywhere_in_a_record_is_refused(
    pair: tuple[socket.socket, socket.socket], where: str
) -> None:
    dialer, server = _seals()
    data = _payload(4097)  # the length's low bit flipped asks for a byte less, not more
    wire = bytearray(sealed_bytes(dialer, data))
    at = {"ciphertext": LENGTH.size + 100, "tag": len(wire) - 1, "length": LENGTH.size - 1}[where]
    wire[at] ^= 0x01
    pair[0].sendall(wire)
    buf = bytearray(len(data))
    with pytest.raises(InvalidFrame, match="failed authentication"):
        server.recv(pair[1], memoryview(buf))
    assert server.received == 0


def test_a_replayed_or_dropped_record_is_refused(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    dialer, server = _seals()
    first = sealed_bytes(dialer, _payload(1000, 1))
    pair[0].sendall(first)
    assert _receive(server, pair[1], [1000]) == _payload(1000, 1)
    pair[0].sendall(first)  # replayed: its counter is behind
    with pytest.raises(InvalidFrame, match="failed authentication"):
        _receive(server, pair[1], [1000])
    dialer2, server2 = _seals()
    sealed_bytes(dialer2, _payload(10, 3))  # sealed and dropped on the way
    pair[0].sendall(sealed_bytes(dialer2, _payload(1000, 4)))
    with pytest.raises(InvalidFrame, match="failed authentication"):
        _receive(server2, pair[1], [1000])


@pytest.mark.parametrize("length", [0, RECORD_BYTES + 1, 2**32 - 1])
def test_a_record_length_out_of_bounds_is_refused_before_its_body_is_read(
    pair: tuple[socket.socket, socket.socket], length: int
) -> None:
    """Only the length is sent: the reader must refuse it without waiting for more."""
    _, server = _seals()
    pair[0].sendall(LENGTH.pack(length))
    with pytest.raises(InvalidFrame, match=f"says {length} bytes"):
        server.recv(pair[1], memoryview(bytearray(100)))


def test_a_stream_cut_inside_a_record_is_a_closed_lane(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    dialer, server = _seals()
    wire = sealed_bytes(dialer, _payload(5000))
    pair[0].sendall(wire[:-10])
    pair[0].shutdown(socket.SHUT_WR)
    with pytest.raises(BulkClosed, match="inside a sealed record"):
        server.recv(pair[1], memoryview(bytearray(5000)))


def test_a_direction_stops_at_its_limit_and_a_dialer_retires_it_at_half(
    pair: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sealing, "MAX_SEALED_BYTES", 10_000)
    dialer, server = _seals()
    assert not dialer.worn
    pair[0].sendall(sealed_bytes(dialer, _payload(6000)))
    assert dialer.worn, "past half of the limit: not to be reused"
    assert _receive(server, pair[1], [6000]) == _payload(6000)
    with pytest.raises(BulkClosed, match="carried its limit"):
        dialer.send(pair[0], memoryview(_payload(5000)))
    # A peer that seals past the limit anyway (a fresh seal of the same keys would) is refused.
    server.received = 9_000
    cheat, _ = _seals()
    cheat._send, cheat._send_count = dialer._send, dialer._send_count
    pair[0].sendall(sealed_bytes(cheat, _payload(2000)))
    with pytest.raises(InvalidFrame, match="more than 10000 bytes"):
        server.recv(pair[1], memoryview(bytearray(2000)))
