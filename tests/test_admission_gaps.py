"""Three gaps in receiver-side admission, closed: against real daemons over real sockets.

1. A member sending max-size chunks just inside the idle timeout, above the
   minimum rate, held its push slot and reserved bytes as long as its push
   lasted; now the whole push has a deadline (``limits.max_push_s``).
2. The byte budget charged wire bytes, but fp16 and bf16 segments are decoded
   to a float copy that lives until the merge answers; now it charges both.
3. A pull cut off for not reading kept its slot until grpc ended the call (when
   its client went away); now the slot is freed at the cut, and the call itself
   dies with its connection (``limits.max_connection_age_s`` plus a grace).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import torch

from gossipd.node.compression import codecs as wirecodec
from gossipd.node.compression.codecs import Codec
from gossipd.node.errors import ConfigError
from gossipd.node.jobs.registry import JobSpec, build_job
from gossipd.node.model.segments import FlatModel, SegmentPlan, plan_segments
from gossipd.node.net.limits.admission import ByteBudget, held_bytes
from gossipd.node.net.serve.servicer import GossipServicer
from gossipd.node.net.wire.frames import Limits, SegmentAssembler
from gossipd.node.shared.config import NodeConfig
from gossipd.proto import gossip_pb2 as pb
from tests.conftest import DaemonHandle, check_alive, start_daemon, status_of, stop_all, wait_until
from tests.fakepeer import MESH, FakePeer, leave_as

# Three segments (head weight, bias, bulk) of at most 32 KiB: a push stream can carry
# twice the largest segment, so it can outlast what one largest segment needs.
DIM = 8192
SEGMENT_BYTES = 32768
JOB_OPTIONS = {"dim": DIM, "numel": 2 * DIM + 1, "samples": 16}
IDLE_S = 1.0
MIN_RATE = 8192.0  # bytes/s; one 32 KiB segment needs 1 s + 4 s at this rate
MAX_PUSH_S = 5.0  # exactly what the largest segment needs, the least allowed
CHUNK = 2048  # limits.max_chunk_bytes: every trickled chunk is max-size
TRICKLE_EVERY_S = 0.2  # 10 KiB/s: above MIN_RATE, each chunk well inside IDLE_S
FP16_HELD = SEGMENT_BYTES // 2 + SEGMENT_BYTES  # an fp16 float32 segment: wire + decoded
WAIT_S = 60.0
WEIGHT = 0.25  # per segment of each honest push: two stay under the default weight cap


def _plan() -> SegmentPlan:
    job = build_job(JobSpec("synthetic", learning_rate=0.0, options=JOB_OPTIONS))
    return FlatModel(job.model, SEGMENT_BYTES).plan


PLAN = _plan()
# A whole fp16 push holds every segment's wire and decoded bytes until the merge answers.
FP16_PUSH_HELD = sum(held_bytes(seg, Codec.FP16) for seg in PLAN.segments)


@pytest.fixture(scope="module")
def receiver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonHandle]:
    """A lone daemon with one push slot and a budget of exactly one whole fp16 push."""
    from gossipd.node.launch.localmesh import free_ports

    handle = start_daemon(
        tmp_path_factory.mktemp("receiver"),
        "receiver",
        free_ports(1)[0],
        job={"options": JOB_OPTIONS, "max_steps": 1},
        gossip={"segment_bytes": SEGMENT_BYTES},
        limits={
            "stream_idle_timeout_s": IDLE_S,
            "min_push_rate_bytes_s": MIN_RATE,
            "max_push_s": MAX_PUSH_S,
            "max_chunk_bytes": CHUNK,
            "max_inbound_pushes": 1,
            "max_pending_bytes": FP16_PUSH_HELD,
        },
    )
    try:
        yield handle
    finally:
        stop_all([handle])


@pytest.fixture(scope="module")
def member(receiver: DaemonHandle) -> Iterator[FakePeer]:
    """A fake site the receiver has verified (its own Handshake to the fake's address)."""
    fake = FakePeer("member", fingerprint=PLAN.fingerprint, serve_peers=True)
    try:
        fake.introduce_to(receiver.address)
        wait_until(
            lambda: "member" in status_of(receiver)["live_peers"],
            "the receiver to verify the member",
            WAIT_S,
            lambda: check_alive([receiver]),
        )
        yield fake
    finally:
        # Leave for real (refuse Handshakes, as a leaving node does, then say Leave) so the
        # receiver forgets the fake instead of handing its weight to it at exit.
        fake.refuse_handshakes = grpc.StatusCode.FAILED_PRECONDITION
        leave_as(receiver.address, fake.node_id, fake.incarnation)
        with contextlib.suppress(AssertionError):
            wait_until(
                lambda: fake.node_id not in status_of(receiver)["live_peers"],
                "the receiver to let the member go",
                20.0,
            )
        fake.close()


def _frames(
    member: FakePeer, sequence: int, codec: Codec, weight: float = WEIGHT
) -> list[tuple[bytes, list[bytes]]]:
    """Each segment of a whole push as (header frame, its payload cut into CHUNK pieces)."""
    out = []
    for seg in PLAN.segments:
        data = bytes(wirecodec.encode(torch.full((seg.numel,), 0.25), codec))
        header = pb.SegmentHeader(
            sender=member.node_id,
            segment=seg.index,
            sequence=sequence,
            sum_weight=weight,
            dtype=pb.DTYPE_FLOAT32,
            numel=seg.numel,
            codec=int(codec),
            payload_bytes=len(data),
            checksum=wirecodec.checksum(data),
        )
        chunks = [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)]
        out.append((pb.PushFrame(header=header).SerializeToString(), chunks))
    return out


def _open(member: FakePeer, sequence: int) -> bytes:
    opened = pb.PushOpen(
        mesh_id=MESH,
        sender=member.node_id,
        fingerprint=PLAN.fingerprint,
        sequence=sequence,
        segment_count=len(PLAN),
        incarnation=member.incarnation,
        sequence_base=1,
    )
    return pb.PushFrame(open=opened).SerializeToString()


async def _push(address: str, frames: AsyncIterator[bytes]) -> tuple[grpc.StatusCode, str]:
    async with grpc.aio.insecure_channel(address) as channel:
        rpc = channel.stream_unary(
            "/gossipd.v1.Gossip/PushSegments",
            request_serializer=lambda b: b,
            response_deserializer=pb.PushReply.FromString,
        )
        try:
            await rpc(frames, timeout=WAIT_S)
        except grpc.aio.AioRpcError as err:
            return err.code(), err.details() or ""
        return grpc.StatusCode.OK, ""


async def _whole(member: FakePeer, sequence: int, codec: Codec) -> AsyncIterator[bytes]:
    yield _open(member, sequence)
    for header, chunks in _frames(member, sequence, codec):
        yield header
        for chunk in chunks:
            yield pb.PushFrame(chunk=chunk).SerializeToString()


async def _trickle(member: FakePeer, sequence: int) -> AsyncIterator[bytes]:
    """The whole push, one max-size chunk every TRICKLE_EVERY_S: 6.4 s, past MAX_PUSH_S."""
    yield _open(member, sequence)
    for header, chunks in _frames(member, sequence, Codec.RAW):
        yield header
        for chunk in chunks:
            await asyncio.sleep(TRICKLE_EVERY_S)  # the attack's pace, not a wait for anything
            yield pb.PushFrame(chunk=chunk).SerializeToString()


def _weights(receiver: DaemonHandle) -> list[float]:
    return list(status_of(receiver)["sum_weights"])


def test_a_trickle_above_the_minimum_rate_is_ended_at_the_whole_push_deadline(
    receiver: DaemonHandle, member: FakePeer
) -> None:
    """Frame by frame the trickle is fast enough; at limits.max_push_s it is ended, counted,
    its slot and bytes are free for the next push, and it merged nothing."""
    before = _weights(receiver)
    refused = status_of(receiver)["rejected"].get("PushTooLong", 0)
    code, details = asyncio.run(_push(receiver.address, _trickle(member, 1)))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED, (code, details)
    assert "limits.max_push_s" in details and "released" in details, details
    status = status_of(receiver)
    assert status["rejected"].get("PushTooLong", 0) == refused + 1, status["rejected"]
    assert status["sum_weights"] == before, (status["sum_weights"], before)
    # One push slot, and a budget below two raw pushes: this one fits only if the trickle's
    # slot and bytes were released.
    code, details = asyncio.run(_push(receiver.address, _whole(member, 2, Codec.RAW)))
    assert code == grpc.StatusCode.OK, (code, details)
    after = _weights(receiver)
    assert after == pytest.approx([w + WEIGHT for w in before], abs=1e-9), (after, before)


def test_an_fp16_push_is_charged_its_decoded_copy_and_merges_within_a_budget_of_exactly_that(
    receiver: DaemonHandle, member: FakePeer
) -> None:
    """limits.max_pending_bytes is exactly one fp16 push's wire and decoded bytes: the push
    merges whole (its sum of weights arrives, nothing lost)."""
    before = _weights(receiver)
    code, details = asyncio.run(_push(receiver.address, _whole(member, 3, Codec.FP16)))
    assert code == grpc.StatusCode.OK, (code, details)
    after = _weights(receiver)
    assert after == pytest.approx([w + WEIGHT for w in before], abs=1e-9), (after, before)


def test_the_reservation_is_wire_bytes_plus_the_decoded_copy_and_a_view_costs_nothing() -> None:
    float32 = PLAN.segments[0]
    half = plan_segments([("w", torch.zeros(1000, dtype=torch.float16))]).segments[0]
    expected = {
        (float32, Codec.RAW): 4 * float32.numel,
        (float32, Codec.FP16): 2 * float32.numel + 4 * float32.numel,
        (float32, Codec.BF16): 2 * float32.numel + 4 * float32.numel,
        (half, Codec.FP16): 2 * 1000,  # decoded as a view of the buffer
        (half, Codec.BF16): 2 * 1000 + 2 * 1000,
    }
    for (seg, codec), nbytes in expected.items():
        assert held_bytes(seg, codec) == nbytes, (seg.dtype, codec)
    budget = ByteBudget(FP16_HELD, "limits.max_pending_bytes")
    data = bytes(wirecodec.encode(torch.zeros(float32.numel), Codec.FP16))
    header = pb.SegmentHeader(
        sender="s",
        segment=0,
        sequence=1,
        sum_weight=1.0,
        dtype=pb.DTYPE_FLOAT32,
        numel=float32.numel,
        codec=pb.CODEC_FP16,
        payload_bytes=len(data),
        checksum=wirecodec.checksum(data),
    )
    with budget.hold() as held:
        SegmentAssembler(PLAN, Limits(), held.reserve).header(header)
        assert held.nbytes == budget.in_use == FP16_HELD
    assert budget.in_use == 0


def _servicer(**limits: Any) -> GossipServicer:
    config = NodeConfig(mesh_id=MESH, node_id="tight", limits=limits, tls={"insecure": True})
    node = SimpleNamespace(config=config, new_assembler=lambda: SegmentAssembler(PLAN, Limits()))
    return GossipServicer(node)  # type: ignore[arg-type]


def test_a_budget_that_holds_the_wire_bytes_but_not_the_decoded_copy_refuses_to_start() -> None:
    with pytest.raises(
        ConfigError, match=rf"raise limits\.max_pending_bytes to at least {FP16_HELD}"
    ):
        _servicer(max_pending_bytes=FP16_HELD - 1)


def test_a_push_deadline_below_what_the_largest_segment_needs_refuses_to_start() -> None:
    """5 s is what a 32 KiB segment needs at 8 KiB/s after a free first second."""
    limits = {"stream_idle_timeout_s": IDLE_S, "min_push_rate_bytes_s": MIN_RATE}
    with pytest.raises(ConfigError, match=r"limits\.max_push_s = 4\.9 is below the 5 s"):
        _servicer(**limits, max_push_s=4.9)


# -- 3. a pull cut off for not reading ------------------------------------------------------

PULL_NUMEL = 4 << 20  # 16 MiB of float32: far more than grpc buffers for a reader that stops
PULL_LIMITS = {
    "max_inbound_pulls": 1,
    "stream_idle_timeout_s": IDLE_S,
    "min_push_rate_bytes_s": float(16 << 20),  # push deadline: 1 s + 16 MiB at 16 MiB/s = 2 s
    "merge_wait_s": 1.0,
    "max_connection_age_s": 3.0,  # a connection's calls then live at most 3 s (±10%) + 3 s
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonHandle]:
    """A lone daemon serving one pull at a time, whose connections age in seconds."""
    from gossipd.node.launch.localmesh import free_ports

    handle = start_daemon(
        tmp_path_factory.mktemp("server"),
        "server",
        free_ports(1)[0],
        job={"options": {"numel": PULL_NUMEL}, "max_steps": 1},
        gossip={"push_timeout_s": 2.0},
        limits=PULL_LIMITS,
    )
    try:
        yield handle
    finally:
        stop_all([handle])


def _pull_rpc(channel: grpc.aio.Channel) -> Callable[..., Any]:
    return channel.unary_stream(
        "/gossipd.v1.Gossip/PullModel",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=pb.PullFrame.FromString,
    )


def _pull_request(requester: str) -> pb.PullRequest:
    fingerprint = FlatModel(
        build_job(JobSpec("synthetic", learning_rate=0.0, options={"numel": PULL_NUMEL})).model
    ).plan.fingerprint
    return pb.PullRequest(
        mesh_id=MESH, requester=requester, fingerprint=fingerprint, codec=pb.CODEC_RAW
    )


async def _pulled_bytes(channel: grpc.aio.Channel, request: pb.PullRequest) -> int:
    """Payload bytes of one whole pull read to its end (it raises if refused)."""
    total = 0
    async for frame in _pull_rpc(channel)(request, timeout=WAIT_S):
        total += len(frame.chunk)
    return total


async def _until(check: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    """Poll a blocking ``check`` (off the loop) until it holds, or fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(check):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


def test_a_pull_cut_off_for_not_reading_frees_its_slot_at_once_and_aged_connections_reconnect(
    server: DaemonHandle,
) -> None:
    """With limits.max_inbound_pulls = 1, a second reader is served right after the cut,
    while the stalled call is still open; and a channel whose connection passed
    limits.max_connection_age_s (GOAWAY) pulls again as usual."""
    model_bytes = 4 * PULL_NUMEL

    cut = status_of(server)["rejected"].get("StreamIdle", 0)

    async def scenario() -> None:
        async with (
            grpc.aio.insecure_channel(server.address) as stalled_channel,
            grpc.aio.insecure_channel(server.address) as reader_channel,
        ):
            stalled = _pull_rpc(stalled_channel)(_pull_request("stalled"), timeout=5 * WAIT_S)
            await _until(
                lambda: status_of(server)["rejected"].get("StreamIdle", 0) > cut,
                "the server to cut the stalled pull off",
            )
            assert await _pulled_bytes(reader_channel, _pull_request("reader")) == model_bytes
            assert not stalled.done(), "the stalled client's call ended before the check"
            # Its connection reaches limits.max_connection_age_s (GOAWAY); the channel
            # reconnects by itself for the next call.
            async with asyncio.timeout(WAIT_S):
                while reader_channel.get_state() == grpc.ChannelConnectivity.READY:
                    await reader_channel.wait_for_state_change(grpc.ChannelConnectivity.READY)
            assert await _pulled_bytes(reader_channel, _pull_request("reader")) == model_bytes
            stalled.cancel()

    asyncio.run(scenario())
    assert server.proc.poll() is None, server.log()
