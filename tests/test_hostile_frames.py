"""Hostile input against a real daemon over a real socket.

Every case checks three things: the status code and message say what was
wrong, the daemon keeps serving, and its parameters are bit-for-bit unchanged
(the checksum reported by Status). A valid push at the end proves the checksum
does move when something is merged, so the unchanged checks can fail.

The attacker is a verified member, not a stranger: a FakePeer that answers the
victim's own Handshake, so its frames get past the sender check and reach the
validation under test.
"""

from __future__ import annotations

import asyncio
import math
import struct
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import torch

from gossipd.node.compression import codecs as wirecodec
from gossipd.node.compression.codecs import Codec
from gossipd.node.jobs.registry import JobSpec, build_job
from gossipd.node.model.segments import FlatModel
from gossipd.node.net.dial.client import CHANNEL_OPTIONS
from gossipd.proto import gossip_pb2 as pb
from tests.conftest import wait_until
from tests.fakepeer import FakePeer

MESH = "test-mesh"
SENDER = "attacker"
INCARNATION = 7
MAX_CHUNK = 64 << 10
# limits.max_sum_weight unset: the cap is twice the founding members the victim has seen
# (itself and the attacker), checked on the merge's result, not on the message alone.
WEIGHT_CAP = 4.0
# The daemon's own cap on one gRPC message; grpc's default (4 MiB) would also refuse the
# oversize frame, so the expected message names the daemon's number, not just "too large".
MAX_MESSAGE = dict(CHANNEL_OPTIONS)["grpc.max_receive_message_length"]
OVERSIZE = 2 * MAX_MESSAGE  # the oversize frame's chunk field


def _identity(data: bytes) -> bytes:
    return data


class Wire:
    """A hand-driven client: raw bytes in, status code and message out."""

    def __init__(self, address: str) -> None:
        self.address = address
        job = build_job(JobSpec("synthetic", learning_rate=0.0))
        self.flat = FlatModel(job.model)
        self.fingerprint = self.flat.fingerprint

    def run(self, method: str, frames: list[bytes] | bytes) -> tuple[grpc.StatusCode, Any]:
        """The sync API on purpose: grpc.aio's client overwrites the server's status with
        ``INTERNAL: Internal error from Core`` when one of its writes fails because the
        server already ended the stream (grpc/grpc#36066), so an abort after the header
        would read as a crash of the victim whenever the chunk was still being written."""
        with grpc.insecure_channel(self.address) as channel:
            path = f"/gossipd.v1.Gossip/{method}"
            try:
                if isinstance(frames, list):
                    rpc = channel.stream_unary(path, _identity, _identity)
                    reply = rpc(iter(frames), timeout=20)
                else:
                    rpc = channel.unary_unary(path, _identity, _identity)
                    reply = rpc(frames, timeout=20)
            except grpc.RpcError as err:
                return err.code(), err.details()
            return grpc.StatusCode.OK, reply

    def open_frame(self, **overrides: Any) -> bytes:
        fields = dict(
            mesh_id=MESH,
            sender=SENDER,
            fingerprint=self.fingerprint,
            sequence=1,
            segment_count=1,
            incarnation=INCARNATION,
            sequence_base=1,
        )
        fields.update(overrides)
        return pb.PushFrame(open=pb.PushOpen(**fields)).SerializeToString()

    def segment(self, values: torch.Tensor, **overrides: Any) -> list[bytes]:
        data = bytes(wirecodec.encode(values, Codec.RAW))
        fields = dict(
            sender=SENDER,
            segment=0,
            sequence=1,
            sum_weight=1.0,
            dtype=pb.DTYPE_FLOAT32,
            numel=values.numel(),
            codec=pb.CODEC_RAW,
            payload_bytes=len(data),
            checksum=wirecodec.checksum(data),
        )
        chunk = overrides.pop("chunk", data)
        fields.update(overrides)
        return [
            pb.PushFrame(header=pb.SegmentHeader(**fields)).SerializeToString(),
            pb.PushFrame(chunk=chunk).SerializeToString(),
        ]


@pytest.fixture(scope="module")
def attacker() -> Iterator[FakePeer]:
    """Outlives the victim, so the victim's shutdown finds it answering."""
    with FakePeer(SENDER, incarnation=INCARNATION, serve_peers=True) as fake:
        yield fake


@pytest.fixture(scope="module")
def victim(attacker: FakePeer, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from gossipd.node.launch.localmesh import free_ports
    from tests.conftest import start_daemon

    handle = start_daemon(
        tmp_path_factory.mktemp("victim"),
        "victim",
        free_ports(1)[0],
        limits={"max_chunk_bytes": MAX_CHUNK},
        metrics={"listen": "127.0.0.1:0"},
        # The attacker takes no hand-off: the victim keeps its weight after this long,
        # not the default 10 s (tests/test_leaving_receiver.py covers hand-offs).
        shutdown_timeout_s=2.0,
    )
    yield handle
    assert handle.stop() == 0, handle.log()


@pytest.fixture(scope="module")
def wire(victim: Any, attacker: FakePeer) -> Wire:
    """A client speaking as SENDER, once the victim has verified SENDER by its own Handshake."""
    attacker.introduce_to(victim.address)
    wait_until(
        lambda: SENDER in victim.status()["live_peers"], "the victim to verify the attacker", 30
    )
    return Wire(victim.address)


def _values(wire: Wire, fill: float) -> torch.Tensor:
    return torch.full((wire.flat.plan.segments[0].numel,), fill)


Cases = dict[str, tuple[str, Callable[[], list[bytes] | bytes]]]  # name -> (RPC, its frames)


def _cases(wire: Wire) -> Cases:
    """Every hostile case: the RPC it calls and the frames it sends (built when run)."""
    good = _values(wire, 0.5)
    return {**_framing_cases(wire, good), **_open_cases(wire, good), **_segment_cases(wire, good)}


def _framing_cases(wire: Wire, good: torch.Tensor) -> Cases:
    """Frames that do not parse, come out of order, stop short or are too large."""
    half = bytes(wirecodec.encode(good, Codec.RAW))[: good.numel() * 2]
    return {
        "garbage push frame": ("PushSegments", lambda: [b"\xff\xff\xff\xff\x0fnot protobuf"]),
        "garbage handshake": ("Handshake", lambda: b"\x0a\xff\xff\xff\xff\x0f"),
        "garbage after open": ("PushSegments", lambda: [wire.open_frame(), b"\xff\xfe\xfd"]),
        "push without open": ("PushSegments", lambda: wire.segment(good)),
        "chunk first": ("PushSegments", lambda: wire.segment(good)[1:]),
        "truncated stream": (
            "PushSegments",
            lambda: [
                wire.open_frame(),
                wire.segment(good, chunk=half)[0],
                pb.PushFrame(chunk=half).SerializeToString()[: len(half) // 2 + 3],
            ],
        ),
        "stream ends mid-segment": (
            "PushSegments",
            lambda: [wire.open_frame(), *wire.segment(good, chunk=half)],
        ),
        "oversize chunk": (
            "PushSegments",
            lambda: [
                wire.open_frame(),
                wire.segment(good)[0],
                pb.PushFrame(chunk=b"\0" * (MAX_CHUNK * 2)).SerializeToString(),
            ],
        ),
        "oversize frame": (
            "PushSegments",
            lambda: [wire.open_frame(), _oversize_frame()],
        ),
    }


def _open_cases(wire: Wire, good: torch.Tensor) -> Cases:
    """A well-formed push whose open frame names the wrong model, mesh or sender, or
    numbers its segments or sequences wrongly."""
    return {
        "wrong fingerprint": (
            "PushSegments",
            lambda: [wire.open_frame(fingerprint="0" * 32), *wire.segment(good)],
        ),
        "wrong mesh": (
            "PushSegments",
            lambda: [wire.open_frame(mesh_id="other"), *wire.segment(good)],
        ),
        "unknown sender": (
            "PushSegments",
            lambda: [wire.open_frame(sender="stranger"), *wire.segment(good, sender="stranger")],
        ),
        "segment count lies": (
            "PushSegments",
            lambda: [wire.open_frame(segment_count=2), *wire.segment(good)],
        ),
        "no sequence base": (
            "PushSegments",
            lambda: [wire.open_frame(sequence_base=0), *wire.segment(good)],
        ),
        "sequence base above the sequence": (
            "PushSegments",
            lambda: [wire.open_frame(sequence_base=2), *wire.segment(good)],
        ),
    }


def _segment_cases(wire: Wire, good: torch.Tensor) -> Cases:
    """A segment whose values, checksum, size, index or sum-weight the receiver refuses."""
    nan = good.clone()
    nan[3] = math.nan
    inf = good.clone()
    inf[0] = math.inf
    return {
        "NaN payload": ("PushSegments", lambda: [wire.open_frame(), *wire.segment(nan)]),
        "infinite payload": ("PushSegments", lambda: [wire.open_frame(), *wire.segment(inf)]),
        "checksum mismatch": (
            "PushSegments",
            lambda: [wire.open_frame(), *wire.segment(good, checksum=12345)],
        ),
        "wrong numel": ("PushSegments", lambda: [wire.open_frame(), *wire.segment(good, numel=5)]),
        "segment out of range": (
            "PushSegments",
            lambda: [wire.open_frame(), *wire.segment(good, segment=99)],
        ),
        "negative sum-weight": (
            "PushSegments",
            lambda: [wire.open_frame(), *wire.segment(good, sum_weight=-1.0)],
        ),
        "huge sum-weight": (
            "PushSegments",
            lambda: [wire.open_frame(), *wire.segment(good, sum_weight=1e300)],
        ),
        "infinite sum-weight": (
            "PushSegments",
            lambda: [wire.open_frame(), *wire.segment(good, sum_weight=math.inf)],
        ),
        # Over the cap as well: a lone peer meets its credit (limits.peer_credit) first.
        "weight more than the sender may bring": (
            "PushSegments",
            lambda: [wire.open_frame(), *wire.segment(good, sum_weight=WEIGHT_CAP - 0.5)],
        ),
    }


def _varint(n: int) -> bytes:
    out = b""
    while True:
        byte, n = n & 0x7F, n >> 7
        if n:
            out += struct.pack("B", byte | 0x80)
        else:
            return out + struct.pack("B", byte)


def _oversize_frame() -> bytes:
    """A PushFrame whose chunk field (3, bytes) is OVERSIZE zero bytes long."""
    return b"\x1a" + _varint(OVERSIZE) + b"\0" * OVERSIZE


EXPECTED = {
    "garbage push frame": (grpc.StatusCode.INVALID_ARGUMENT, "do not parse"),
    "garbage handshake": (grpc.StatusCode.INVALID_ARGUMENT, "do not parse"),
    "garbage after open": (grpc.StatusCode.INVALID_ARGUMENT, "do not parse"),
    "push without open": (grpc.StatusCode.INVALID_ARGUMENT, "PushOpen"),
    "chunk first": (grpc.StatusCode.INVALID_ARGUMENT, "PushOpen"),
    "truncated stream": (grpc.StatusCode.INVALID_ARGUMENT, "do not parse"),
    "stream ends mid-segment": (grpc.StatusCode.INVALID_ARGUMENT, "stream ended inside segment 0"),
    "wrong fingerprint": (grpc.StatusCode.FAILED_PRECONDITION, "fingerprint mismatch"),
    "wrong mesh": (grpc.StatusCode.FAILED_PRECONDITION, "mesh 'other'"),
    "unknown sender": (grpc.StatusCode.UNAUTHENTICATED, "'stranger'"),
    "NaN payload": (grpc.StatusCode.INVALID_ARGUMENT, "NaN"),
    "infinite payload": (grpc.StatusCode.INVALID_ARGUMENT, "infinite"),
    "checksum mismatch": (grpc.StatusCode.INVALID_ARGUMENT, "checksum mismatch"),
    "wrong numel": (grpc.StatusCode.INVALID_ARGUMENT, "header says 5"),
    "segment out of range": (grpc.StatusCode.INVALID_ARGUMENT, "segment index 99"),
    "negative sum-weight": (grpc.StatusCode.INVALID_ARGUMENT, "sum-weight -1.0"),
    "huge sum-weight": (grpc.StatusCode.INVALID_ARGUMENT, "sum-weight 1e+300"),
    "infinite sum-weight": (grpc.StatusCode.INVALID_ARGUMENT, "sum-weight inf"),
    "weight more than the sender may bring": (
        grpc.StatusCode.INVALID_ARGUMENT,
        "sum-weight 3.5 of segment 0 from attacker is more than it may bring: 1.33333",
    ),
    "oversize chunk": (grpc.StatusCode.RESOURCE_EXHAUSTED, "over the limit"),
    "oversize frame": (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"larger than max ({1 + len(_varint(OVERSIZE)) + OVERSIZE} vs. {MAX_MESSAGE})",
    ),
    "segment count lies": (grpc.StatusCode.INVALID_ARGUMENT, "announced 2 segments"),
    "no sequence base": (grpc.StatusCode.INVALID_ARGUMENT, "sequence_base 0; it must be in 1..1"),
    "sequence base above the sequence": (
        grpc.StatusCode.INVALID_ARGUMENT,
        "sequence_base 2; it must be in 1..1",
    ),
}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_hostile_frame_is_rejected_and_model_unchanged(victim: Any, wire: Wire, case: str) -> None:
    before = victim.status(checksum=True)
    method, frames = _cases(wire)[case]
    code, details = wire.run(method, frames())
    want_code, want_text = EXPECTED[case]
    assert code == want_code, (case, code, details)
    assert want_text in details, (case, details)
    after = victim.status(checksum=True)
    assert after["params_checksum"] == before["params_checksum"], case
    assert after["sum_weights"] == before["sum_weights"], case
    assert victim.proc.poll() is None, victim.log()


def test_valid_push_merges_once_and_duplicate_changes_nothing(victim: Any, wire: Wire) -> None:
    before = victim.status(checksum=True)
    frames = [wire.open_frame(sequence=50), *wire.segment(_values(wire, 0.25), sequence=50)]
    code, reply = wire.run("PushSegments", frames)
    assert code == grpc.StatusCode.OK
    acks = pb.PushReply.FromString(reply).acks
    assert [a.result for a in acks] == [pb.SEGMENT_RESULT_MERGED]
    # Status reads the summary the trainer publishes at the end of its step, which may
    # come just after the acknowledgement.
    wanted = pytest.approx(before["sum_weights"][0] + 1.0)
    wait_until(lambda: victim.status()["sum_weights"][0] == wanted, "the merge in Status", 30)
    merged = victim.status(checksum=True)
    assert merged["params_checksum"] != before["params_checksum"]

    code, reply = wire.run("PushSegments", frames)
    assert code == grpc.StatusCode.OK
    assert [a.result for a in pb.PushReply.FromString(reply).acks] == [pb.SEGMENT_RESULT_DUPLICATE]
    again = victim.status(checksum=True)
    assert again["params_checksum"] == merged["params_checksum"]
    assert again["sum_weights"] == merged["sum_weights"]


def test_pull_with_wrong_fingerprint_is_refused(wire: Wire) -> None:
    request = pb.PullRequest(mesh_id=MESH, requester=SENDER, fingerprint="f" * 32)

    async def pull() -> tuple[grpc.StatusCode, str]:
        async with grpc.aio.insecure_channel(wire.address) as channel:
            rpc = channel.unary_stream("/gossipd.v1.Gossip/PullModel", _identity, _identity)
            try:
                async for _ in rpc(request.SerializeToString(), timeout=20):
                    pass
            except grpc.aio.AioRpcError as err:
                return err.code(), err.details() or ""
        return grpc.StatusCode.OK, ""

    code, details = asyncio.run(pull())
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "fingerprint mismatch" in details


def _prometheus_count(victim: Any, reason: str) -> float:
    port = victim.node_json()["metrics_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    prefix = f'gossipd_rejected_payloads_total{{reason="{reason}"}}'
    rows = [row for row in text.splitlines() if row.startswith(prefix)]
    return float(rows[0].split()[-1]) if rows else 0.0


def test_rejections_are_counted_by_reason_in_prometheus(victim: Any, wire: Wire) -> None:
    before = _prometheus_count(victim, "InvalidFrame")
    code, _ = wire.run(
        "PushSegments", [wire.open_frame(), *wire.segment(_values(wire, 0.5), checksum=1)]
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert _prometheus_count(victim, "InvalidFrame") == before + 1
