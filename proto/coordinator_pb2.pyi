from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Member(_message.Message):
    __slots__ = ("node_id", "address")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class View(_message.Message):
    __slots__ = ("members", "epoch")
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedCompositeFieldContainer[Member]
    epoch: int
    def __init__(self, members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., epoch: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("mesh_id", "address")
    MESH_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    mesh_id: str
    address: str
    def __init__(self, mesh_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("view", "shared_seed", "heartbeat_interval_s", "coordinator")
    VIEW_FIELD_NUMBER: _ClassVar[int]
    SHARED_SEED_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    view: View
    shared_seed: int
    heartbeat_interval_s: float
    coordinator: str
    def __init__(self, view: _Optional[_Union[View, _Mapping]] = ..., shared_seed: _Optional[int] = ..., heartbeat_interval_s: _Optional[float] = ..., coordinator: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("mesh_id",)
    MESH_ID_FIELD_NUMBER: _ClassVar[int]
    mesh_id: str
    def __init__(self, mesh_id: _Optional[str] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("known", "epoch")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    known: bool
    epoch: int
    def __init__(self, known: _Optional[bool] = ..., epoch: _Optional[int] = ...) -> None: ...

class MembershipRequest(_message.Message):
    __slots__ = ("mesh_id",)
    MESH_ID_FIELD_NUMBER: _ClassVar[int]
    mesh_id: str
    def __init__(self, mesh_id: _Optional[str] = ...) -> None: ...

class StartTimeRequest(_message.Message):
    __slots__ = ("mesh_id", "end_in_s")
    MESH_ID_FIELD_NUMBER: _ClassVar[int]
    END_IN_S_FIELD_NUMBER: _ClassVar[int]
    mesh_id: str
    end_in_s: float
    def __init__(self, mesh_id: _Optional[str] = ..., end_in_s: _Optional[float] = ...) -> None: ...

class StartTimeReply(_message.Message):
    __slots__ = ("granted", "peer", "peer_address", "start_in_s", "estimate_s")
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    START_IN_S_FIELD_NUMBER: _ClassVar[int]
    ESTIMATE_S_FIELD_NUMBER: _ClassVar[int]
    granted: bool
    peer: str
    peer_address: str
    start_in_s: float
    estimate_s: float
    def __init__(self, granted: _Optional[bool] = ..., peer: _Optional[str] = ..., peer_address: _Optional[str] = ..., start_in_s: _Optional[float] = ..., estimate_s: _Optional[float] = ...) -> None: ...

class ReportTransferRequest(_message.Message):
    __slots__ = ("mesh_id", "peer", "transfer_s")
    MESH_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    mesh_id: str
    peer: str
    transfer_s: float
    def __init__(self, mesh_id: _Optional[str] = ..., peer: _Optional[str] = ..., transfer_s: _Optional[float] = ...) -> None: ...

class ReportTransferReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
