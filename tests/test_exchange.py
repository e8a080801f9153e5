"""The long-lived push stream (``Exchange``) on a real daemon, driven frame by frame.

Pushes follow each other on one stream, each answered in order with what
``PushSegments`` answers; a refused push ends the stream with the same status;
a stream idle between pushes is ended (OK) and holds nothing; streams per peer
are capped; a push stalled mid-stream is ended by the idle timeout. The receiver's
sum-weight is checked after each: it moves by exactly what was merged.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
import torch

from gossipd.node.errors import GossipdError, MeshMismatch
from gossipd.node.launch.localmesh import free_ports
from gossipd.node.net.dial import push as pushsender
from gossipd.node.net.dial.client import Identity, OutcomeUnknown, PeerClient
from gossipd.node.net.wire.shaping import LinkShaper
from gossipd.node.protocols.base import Push
from gossipd.node.shared.tls import Credentials
from gossipd.node.trainer.messages import Ack, OutboundPush
from gossipd.proto import gossip_pb2 as pb
from tests.conftest import DaemonHandle, start_daemon, wait_until
from tests.fakepeer import FakePeer, push_frames, synthetic_plan

SENDER = "streamer"
INCARNATION = 7
IDLE_S = 1.0
STREAMS_PER_PEER = 3
END = pb.PushFrame(end=pb.PushEnd()).SerializeToString()
PLAN = synthetic_plan()


@pytest.fixture(scope="module")
def sender() -> Iterator[FakePeer]:
    with FakePeer(SENDER, incarnation=INCARNATION, serve_peers=True) as fake:
        yield fake


@pytest.fixture(scope="module")
def receiver(sender: FakePeer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonHandle]:
    handle = start_daemon(
        tmp_path_factory.mktemp("receiver"),
        "receiver",
        free_ports(1)[0],
        limits={
            "stream_idle_timeout_s": IDLE_S,
            "max_inbound_pushes_per_peer": STREAMS_PER_PEER,
            # The fake sender brings weight it never took, push after push: more than a
            # peer's credit (limits.peer_credit) allows. These tests are about the stream.
            "peer_credit": 1e9,
        },
    )
    sender.introduce_to(handle.address)
    wait_until(lambda: SENDER in handle.status()["live_peers"], "the receiver to verify us", 30)
    yield handle
    assert handle.stop() == 0, handle.log()


_sequence = iter(range(2, 1_000_000))


def _push(weight: float = 0.25, sequence: int | None = None, **fields: Any) -> list[bytes]:
    values = torch.full((PLAN.segments[0].numel,), 0.5)
    return [
        *push_frames(
            sender=SENDER,
            incarnation=INCARNATION,
            sequence=sequence if sequence is not None else next(_sequence),
            weight=weight,
            values=values,
            **fields,
        ),
        END,
    ]


def _weight(handle: DaemonHandle) -> float:
    return handle.status()["sum_weights"][0]


def _open_stream(channel: grpc.aio.Channel) -> tuple[Any, asyncio.Queue[bytes | None]]:
    """An Exchange call fed from a queue, as the daemon's own client feeds it: grpc's
    request consumer keeps the receiver's status when the receiver ends the call."""
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[bytes]:
        while (frame := await queue.get()) is not None:
            yield frame

    call = channel.stream_stream(
        "/gossipd.v1.Gossip/Exchange",
        request_serializer=None,
        response_deserializer=pb.PushReply.FromString,
    )(requests())
    return call, queue


async def _exchange(
    address: str, pushes: list[list[bytes]]
) -> list[pb.PushReply | grpc.StatusCode]:
    """Every push on one stream, one after another; a failure ends the list with its code."""
    async with grpc.aio.insecure_channel(address) as channel:
        call, queue = _open_stream(channel)
        answers: list[pb.PushReply | grpc.StatusCode] = []
        try:
            for frames in pushes:
                for frame in frames:
                    queue.put_nowait(frame)
                reply = await asyncio.wait_for(call.read(), 30)
                assert reply is not grpc.aio.EOF, "the stream ended without an answer"
                answers.append(reply)
        except grpc.aio.AioRpcError as err:
            answers.append(err.code())
        finally:
            call.cancel()
        return answers


def _batch(frames: list[bytes]) -> list[bytes]:
    return [pb.PushFrame(batch=pb.FrameBatch(frames=frames)).SerializeToString()]


def _results(reply: pb.PushReply | grpc.StatusCode) -> list[int]:
    assert isinstance(reply, pb.PushReply), reply
    return [a.result for a in reply.acks]


def test_pushes_follow_each_other_on_one_stream_each_answered_in_order(
    receiver: DaemonHandle,
) -> None:
    before = _weight(receiver)
    first, second = _push(), _push()
    retry = first[:]  # the same sequence again: a lost acknowledgement's retry
    answers = asyncio.run(_exchange(receiver.address, [first, second, retry]))
    assert [_results(a) for a in answers] == [
        [pb.SEGMENT_RESULT_MERGED],
        [pb.SEGMENT_RESULT_MERGED],
        [pb.SEGMENT_RESULT_DUPLICATE],
    ]
    assert _weight(receiver) == pytest.approx(before + 0.5, abs=1e-12)


def test_a_refused_push_ends_the_stream_with_the_status_push_segments_answers(
    receiver: DaemonHandle,
) -> None:
    before = _weight(receiver)
    # One message, as a small push travels: a refusal that races frames still being
    # written can reach a client as grpc's local INTERNAL instead (retried, not settled).
    wrong_model = _batch(_push(fingerprint="0" * 16))
    answers = asyncio.run(_exchange(receiver.address, [_push(), wrong_model, _push()]))
    assert _results(answers[0]) == [pb.SEGMENT_RESULT_MERGED]
    assert answers[1:] == [grpc.StatusCode.FAILED_PRECONDITION], "the stream ends at the refusal"
    assert _weight(receiver) == pytest.approx(before + 0.25, abs=1e-12)


def test_a_stream_idle_between_pushes_is_ended_ok_and_holds_no_slot(
    receiver: DaemonHandle,
) -> None:
    async def idle_then_push() -> tuple[grpc.StatusCode, list[Any]]:
        async with grpc.aio.insecure_channel(receiver.address) as channel:
            call, queue = _open_stream(channel)
            for frame in _push():
                queue.put_nowait(frame)
            assert await call.read() is not grpc.aio.EOF
            code = await asyncio.wait_for(call.code(), IDLE_S + 30)
        # Every slot it held is free: as many new streams as the cap allows all push.
        answers = await asyncio.gather(
            *(_exchange(receiver.address, [_push()]) for _ in range(STREAMS_PER_PEER))
        )
        return code, answers

    code, answers = asyncio.run(idle_then_push())
    assert code == grpc.StatusCode.OK
    assert [_results(a[0]) for a in answers] == [[pb.SEGMENT_RESULT_MERGED]] * STREAMS_PER_PEER


def test_streams_per_peer_are_capped(receiver: DaemonHandle) -> None:
    async def one_too_many() -> list[Any]:
        async with grpc.aio.insecure_channel(receiver.address) as channel:
            calls = []
            for _ in range(STREAMS_PER_PEER):  # each proven open by one answered push
                call, queue = _open_stream(channel)
                for frame in _push(weight=0.0):
                    queue.put_nowait(frame)
                assert await call.read() is not grpc.aio.EOF
                calls.append(call)
            extra = await _exchange(receiver.address, [[]])  # refused before any frame
            for call in calls:
                call.cancel()
            return extra

    assert asyncio.run(one_too_many()) == [grpc.StatusCode.RESOURCE_EXHAUSTED]


def _silent(handle: DaemonHandle) -> int:
    """Pushes ended for silence: by the idle timeout, or (the same wait seen through the
    minimum rate, which a stream that brought a few hundred bytes is below) too slow."""
    rejected = handle.status()["rejected"]
    return rejected.get("StreamIdle", 0) + rejected.get("PushTooSlow", 0)


def test_a_push_stalled_mid_stream_is_ended_by_the_idle_timeout(receiver: DaemonHandle) -> None:
    before, idled = _weight(receiver), _silent(receiver)
    stalled = _push()[:2]  # open and header, then nothing: no chunk, no end
    answers = asyncio.run(_exchange(receiver.address, [stalled]))
    assert answers == [grpc.StatusCode.DEADLINE_EXCEEDED]
    assert _weight(receiver) == pytest.approx(before, abs=1e-12)
    assert _silent(receiver) == idled + 1


def test_a_small_push_comes_whole_in_one_batch_message(receiver: DaemonHandle) -> None:
    before = _weight(receiver)
    whole = _push()
    answers = asyncio.run(_exchange(receiver.address, [_batch(whole), _batch(whole)]))
    assert [_results(a) for a in answers] == [
        [pb.SEGMENT_RESULT_MERGED],
        [pb.SEGMENT_RESULT_DUPLICATE],
    ]
    assert _weight(receiver) == pytest.approx(before + 0.25, abs=1e-12)


@pytest.mark.parametrize(
    "case",
    ["no end", "frames after the end", "batch inside a push", "batch in a batch"],
)
def test_a_batch_that_is_not_one_whole_push_is_refused(receiver: DaemonHandle, case: str) -> None:
    before = _weight(receiver)
    whole = _push()
    messages = {
        "no end": _batch(whole[:-1]),
        "frames after the end": _batch([*whole, whole[1]]),
        "batch inside a push": [whole[0], *_batch(whole[1:])],
        "batch in a batch": _batch([*_batch(whole[:-1]), whole[-1]]),
    }[case]
    assert asyncio.run(_exchange(receiver.address, [messages])) == [
        grpc.StatusCode.INVALID_ARGUMENT
    ]
    assert _weight(receiver) == pytest.approx(before, abs=1e-12)


def _client(
    receiver: DaemonHandle, fingerprint: str = PLAN.fingerprint, shaper: LinkShaper | None = None
) -> PeerClient:
    identity = Identity("test-mesh", SENDER, "127.0.0.1:1", INCARNATION, fingerprint, "sumweight")
    return PeerClient(
        receiver.address, identity, tls=Credentials(insecure=True), streams=1, shaper=shaper
    )


def _outbound(sequence: int, weight: float) -> OutboundPush:
    values = torch.full((PLAN.segments[0].numel,), 0.5)
    return OutboundPush(Push("receiver", sequence, {0: weight}), {0: values})


def test_the_nodes_client_reuses_its_stream_and_hears_a_refusal_as_one(
    receiver: DaemonHandle,
) -> None:
    """PeerClient: pushes merged push after push on one stream, a retry answered
    DUPLICATE, and a refusal raised as the receiver's error (settled, not retried)."""
    before = _weight(receiver)

    async def pushes() -> tuple[list[list[Ack]], int, GossipdError]:
        client = _client(receiver)
        try:
            first, second = next(_sequence), next(_sequence)
            acks = [
                await client.push(_outbound(first, 0.25), 30.0),
                await client.push(_outbound(second, 0.25), 30.0),
                await client.push(_outbound(first, 0.25), 30.0),
            ]
            opened = len(client._streams._idle)
        finally:
            await client.close()
        stranger = _client(receiver, fingerprint="0" * 16)
        try:
            with pytest.raises(GossipdError) as refused:
                await stranger.push(_outbound(next(_sequence), 0.25), 30.0)
        finally:
            await stranger.close()
        return acks, opened, refused.value

    acks, idle_streams, refusal = asyncio.run(pushes())
    assert [[a.duplicate for a in push] for push in acks] == [[False], [False], [True]]
    assert idle_streams == 1, "three pushes, one after another, share one stream"
    assert isinstance(refusal, MeshMismatch) and not isinstance(refusal, OutcomeUnknown)
    assert _weight(receiver) == pytest.approx(before + 0.5, abs=1e-12)


@pytest.mark.parametrize(
    ("rate_bytes_s", "messages"),
    [(0.0, 1), (1e6, 4)],
    ids=["latency only: one message", "a capped rate: open, header, chunk, end"],
)
def test_a_small_push_over_a_shaped_link_is_batched_unless_the_rate_is_paced(
    receiver: DaemonHandle, monkeypatch: pytest.MonkeyPatch, rate_bytes_s: float, messages: int
) -> None:
    """``[link]`` latency waits once per push, so it leaves a small push whole in one
    message, as an unshaped node sends it; the wide-area bench injects its latency this
    way, and sending four messages there put three messages' framing, flow control and
    packets on every push that no deployment pays. Only a capped rate, paced chunk by
    chunk, needs the frames apart."""
    fed: list[int] = []
    feed = pushsender.PushSender._feed

    async def counting(queue: Any, frames: AsyncIterator[bytes], progressed: Any) -> None:
        async def counted() -> AsyncIterator[bytes]:
            async for frame in frames:
                fed[-1] += 1
                yield frame

        fed.append(0)
        await feed(queue, counted(), progressed)

    monkeypatch.setattr(pushsender.PushSender, "_feed", staticmethod(counting))
    before = _weight(receiver)

    async def push() -> list[Ack]:
        shaper = LinkShaper(latency_s=0.01, rate_bytes_s=rate_bytes_s)
        client = _client(receiver, shaper=shaper)
        try:
            return await client.push(_outbound(next(_sequence), 0.25), 30.0)
        finally:
            await client.close()

    acks = asyncio.run(push())
    assert [a.duplicate for a in acks] == [False]
    assert fed == [messages]
    assert _weight(receiver) == pytest.approx(before + 0.25, abs=1e-12)


def test_a_refused_push_leaves_no_task_of_its_stream_behind(receiver: DaemonHandle) -> None:
    """grpc cancels the task that feeds a call from its request iterator only while the
    call still runs. After a receiver refused a push (and so ended the call), the
    client's task waited on its empty frame queue for good; asyncio logged each one at
    ERROR when the loop closed, dozens per daemon under a flooding peer. Every task the
    push started must end once the client is closed."""

    async def refused() -> list[str]:
        stranger = _client(receiver, fingerprint="0" * 16)
        try:
            with pytest.raises(MeshMismatch):
                await stranger.push(_outbound(next(_sequence), 0.25), 30.0)
        finally:
            await stranger.close()
        others = asyncio.all_tasks() - {asyncio.current_task()}
        if others:
            await asyncio.wait(others, timeout=10.0)
        return [repr(t.get_coro()) for t in others if not t.done()]

    assert asyncio.run(refused()) == []
