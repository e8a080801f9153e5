"""The simulated wire's codec: each pushed segment encoded and decoded with the daemon's own
codecs (:mod:`gossipd.node.compression.codecs`) and, with error feedback, sent as a difference
from the copies the daemon keeps (:mod:`gossipd.node.compression.feedback`).

A segment's simulated bytes are scaled by its codec's size against float32 (the simulated
wire carries a float32 model whatever the payload's own dtype), so ``bytes_sent`` counts
what the daemon would send. Like the torch payload, this module loads torch (through
the codecs) only once a simulation asks for a codec: a vector simulation never does.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

    from gossipd.node.compression.codecs import Codec
    from gossipd.node.compression.feedback import Encoded, FeedbackReceiver, FeedbackSender


def _tensor(values: Any) -> torch.Tensor:
    import torch

    return torch.from_numpy(values) if isinstance(values, np.ndarray) else values


def _like(values: torch.Tensor, original: Any) -> Any:
    return values.numpy() if isinstance(original, np.ndarray) else values


class SimCodec:
    """Every simulated node's codec state: one sending and one receiving side per node."""

    def __init__(
        self,
        codec: Codec,
        error_feedback: bool,
        max_peers: int,
        seed: int,
        fraction: float,
    ) -> None:
        """``fraction``: of a segment's entries a sparse codec sends."""
        import torch

        from gossipd.node.compression import codecs as wirecodec
        from gossipd.node.compression import feedback

        self._torch, self._wire, self._feedback = torch, wirecodec, feedback
        self.codec = codec
        self.error_feedback = error_feedback
        self.max_peers = max_peers
        self.fraction = fraction
        self._rng = random.Random(seed)  # versions only: they never change a value
        self._senders: dict[str, FeedbackSender] = {}
        self._receivers: dict[str, FeedbackReceiver] = {}
        self.stale = 0  # segments refused as differences from a copy the receiver lacked

    def wire_bytes(self, raw_nbytes: int, numel: int, sent: Encoded) -> int:
        """What a segment of ``raw_nbytes`` simulated bytes costs as ``sent``: its encoded
        bytes against float32's (a sparse codec's vary from push to push)."""
        return max(1, round(raw_nbytes * len(sent.data) / max(4 * numel, 1)))

    def send(
        self, sender: str, peer: str, sequence: int, values: Mapping[int, Any]
    ) -> dict[int, Encoded]:
        """Each segment as it leaves ``sender`` for ``peer``."""
        if not self.error_feedback:
            out = {}
            for s, v in values.items():
                data = self._wire.encode(_tensor(v), self.codec)
                out[s] = self._feedback.Encoded(data, 0, 0, self._torch.empty(0), self.codec)
            return out
        side = self._senders.get(sender)
        if side is None:
            side = self._feedback.FeedbackSender(
                self.codec, self.max_peers, self._rng, self.fraction
            )
            self._senders[sender] = side
        return {s: side.encode(peer, s, _tensor(v), sequence) for s, v in values.items()}

    def receive(
        self, receiver: str, sender: str, sent: Mapping[int, Encoded], like: Mapping[int, Any]
    ) -> dict[int, Any]:
        """What ``receiver`` rebuilds from the bytes (the values to merge, shaped as
        ``like``); raises :class:`~gossipd.node.errors.StaleReference` as the daemon does."""
        out = {}
        side = self._receivers.get(receiver)
        for s, enc in sent.items():
            original = _tensor(like[s])
            data = bytearray(enc.data)  # what a receiver holds: its own, writable buffer
            decoded = self._wire.decode(data, enc.codec, original.dtype, original.numel())
            decoded = decoded.view(original.shape)
            if self.error_feedback:
                if side is None:
                    side = self._feedback.FeedbackReceiver(self.max_peers)
                    self._receivers[receiver] = side
                decoded = side.rebuild(sender, s, enc.base, enc.version, decoded)
            out[s] = _like(decoded, like[s])
        return out

    def keep(
        self, receiver: str, sender: str, sent: Mapping[int, Encoded], values: Mapping[int, Any]
    ) -> set[int]:
        """The merged segments' rebuilt values become ``receiver``'s copies; the segments
        it kept (what its acknowledgement says)."""
        side = self._receivers.get(receiver)
        if side is None:
            return set()
        for s, enc in sent.items():
            if s in values:
                side.keep(sender, s, enc.version, _tensor(values[s]))
        return {s for s, enc in sent.items() if side.kept(sender, s, enc.version)}

    def settled(
        self, sender: str, peer: str, sequence: int, kept: set[int], segments: set[int]
    ) -> None:
        side = self._senders.get(sender)
        if side is not None:
            side.settled(peer, sequence, kept, segments)

    def stale_copy(self, sender: str, peer: str) -> None:
        """``peer`` refused a difference: ``sender`` starts over with whole values."""
        self.stale += 1
        side = self._senders.get(sender)
        if side is not None:
            side.forget(peer)
