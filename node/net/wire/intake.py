"""What a request goes through before the servicer hands it off: its bytes parsed by our
own deserializers, so that a frame that is not valid protobuf reaches the method as
:class:`Malformed` (answered with INVALID_ARGUMENT instead of grpc's generic UNKNOWN),
and the mesh it names checked."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias, TypeVar

from google.protobuf.message import DecodeError, Message

from gossipd.node.errors import InvalidFrame, MeshMismatch
from gossipd.node.net.wire.frames import PUSH_CHUNK_TAG, chunk_view
from gossipd.proto import gossip_pb2 as pb

T = TypeVar("T", bound=Message)


@dataclass(frozen=True)
class Malformed:
    """Bytes that did not parse as the expected message."""

    type_name: str
    size: int
    error: str


# A push frame as :func:`parse_push_frame` hands it to the servicer: a chunk frame as a
# view of its payload, bytes that do not parse as what they are.
PushFrameIn: TypeAlias = pb.PushFrame | memoryview | Malformed


def parser(cls: type[T]) -> Callable[[bytes], T | Malformed]:
    def parse(data: bytes) -> T | Malformed:
        try:
            return cls.FromString(data)
        except DecodeError as err:
            return Malformed(cls.DESCRIPTOR.full_name, len(data), str(err))

    return parse


def parse_push_frame(data: bytes) -> PushFrameIn:
    """A chunk frame as a view of its payload (:func:`wire.chunk_view`); anything else
    parsed, or Malformed."""
    view = chunk_view(data, PUSH_CHUNK_TAG)
    return _push_frame_parser(data) if view is None else view


def frame_size(frame: PushFrameIn) -> int:
    """Bytes a push frame brought, for the minimum rate (a chunk: its payload)."""
    if isinstance(frame, memoryview):
        return len(frame)
    if isinstance(frame, Malformed):
        return frame.size
    return frame.ByteSize()


def require(message: T | Malformed) -> T:
    if isinstance(message, Malformed):
        raise InvalidFrame(
            f"{message.size} bytes do not parse as {message.type_name}: {message.error}"
        )
    return message


_push_frame_parser = parser(pb.PushFrame)


def check_mesh(ours: str, mesh_id: str, who: str) -> None:
    """``who`` names mesh ``mesh_id``: refused unless it is ``ours``."""
    if mesh_id != ours:
        raise MeshMismatch(
            f"{who} belongs to mesh {mesh_id!r} but this node is in mesh "
            f"{ours!r}; check mesh_id in both configs"
        )
