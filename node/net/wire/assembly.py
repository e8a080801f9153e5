"""Frames back into segments, validating everything.

Every inbound frame is checked against the local segment plan before a byte of
payload is kept: index in range, dtype and element count as planned, codec
known, size within limits, header and payload in agreement, checksum, finite
values. A segment is handed on whole or not at all, so a rejected payload can
never leave a model half-merged.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gossipd.node.compression import codecs as wirecodec
from gossipd.node.compression.codecs import Codec
from gossipd.node.compression.feedback import WHOLE, FeedbackReceiver
from gossipd.node.errors import InvalidFrame, PayloadTooLarge
from gossipd.node.model.payload_bound import Gauge
from gossipd.node.model.segments import SegmentPlan
from gossipd.node.net.limits.admission import held_bytes
from gossipd.node.trainer.messages import ReceivedSegment
from gossipd.proto import gossip_pb2 as pb


@dataclass(frozen=True)
class Limits:
    """Upper bounds on what a peer may send; anything above is refused before allocation."""

    max_chunk_bytes: int = 4 << 20
    max_segment_bytes: int = 1 << 30
    max_sum_weight: float = 1e6


class SegmentAssembler:
    """Feeds on headers and chunks of one stream; yields complete, verified segments.

    ``reserve`` pays for each segment's memory: it is called with what the segment
    will hold (:func:`admission.held_bytes`: the buffer, plus the decoded copy
    for fp16 or bf16) once the header is valid and before the buffer exists, and
    may raise to refuse it (a receiver's memory budget). ``gauge`` measures each verified
    segment against the receiver's own
    (:meth:`~gossipd.node.model.payload_bound.PayloadBound.gauge`),
    off the trainer thread, so its merge has less left to do at a step boundary.
    ``feedback``: this node's copies of its peers' segments (error feedback); a segment
    sent as a difference is rebuilt from them before it is checked, and once checked
    becomes the copy its header names. None: a difference is refused.
    """

    def __init__(
        self,
        plan: SegmentPlan,
        limits: Limits,
        reserve: Callable[[int], None] | None = None,
        gauge: Callable[..., Gauge | None] | None = None,
        feedback: FeedbackReceiver | None = None,
    ) -> None:
        self.plan = plan
        self.limits = limits
        self.reserve: Callable[[int], None] = reserve or (lambda nbytes: None)
        self.gauge = gauge
        self.feedback = feedback
        self._header: pb.SegmentHeader | None = None
        self._buffer: memoryview | None = None
        self._filled = 0
        self._seen: set[int] = set()

    def header(self, header: pb.SegmentHeader) -> ReceivedSegment | None:
        if self._header is not None:
            raise InvalidFrame(
                f"header for segment {header.segment} arrived before segment "
                f"{self._header.segment} was complete ({self._filled} of "
                f"{self._header.payload_bytes} bytes)"
            )
        n = len(self.plan)
        if header.segment >= n:
            raise InvalidFrame(f"segment index {header.segment} is out of range (model has {n})")
        if header.segment in self._seen:
            raise InvalidFrame(f"segment {header.segment} sent twice in one stream")
        seg = self.plan.segments[header.segment]
        codec = _codec(header.codec, seg.index)
        dtype = wirecodec.WIRE_TO_DTYPE.get(header.dtype)
        if dtype != seg.dtype:
            raise InvalidFrame(
                f"segment {seg.index} has dtype {seg.dtype} here but the header says "
                f"{dtype or header.dtype}"
            )
        if header.numel != seg.numel:
            raise InvalidFrame(
                f"segment {seg.index} has {seg.numel} elements here but the header says "
                f"{header.numel}"
            )
        expected = wirecodec.encoded_nbytes(codec, seg.dtype, seg.numel)
        if header.payload_bytes != expected:
            raise InvalidFrame(
                f"segment {seg.index} in {codec.name.lower()} is {expected} bytes but the "
                f"header says {header.payload_bytes}"
            )
        if expected > self.limits.max_segment_bytes:
            raise PayloadTooLarge(
                f"segment {seg.index} is {expected} bytes, over the limit of "
                f"{self.limits.max_segment_bytes} (limits.max_segment_bytes)"
            )
        weight = header.sum_weight
        if not (math.isfinite(weight) and 0 <= weight <= self.limits.max_sum_weight):
            raise InvalidFrame(
                f"sum-weight {weight!r} for segment {seg.index} is not a finite number between "
                f"0 and {self.limits.max_sum_weight:g} (limits.max_sum_weight)"
            )
        if header.base_version != WHOLE and self.feedback is None:
            raise InvalidFrame(
                f"segment {seg.index} is a difference from a copy (version "
                f"{header.base_version:#x}), but this node keeps no copies: set "
                "gossip.error_feedback alike on every node, or send values whole"
            )
        self.reserve(held_bytes(seg, codec, difference=header.base_version != WHOLE))
        self._header = header
        # Uninitialised memory: a zero-filled bytearray costs a page-faulting pass
        # over the whole segment before the first byte arrives.
        self._buffer = torch.empty(expected, dtype=torch.uint8).numpy().data
        self._filled = 0
        return self._complete_if_full()

    def chunk(self, data: bytes | memoryview) -> ReceivedSegment | None:
        if self._header is None or self._buffer is None:
            raise InvalidFrame(f"a {len(data)}-byte chunk arrived with no segment header before it")
        if len(data) > self.limits.max_chunk_bytes:
            raise PayloadTooLarge(
                f"chunk of {len(data)} bytes is over the limit of {self.limits.max_chunk_bytes}"
            )
        end = self._filled + len(data)
        if end > len(self._buffer):
            raise InvalidFrame(
                f"segment {self._header.segment} overflows: {end} bytes received, header "
                f"says {len(self._buffer)}"
            )
        self._buffer[self._filled : end] = data
        self._filled = end
        return self._complete_if_full()

    def unfilled(self) -> memoryview:
        """The open segment's buffer not yet filled, for a reader that fills it in place
        (a bulk-lane payload); :meth:`filled` says how much it wrote."""
        if self._header is None or self._buffer is None:
            raise InvalidFrame("bulk payload with no segment header before it")
        return self._buffer[self._filled :]

    def filled(self, nbytes: int, *, sealed: bool = False) -> Callable[[], ReceivedSegment] | None:
        """``nbytes`` more of the open segment were written into :meth:`unfilled`. Once
        it is full, the segment's checks (checksum, decode, finiteness) come back as a
        call that touches only its own buffer: a bulk reader runs it in a worker thread
        while the stream goes on to the next segment. ``sealed``: the bytes came in
        authenticated records (:mod:`gossipd.node.net.bulk.sealing`), whose tags already proved
        them the peer's; the checksum would prove nothing more and is skipped."""
        assert self._buffer is not None and self._filled + nbytes <= len(self._buffer)
        self._filled += nbytes
        full = self._take_full()
        if full is None:
            return None
        return functools.partial(self._verified, *full, checksum=not sealed)

    def close(self) -> None:
        """End of stream: a segment still open means the stream was truncated."""
        if self._header is not None:
            raise InvalidFrame(
                f"stream ended inside segment {self._header.segment}: {self._filled} of "
                f"{self._header.payload_bytes} bytes received"
            )

    def _complete_if_full(self) -> ReceivedSegment | None:
        full = self._take_full()
        return None if full is None else self._verified(*full)

    def _take_full(self) -> tuple[pb.SegmentHeader, memoryview] | None:
        """The open segment's header and buffer once every byte is in; the assembler is
        then ready for the next header."""
        header, buffer = self._header, self._buffer
        assert header is not None and buffer is not None
        if self._filled < len(buffer):
            return None
        self._header, self._buffer = None, None
        self._seen.add(header.segment)
        return header, buffer

    def _verified(
        self, header: pb.SegmentHeader, buffer: memoryview, *, checksum: bool = True
    ) -> ReceivedSegment:
        seg = self.plan.segments[header.segment]
        codec = Codec(header.codec)
        if self.gauge is None:
            if checksum:
                self._check_sum(header, wirecodec.checksum(buffer))
            # With copies kept, finiteness is checked once, on the values rebuilt from them.
            feedback = self.feedback
            values = wirecodec.decode(
                buffer, codec, seg.dtype, seg.numel, check_finite=feedback is None
            )
            if feedback is not None:
                values = self._rebuilt(header, values)
                wirecodec.require_finite(values)
                feedback.keep(header.sender, seg.index, header.version, values)
            version = self._copy_version(header)
            return ReceivedSegment(header.segment, header.sum_weight, values, None, version)
        # Values that are the payload itself (no decoding copy) are hashed block by block
        # as the gauge reads them: one pass over the segment from memory instead of two.
        hasher = None
        if checksum and not wirecodec.decoded_copy_bytes(codec, seg.dtype, seg.numel):
            hasher = wirecodec.BlockHasher()
        elif checksum:
            self._check_sum(header, wirecodec.checksum(buffer))
        values = wirecodec.decode(buffer, codec, seg.dtype, seg.numel, check_finite=False)
        if self.feedback is not None:
            values = self._rebuilt(header, values)
        gauge = self.gauge(header.segment, values, hasher.update if hasher else None)
        if hasher is not None:
            digest = hasher.digest(len(buffer))
            self._check_sum(header, wirecodec.checksum(buffer) if digest is None else digest)
        if gauge is None:  # it proved nothing: finiteness is checked on its own
            wirecodec.require_finite(values)
        if self.feedback is not None:
            self.feedback.keep(header.sender, seg.index, header.version, values)
        version = self._copy_version(header)
        return ReceivedSegment(header.segment, header.sum_weight, values, gauge, version)

    def _rebuilt(self, header: pb.SegmentHeader, decoded: torch.Tensor) -> torch.Tensor:
        assert self.feedback is not None
        return self.feedback.rebuild(
            header.sender, header.segment, header.base_version, header.version, decoded
        )

    def _copy_version(self, header: pb.SegmentHeader) -> int:
        """The version the segment's values become a copy of (0: none is kept)."""
        return header.version if self.feedback is not None else 0

    @staticmethod
    def _check_sum(header: pb.SegmentHeader, actual: int) -> None:
        if actual != header.checksum:
            raise InvalidFrame(
                f"checksum mismatch on segment {header.segment}: header says "
                f"{header.checksum:#018x}, payload hashes to {actual:#018x}"
            )


def _codec(value: int, segment: int) -> Codec:
    """The codec a header names, if this daemon takes it."""
    try:
        codec = Codec(value)
    except ValueError:
        raise InvalidFrame(f"unknown codec {value} for segment {segment}") from None
    if wirecodec.is_sparse(codec):
        raise InvalidFrame(
            f"segment {segment} is in {codec.name.lower()}, which only the simulator runs: "
            "sparse differences from the copies do not converge (docs/protocols/index.md)"
        )
    return codec
