"""Error feedback for compressed gossip: each segment travels as its difference from a copy
both ends already hold, so what the codec drops now is in the next difference.

Sent whole, an ``int8`` model is off by up to half a block's step at every merge, and the
sites never agree more closely than that. Sent as a difference from a shared copy (the
"public" copy of CHOCO-gossip, Koloskova et al. 2019, kept per pair of nodes here), the
error is a fraction of what changed since the last message: it shrinks as the sites
agree, and nothing the codec dropped is lost, since the next difference is taken from
the copy the receiver really rebuilt.

The copy of a (peer, segment) carries a version: a random 64-bit number the sender
picks per message, never a counter, so a restarted node or a forgotten message can
never make two different copies look alike. A message says which version it is a
difference from (``base``; 0: the values themselves) and which version its result
becomes. A receiver that holds another version refuses the segment
(:class:`~gossipd.node.errors.StaleReference`); the sender then forgets its copies for
that peer and sends the values themselves next time. A sender keeps a new copy only once
the receiver acknowledged it *and* said it kept it, so a lost acknowledgement, a busy
receiver or a receiver that keeps no copies costs one whole message, never a wrong merge.

Memory: one copy of the model per peer at each end that sends, and one per peer at each
end that receives, for at most ``max_peers`` peers each (least recently used dropped
first): ``2 × max_peers × model bytes`` at most. A peer's copies are one model's worth
whatever it sends, so a flooding member cannot take the others' room beyond its own
slot.
"""

from __future__ import annotations

import random
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from gossipd.node.compression import codecs as wirecodec
from gossipd.node.compression.codecs import Codec
from gossipd.node.errors import StaleReference

WHOLE = 0  # the base of a message that is the values themselves


class Copies:
    """Per peer, per segment: the version and values both ends agree on; at most
    ``max_peers`` peers, the least recently used forgotten first. Thread-safe: a
    receiver rebuilds segments in worker threads."""

    def __init__(self, max_peers: int) -> None:
        if max_peers < 1:
            raise ValueError(f"max_peers must be at least 1, not {max_peers}")
        self.max_peers = max_peers
        self._peers: OrderedDict[str, dict[int, tuple[int, torch.Tensor]]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, peer: str, segment: int) -> tuple[int, torch.Tensor] | None:
        with self._lock:
            held = self._peers.get(peer)
            if held is None:
                return None
            self._peers.move_to_end(peer)
            return held.get(segment)

    def put(self, peer: str, segment: int, version: int, values: torch.Tensor) -> None:
        with self._lock:
            self._peers.setdefault(peer, {})[segment] = (version, values)
            self._peers.move_to_end(peer)
            while len(self._peers) > self.max_peers:
                self._peers.popitem(last=False)

    def drop(self, peer: str, segment: int | None = None) -> None:
        """Forget ``peer``'s copy of ``segment`` (None: all of them)."""
        with self._lock:
            if segment is None:
                self._peers.pop(peer, None)
            elif peer in self._peers:
                self._peers[peer].pop(segment, None)
                if not self._peers[peer]:
                    del self._peers[peer]

    def holds(self, peer: str, segment: int, version: int) -> bool:
        with self._lock:
            held = self._peers.get(peer, {}).get(segment)
            return held is not None and held[0] == version

    @property
    def peers(self) -> int:
        return len(self._peers)

    @property
    def nbytes(self) -> int:
        with self._lock:
            copies = [v for held in self._peers.values() for _, v in held.values()]
            return sum(v.numel() * v.element_size() for v in copies)


@dataclass(frozen=True)
class Encoded:
    """One segment as sent: the codec's bytes, the versions, and what the receiver rebuilds."""

    data: memoryview
    base: int
    version: int
    rebuilt: torch.Tensor
    codec: Codec


class FeedbackSender:
    """A node's sending side: its copies of what each peer holds of its segments."""

    def __init__(
        self,
        codec: Codec,
        max_peers: int,
        rng: random.Random | None = None,
        fraction: float = wirecodec.DEFAULT_FRACTION,
    ) -> None:
        """``fraction``: of a segment's entries a sparse codec sends."""
        self.codec = codec
        self.fraction = fraction
        self.copies = Copies(max_peers)
        self._rng = rng or random.SystemRandom()
        # (peer, segment) -> (sequence, what that message sends): a retry of a push sends
        # the same bytes under the same version, so a receiver that merged the first
        # attempt recognises it.
        self._pending: dict[tuple[str, int], tuple[int, Encoded]] = {}
        self._lock = threading.Lock()

    def encode(self, peer: str, segment: int, values: torch.Tensor, sequence: int) -> Encoded:
        with self._lock:
            pending = self._pending.get((peer, segment))
        if pending is not None and pending[0] == sequence:
            return pending[1]
        held = self.copies.get(peer, segment)
        values = values.detach().to("cpu")
        codec = self.codec
        if held is None:
            base, change = WHOLE, values
            if wirecodec.is_sparse(codec):
                codec = wirecodec.SPARSE_WHOLE  # no copy to add entries to
            if not wirecodec.decoded_copy_bytes(codec, values.dtype, values.numel()):
                change = values.clone()  # the codec would send (and keep) a view of them
        else:
            base, change = held[0], values - held[1]
        data = wirecodec.encode(change, codec, self.fraction)
        decoded = wirecodec.decode(
            data, codec, values.dtype, values.numel(), check_finite=False
        ).view(values.shape)
        rebuilt = decoded if held is None else held[1] + decoded
        version = self._rng.getrandbits(63) | 1
        encoded = Encoded(data.toreadonly(), base, version, rebuilt, codec)
        with self._lock:
            self._pending[(peer, segment)] = (sequence, encoded)
        return encoded

    def rebuilt(self, peer: str, segment: int, sequence: int) -> torch.Tensor | None:
        """What push ``sequence`` to ``peer`` stood for in ``segment`` (None: not sent
        through here); read it before :meth:`settled`, which lets it go."""
        with self._lock:
            pending = self._pending.get((peer, segment))
        return pending[1].rebuilt if pending is not None and pending[0] == sequence else None

    def settled(self, peer: str, sequence: int, kept: set[int], segments: set[int]) -> None:
        """A push of ``segments`` to ``peer`` settled; the receiver acknowledged and kept
        ``kept``. Those become the shared copies; for the rest the receiver may hold
        either version, so this node forgets its copy and next sends the values whole."""
        for segment in segments:
            with self._lock:
                pending = self._pending.get((peer, segment))
                if pending is not None and pending[0] == sequence:
                    del self._pending[(peer, segment)]
                else:
                    pending = None
            if segment in kept and pending is not None:
                encoded = pending[1]
                self.copies.put(peer, segment, encoded.version, encoded.rebuilt)
            else:
                self.copies.drop(peer, segment)

    def forget(self, peer: str) -> None:
        """The peer holds other copies than ours (it said so, or restarted): start over."""
        self.copies.drop(peer)
        with self._lock:
            for key in [k for k in self._pending if k[0] == peer]:
                del self._pending[key]


class FeedbackReceiver:
    """A node's receiving side: its copies of each peer's segments as it rebuilt them."""

    def __init__(self, max_peers: int) -> None:
        self.copies = Copies(max_peers)

    def rebuild(
        self, peer: str, segment: int, base: int, version: int, decoded: torch.Tensor
    ) -> torch.Tensor:
        """The values a message stands for: ``decoded`` itself, or the copy of version
        ``base`` plus it. A message whose result this node already holds (a retry of one
        it merged) stands for that result."""
        if base == WHOLE:
            return decoded
        held = self.copies.get(peer, segment)
        if held is not None and version and held[0] == version:
            return held[1]
        if held is None or held[0] != base:
            holds = "no copy" if held is None else f"version {held[0]:#x}"
            raise StaleReference(
                f"segment {segment} from {peer} is a difference from version {base:#x} and "
                f"this node holds {holds} of it (forgotten, or a message in between was "
                "lost): the sender must send the values whole"
            )
        return held[1] + decoded

    def keep(self, peer: str, segment: int, version: int, values: torch.Tensor) -> None:
        """Keep the values a checked message stood for as the copy of ``version``."""
        if version:
            self.copies.put(peer, segment, version, values)

    def kept(self, peer: str, segment: int, version: int) -> bool:
        return bool(version) and self.copies.holds(peer, segment, version)
