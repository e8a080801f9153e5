"""Floods against a real daemon: stream caps, the pending-bytes budget and idle deadlines.

Seen on real daemons before these caps: 200 push streams stalled after 4 MiB
each took a node from 428 MB to 1.74 GB RSS, and 100 PullModel streams that
never read took one from 389 to 703 MB. The flood tests hit a real daemon over
real sockets from an accepted sender (a FakePeer the daemon verified), then
check that its peak RSS (VmHWM, reset just before the flood) stays within
baseline + what the caps allow + a stated margin, that every refusal and
cut-off is counted by reason, and that the daemon still serves afterwards.
Nothing here asserts a duration: every wait polls a condition with a deadline. The
budget and the slots alone, without a daemon, are ``tests/test_admission_limits.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from gossipd.node.launch.localmesh import free_ports
from gossipd.node.model.segments import model_checksum
from gossipd.node.net.status.query import query_status
from gossipd.node.net.wire.frames import Limits, SegmentAssembler
from gossipd.proto import gossip_pb2 as pb
from tests.conftest import DaemonHandle, start_daemon, wait_until
from tests.fakepeer import FakePeer
from tests.flood_frames import (
    CHUNK_BYTES,
    INCARNATION,
    NUMEL,
    PLAN,
    SEGMENT_BYTES,
    SENDER,
    open_frame,
    segment_frames,
    stalling_head,
)
from tests.outsider import MESH

JOB = {"options": {"numel": NUMEL}}
IDLE_S = 3.0
LIMITS = {
    "max_inbound_pushes": 16,
    "max_inbound_pulls": 2,
    "max_pending_bytes": 2 * SEGMENT_BYTES,  # two big segments, about 32 MiB
    "stream_idle_timeout_s": IDLE_S,
}
# What a flood may add beyond its caps: gRPC's per-stream buffers and bookkeeping for
# 200 streams, interpreter garbage. Without the caps the push flood below adds ~800 MB.
MARGIN_BYTES = 64 << 20
WAIT_S = 60.0
LOST_STATUS = "Internal error from Core"
PUSH = "/gossipd.v1.Gossip/PushSegments"
PULL = "/gossipd.v1.Gossip/PullModel"


def _identity(data: bytes) -> bytes:
    return data


def _proc_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {key} in /proc/{pid}/status")


def _reset_peak(pid: int) -> int:
    """Reset the process's peak RSS to its current RSS (Linux clear_refs 5); bytes now."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return _proc_kib(pid, "VmRSS") << 10


def _peak(pid: int) -> int:
    return _proc_kib(pid, "VmHWM") << 10


@pytest.fixture(scope="module")
def victim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonHandle]:
    """One daemon for the floods (each measures its own baseline and counter deltas).

    It has verified the attacker with its own Handshake, so the attacker's pushes
    pass the sender check; the attacker outlives the daemon, so the daemon's
    shutdown finds it answering instead of retrying a hand-off to a closed port.
    """
    fake = FakePeer(SENDER, fingerprint=PLAN.fingerprint, incarnation=INCARNATION, serve_peers=True)
    with fake:
        port = free_ports(1)[0]
        handle = start_daemon(  # the fake takes no hand-off: 2 s, not 10, to give up on it
            tmp_path_factory.mktemp("victim"),
            "victim",
            port,
            job=JOB,
            limits=LIMITS,
            shutdown_timeout_s=2.0,
        )
        try:
            fake.introduce_to(handle.address)
            wait_until(
                lambda: SENDER in handle.status()["live_peers"], "the victim to verify SENDER", 30
            )
            yield handle
        finally:
            assert handle.stop() == 0, handle.log()


async def _push(
    channel: grpc.aio.Channel,
    frames: list[bytes],
    go: asyncio.Future[None] | None = None,
    written: asyncio.Event | None = None,
) -> tuple[grpc.StatusCode, str]:
    """Open a push, write ``frames`` (once ``go`` is done, if given), never close it.

    Returns how the daemon ended the stream. A stream refused while this client
    is still writing may read grpc's INTERNAL (the client's failed write
    overrides the status), with or without the daemon's text.
    """
    call = channel.stream_unary(PUSH, _identity, _identity)(timeout=WAIT_S)
    ended = asyncio.ensure_future(call.code())
    try:
        if go is not None:
            await asyncio.wait([ended, go], return_when=asyncio.FIRST_COMPLETED)
        for frame in frames:
            if ended.done():
                break
            await call.write(frame)
        if written is not None and not ended.done():
            written.set()
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        pass  # refused while writing; the status says why
    code = await ended
    return code, await call.details() or ""


async def _until(
    check: Callable[[], bool | Awaitable[bool]], what: str, timeout_s: float = WAIT_S
) -> None:
    """Poll ``check`` (plain or async) on the running loop until it holds."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        held = check()
        if not isinstance(held, bool):
            held = await held
        if held:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def _push_flood(address: str) -> tuple[list[tuple[grpc.StatusCode, str]], str]:
    """Two pushes fill the budget and stall; then a probe (or a few) and 197 more streams.

    Returns every stream's end and the probe's refusal. Probes send a header
    and nothing more, so the refusal reaches an idle client intact; one that
    got in before a holder did is ended idle, and the next probe tries again.
    The flood's streams write nothing until ``go``: the admitted ones hold their
    slots meanwhile, and the refused ones hear why at once.
    """
    channels = [grpc.aio.insecure_channel(address) for _ in range(10)]
    results = []
    try:
        written = [asyncio.Event(), asyncio.Event()]
        holders = [
            asyncio.ensure_future(_push(channels[i], stalling_head(1 + i), written=written[i]))
            for i in (0, 1)
        ]
        # 4 MiB cannot pass a fresh stream's flow control unless the daemon read it,
        # header first: once written, each holder has its reservation.
        await _until(lambda: all(w.is_set() for w in written), "the holders' frames")
        probe: tuple[grpc.StatusCode, str] = (grpc.StatusCode.OK, "")
        for sequence in range(100, 100 + 5):
            probe = await _push(channels[2], stalling_head(sequence)[:2])
            results.append(probe)
            if "limits.max_pending_bytes" in probe[1]:
                break
        go = asyncio.get_running_loop().create_future()
        flood = [
            asyncio.ensure_future(_push(channels[i % 10], stalling_head(1000 + i), go))
            for i in range(197)
        ]
        await _until(lambda: sum(t.done() for t in flood) >= 197 - 16, "the slot refusals")
        go.set_result(None)
        results += await asyncio.wait_for(asyncio.gather(*holders, *flood), WAIT_S)
        return results, probe[1]
    finally:
        for channel in channels:
            await channel.close()


def test_push_flood_is_bounded_by_caps_and_budget_then_a_push_merges(victim: DaemonHandle) -> None:
    pid = victim.proc.pid
    before = victim.status(checksum=True)
    baseline = _reset_peak(pid)

    results, probe = asyncio.run(_push_flood(victim.address))

    peak = _peak(pid)
    print(f"push flood: RSS {baseline >> 20} MiB before, peak {peak >> 20} MiB during")
    assert peak <= baseline + LIMITS["max_pending_bytes"] + MARGIN_BYTES, (baseline, peak)
    keys = ("limits.max_inbound_pushes", "limits.max_pending_bytes", "limits.stream_idle_timeout_s")
    unexplained = [r for r in results if r[1] != LOST_STATUS and not any(k in r[1] for k in keys)]
    assert not unexplained, unexplained
    assert "limits.max_pending_bytes" in probe, probe
    slot_refusals = [
        d for c, d in results if c == grpc.StatusCode.RESOURCE_EXHAUSTED and keys[0] in d
    ]
    assert slot_refusals, Counter(c for c, _ in results)
    idle = [d for c, d in results if c == grpc.StatusCode.DEADLINE_EXCEEDED]
    assert len(idle) >= 2 and all(keys[2] in d for d in idle), idle  # at least the holders
    after = victim.status(checksum=True)
    rejected = Counter(after["rejected"])
    rejected.subtract(before["rejected"])
    assert rejected["Busy"] + rejected["StreamIdle"] == len(results), (rejected, len(results))
    assert rejected["StreamIdle"] >= len(idle), rejected
    assert after["params_checksum"] == before["params_checksum"]

    # The budget is free again: a whole push, big segment included, is merged.
    values = [torch.full((s.numel,), 0.25) for s in PLAN.segments]
    frames = [open_frame(1, 2), *segment_frames(1, 0, values[0]), *segment_frames(1, 1, values[1])]

    async def push_once() -> tuple[grpc.StatusCode, Any]:
        async with grpc.aio.insecure_channel(victim.address) as channel:
            rpc = channel.stream_unary(PUSH, _identity, pb.PushReply.FromString)
            try:
                return grpc.StatusCode.OK, await rpc(iter(frames), timeout=WAIT_S)
            except grpc.aio.AioRpcError as err:
                return err.code(), err.details()

    code, reply = asyncio.run(push_once())
    assert code == grpc.StatusCode.OK, reply
    assert [a.result for a in reply.acks] == [pb.SEGMENT_RESULT_MERGED] * 2
    assert victim.status(checksum=True)["params_checksum"] != before["params_checksum"]
    assert victim.proc.poll() is None, victim.log()


def _pull_request() -> bytes:
    request = pb.PullRequest(mesh_id=MESH, requester=SENDER, fingerprint=PLAN.fingerprint)
    return request.SerializeToString()


async def _stalled_pulls(address: str, pid: int) -> tuple[list[str], list[Any], int]:
    """100 pulls that never read: the refusals' details, the stalled calls' ends, the peak RSS.

    The admitted pulls keep their slots until they end, so exactly 100 - slots
    are refused at once. Once the daemon has cut the others off (counted as
    StreamIdle), their calls are read to the end: the status is behind the
    frames they never took.
    """
    slots = LIMITS["max_inbound_pulls"]
    # Without BDP probing a reader's window stays at 64 KiB: however fast loopback is, the
    # daemon cannot get the whole model out to a reader that takes nothing.
    options = [("grpc.http2.bdp_probe", 0)]
    channels = [grpc.aio.insecure_channel(address, options=options) for _ in range(10)]
    try:
        before = (await query_status(address, 10.0))["rejected"].get("StreamIdle", 0)
        calls = [
            channels[i % 10].unary_stream(PULL, _identity, _identity)(
                _pull_request(), timeout=WAIT_S
            )
            for i in range(100)
        ]
        codes = [asyncio.ensure_future(call.code()) for call in calls]
        await _until(lambda: sum(c.done() for c in codes) >= 100 - slots, "the pull refusals")
        done = [(call, code) for call, code in zip(calls, codes, strict=True) if code.done()]
        assert [code.result() for _, code in done] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * (
            100 - slots
        )
        refused = [await call.details() for call, _ in done]

        async def cut_off() -> bool:
            status = await query_status(address, 10.0)
            return status["rejected"].get("StreamIdle", 0) - before >= slots

        await _until(cut_off, "the daemon to cut the stalled pulls off")
        peak = _peak(pid)
        ends = []
        for call, code in zip(calls, codes, strict=True):
            if not code.done():
                count = 0
                with contextlib.suppress(grpc.aio.AioRpcError):
                    async for _ in call:
                        count += 1
                ends.append((count, await call.code(), await call.details()))
        return refused, ends, peak
    finally:
        for channel in channels:
            await channel.close()


async def _pull_model(address: str) -> dict[int, torch.Tensor] | str:
    """One whole pull, verified by the wire's assembler; the error text if refused."""
    assembler = SegmentAssembler(PLAN, Limits())
    received = {}
    async with grpc.aio.insecure_channel(address) as channel:
        rpc = channel.unary_stream(PULL, _identity, pb.PullFrame.FromString)
        try:
            async for frame in rpc(_pull_request(), timeout=WAIT_S):
                kind = frame.WhichOneof("kind")
                done = assembler.header(frame.header) if kind == "header" else None
                done = assembler.chunk(frame.chunk) if kind == "chunk" else done
                if done is not None:
                    received[done.segment] = done.values
        except grpc.aio.AioRpcError as err:
            return f"{err.code().name}: {err.details()}"
    assembler.close()
    return received


def test_unread_pulls_are_capped_and_cut_off_then_a_pull_completes(victim: DaemonHandle) -> None:
    pid = victim.proc.pid
    baseline = _reset_peak(pid)

    refused, ends, peak = asyncio.run(_stalled_pulls(victim.address, pid))

    print(f"pull flood: RSS {baseline >> 20} MiB before, peak {peak >> 20} MiB during")
    slots = LIMITS["max_inbound_pulls"]
    # Each admitted pull holds a snapshot and what gRPC buffers for its reader.
    assert peak <= baseline + slots * 2 * PLAN.nbytes + MARGIN_BYTES, (baseline, peak)
    assert all("limits.max_inbound_pulls" in d for d in refused), refused[:3]
    frames_in_model = 2 + sum(-(-s.nbytes // CHUNK_BYTES) for s in PLAN.segments)
    for count, code, details in ends:
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED, details
        assert "limits.stream_idle_timeout_s" in details
        assert count < frames_in_model

    # Their slots are free once those calls ended: a whole pull comes through.
    def pulled() -> bool:
        model = asyncio.run(_pull_model(victim.address))
        if isinstance(model, str):
            assert "limits.max_inbound_pulls" in model, model
            return False
        assert sorted(model) == [0, 1]
        checksum = model_checksum([model[0], model[1]])
        return checksum == victim.status(checksum=True)["params_checksum"]

    wait_until(pulled, "a complete pull after the flood", WAIT_S)
    assert victim.proc.poll() is None, victim.log()
