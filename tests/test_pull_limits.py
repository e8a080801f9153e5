"""What a member that pulls from a daemon may hold: pulls per peer, and how slowly one is read.

A pull's reply holds a slot of ``limits.max_inbound_pulls`` and a whole snapshot of the
model until its last byte is written. The idle timeout alone let a member that reads
a little inside every ``limits.stream_idle_timeout_s`` hold both for as long as it
liked, and take every slot with a few such pulls, so nobody else could pull (the
overlap protocol averages by pulls). Now one peer holds at most
``limits.max_inbound_pulls_per_peer`` pulls, and a reply still being read after the
first idle interval plus its bytes at ``limits.min_pull_rate_bytes_s`` is cut off
(``PullTooSlow``, DEADLINE_EXCEEDED, counted), its slots freed and its lane connection
closed, while others pull as before. A reader that takes nothing at all is cut off
after one idle interval (``StreamIdle``). Pulls move no weight: the daemon's sum of
weights is the same before and after each.

One plaintext daemon with a 32 MiB model, so that a reply does not fit in loopback's
socket buffers: a reader that takes 1 MiB every half second reads at 2 MiB/s, a
quarter of the 8 MiB/s floor set here, each piece well inside the 4 s idle timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest

from gossipd.node.launch.localmesh import free_ports
from gossipd.node.net.bulk.lane import MAGIC
from gossipd.node.shared.tls import Credentials
from gossipd.proto import gossip_pb2 as pb
from tests.conftest import DaemonHandle, scrape_metrics, start_daemon, wait_until
from tests.fakepeer import MESH, FakePeer, handshake_tls, synthetic_plan

NUMEL = 8 << 20  # float32: one segment of 32 MiB
PLAN = synthetic_plan(numel=NUMEL)
MODEL_BYTES = NUMEL * 4
IDLE_S = 4.0
MIN_RATE = 8 << 20  # bytes/s: the reply may take IDLE_S + 4 s
ALLOWED_S = IDLE_S + MODEL_BYTES / MIN_RATE
PIECE, EVERY_S = 1 << 20, 0.5  # the slow reader's pace: 2 MiB/s
PULL_MODEL = "/gossipd.v1.Gossip/PullModel"
SLOW, OTHER = "slow-reader", "other-reader"


@dataclass
class Served:
    handle: DaemonHandle
    lane_port: int


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("pull-limits")
    [port] = free_ports(1)
    handle = start_daemon(
        root,
        "served",
        port,
        job={"options": {"numel": NUMEL}, "max_steps": 1},  # then idle: serves pulls only
        limits={
            "stream_idle_timeout_s": IDLE_S,
            "min_pull_rate_bytes_s": MIN_RATE,
            "max_inbound_pulls": 2,
            "max_inbound_pulls_per_peer": 1,
        },
    )
    try:
        with FakePeer("pull-limits-asker", fingerprint=PLAN.fingerprint) as asker:
            code, reply, details = handshake_tls(
                Credentials(insecure=True),
                handle.address,
                asker.info(),
                fingerprint=PLAN.fingerprint,
            )
        assert code == grpc.StatusCode.OK and reply is not None and reply.bulk_port, details
        yield Served(handle, reply.bulk_port)
    finally:
        assert handle.stop() == 0, handle.log()[-3000:]


@dataclass
class PullResult:
    code: grpc.StatusCode
    details: str
    payload_bytes: int  # what came in chunk frames
    took_s: float  # from the first frame to the end of the call


async def _pull(
    served: Served, requester: str, token: bytes = b"", first: asyncio.Event | None = None
) -> PullResult:
    """One PullModel call as ``requester`` (naming the lane connection ``token``, if any);
    ``first`` is set when its first frame arrives (the daemon holds its slots by then)."""
    request = pb.PullRequest(
        mesh_id=MESH,
        requester=requester,
        fingerprint=PLAN.fingerprint,
        codec=pb.CODEC_RAW,
        bulk_token=token,
    )
    payload, started = 0, None
    async with grpc.aio.insecure_channel(served.handle.address) as channel:
        rpc = channel.unary_stream(
            PULL_MODEL,
            request_serializer=pb.PullRequest.SerializeToString,
            response_deserializer=pb.PullFrame.FromString,
        )
        try:
            async for frame in rpc(request, timeout=60.0):
                if started is None:
                    started = time.monotonic()
                    if first is not None:
                        first.set()
                payload += len(frame.chunk)
        except grpc.aio.AioRpcError as err:
            took = time.monotonic() - (started or time.monotonic())
            return PullResult(err.code(), err.details() or "", payload, took)
    return PullResult(grpc.StatusCode.OK, "", payload, time.monotonic() - (started or 0.0))


def _lane(served: Served, token: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", served.lane_port), timeout=30.0)
    sock.sendall(MAGIC + token)
    return sock


def _read_slowly(sock: socket.socket, got: list[int], done: threading.Event) -> None:
    """Take ``PIECE`` bytes every ``EVERY_S`` until the daemon closes the connection."""
    while True:
        piece = 0
        while piece < PIECE:
            try:
                n = len(sock.recv(PIECE - piece))
            except OSError:  # reset
                n = 0
            if not n:
                done.set()
                return
            piece += n
            got[0] += n
        time.sleep(EVERY_S)  # the reader's pace, not a wait for the daemon


def _serving(handle: DaemonHandle) -> float:
    """The daemon's gauge of the pulls it serves now."""
    return scrape_metrics(handle.node_json()["metrics_port"])["gossipd_inbound_pull_streams"]


def _rejected(handle: DaemonHandle, reason: str) -> int:
    return handle.status()["rejected"].get(reason, 0)


def test_a_pull_read_below_the_minimum_rate_is_cut_off_and_one_peer_holds_one_pull(
    served: Served,
) -> None:
    handle = served.handle
    weights, cut = handle.status()["sum_weights"], _rejected(handle, "PullTooSlow")
    over_cap = _rejected(handle, "TooManyStreams")
    token = b"pull-limits-0001"
    sock = _lane(served, token)
    got, closed = [0], threading.Event()
    reader = threading.Thread(target=_read_slowly, args=(sock, got, closed), daemon=True)
    reader.start()

    async def scenario() -> tuple[PullResult, PullResult, PullResult]:
        first = asyncio.Event()
        slow = asyncio.create_task(_pull(served, SLOW, token, first))
        await asyncio.wait_for(first.wait(), 30.0)
        assert await asyncio.to_thread(_serving, handle) == 1
        # While the slow pull holds SLOW's one slot: its second is refused at once,
        # another peer's pull (the other slot) goes through whole.
        again = await _pull(served, SLOW)
        other = await _pull(served, OTHER)
        return await slow, again, other

    try:
        slow, again, other = asyncio.run(scenario())
        assert closed.wait(IDLE_S + 10), "the slow pull's lane connection is still open"
    finally:
        sock.close()
        reader.join(timeout=30)

    assert again.code == grpc.StatusCode.RESOURCE_EXHAUSTED, again
    assert "limits.max_inbound_pulls_per_peer = 1" in again.details, again
    assert other.code == grpc.StatusCode.OK and other.payload_bytes == MODEL_BYTES, other

    assert slow.code == grpc.StatusCode.DEADLINE_EXCEEDED, slow
    assert "limits.min_pull_rate_bytes_s" in slow.details and "cut off" in slow.details, slow
    assert ALLOWED_S * 0.9 <= slow.took_s < ALLOWED_S + 10, slow
    assert got[0] < MODEL_BYTES, f"the slow reader got the whole model ({got[0]} bytes)"
    wait_until(lambda: _rejected(handle, "PullTooSlow") == cut + 1, "the cut-off pull counted", 10)
    assert _rejected(handle, "TooManyStreams") == over_cap + 1
    wait_until(lambda: _serving(handle) == 0, "no pull served any more", 10)

    # Its slot was freed with it: the same peer pulls again, whole.
    after = asyncio.run(_pull(served, SLOW))
    assert after.code == grpc.StatusCode.OK and after.payload_bytes == MODEL_BYTES, after
    assert handle.status()["sum_weights"] == weights


def test_a_pull_whose_lane_is_never_read_ends_at_the_idle_timeout_and_frees_its_slot(
    served: Served,
) -> None:
    """Nothing read at all: the write that fills the socket buffers waits one idle interval."""
    handle = served.handle
    weights, idled = handle.status()["sum_weights"], _rejected(handle, "StreamIdle")
    with _lane(served, b"pull-limits-0002") as sock:
        stalled = asyncio.run(_pull(served, SLOW, b"pull-limits-0002"))

        assert stalled.code == grpc.StatusCode.DEADLINE_EXCEEDED, stalled
        assert "limits.stream_idle_timeout_s" in stalled.details, stalled
        assert stalled.took_s < IDLE_S + 10, stalled
        sock.settimeout(IDLE_S + 10)
        got = 0
        with contextlib.suppress(ConnectionResetError):
            while data := sock.recv(1 << 20):  # what the buffers held, then the close
                got += len(data)
        assert got < MODEL_BYTES, f"the lane carried the whole model ({got} bytes)"
    wait_until(lambda: _rejected(handle, "StreamIdle") == idled + 1, "the stall counted", 10)
    after = asyncio.run(_pull(served, SLOW))
    assert after.code == grpc.StatusCode.OK and after.payload_bytes == MODEL_BYTES, after
    assert handle.status()["sum_weights"] == weights
