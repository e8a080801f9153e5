from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT64: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_UNSPECIFIED: _ClassVar[Codec]
    CODEC_RAW: _ClassVar[Codec]
    CODEC_FP16: _ClassVar[Codec]
    CODEC_BF16: _ClassVar[Codec]
    CODEC_INT8: _ClassVar[Codec]
    CODEC_INT4: _ClassVar[Codec]
    CODEC_TOPK2: _ClassVar[Codec]
    CODEC_TOPK4: _ClassVar[Codec]

class SegmentResult(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SEGMENT_RESULT_UNSPECIFIED: _ClassVar[SegmentResult]
    SEGMENT_RESULT_MERGED: _ClassVar[SegmentResult]
    SEGMENT_RESULT_DUPLICATE: _ClassVar[SegmentResult]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT64: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
CODEC_UNSPECIFIED: Codec
CODEC_RAW: Codec
CODEC_FP16: Codec
CODEC_BF16: Codec
CODEC_INT8: Codec
CODEC_INT4: Codec
CODEC_TOPK2: Codec
CODEC_TOPK4: Codec
SEGMENT_RESULT_UNSPECIFIED: SegmentResult
SEGMENT_RESULT_MERGED: SegmentResult
SEGMENT_RESULT_DUPLICATE: SegmentResult

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "address", "incarnation")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    incarnation: int
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("schema_version", "mesh_id", "node", "fingerprint", "protocol")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    MESH_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    mesh_id: str
    node: NodeInfo
    fingerprint: str
    protocol: str
    def __init__(self, schema_version: _Optional[int] = ..., mesh_id: _Optional[str] = ..., node: _Optional[_Union[NodeInfo, _Mapping]] = ..., fingerprint: _Optional[str] = ..., protocol: _Optional[str] = ...) -> None: ...

class HandshakeReply(_message.Message):
    __slots__ = ("schema_version", "node", "fingerprint", "step", "peers", "protocol", "bulk_port", "bulk_sealed", "relay")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    BULK_SEALED_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    node: NodeInfo
    fingerprint: str
    step: int
    peers: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    protocol: str
    bulk_port: int
    bulk_sealed: bool
    relay: bool
    def __init__(self, schema_version: _Optional[int] = ..., node: _Optional[_Union[NodeInfo, _Mapping]] = ..., fingerprint: _Optional[str] = ..., step: _Optional[int] = ..., peers: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ..., protocol: _Optional[str] = ..., bulk_port: _Optional[int] = ..., bulk_sealed: _Optional[bool] = ..., relay: _Optional[bool] = ...) -> None: ...

class AttachFrame(_message.Message):
    __slots__ = ("mesh_id", "address", "ping")
    MESH_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PING_FIELD_NUMBER: _ClassVar[int]
    mesh_id: str
    address: str
    ping: bool
    def __init__(self, mesh_id: _Optional[str] = ..., address: _Optional[str] = ..., ping: _Optional[bool] = ...) -> None: ...

class RelayOrder(_message.Message):
    __slots__ = ("ping", "token", "origin", "leaving")
    PING_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    ping: bool
    token: bytes
    origin: str
    leaving: bool
    def __init__(self, ping: _Optional[bool] = ..., token: _Optional[bytes] = ..., origin: _Optional[str] = ..., leaving: _Optional[bool] = ...) -> None: ...

class RelayFrame(_message.Message):
    __slots__ = ("target", "token", "data", "leaving")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    target: str
    token: bytes
    data: bytes
    leaving: bool
    def __init__(self, target: _Optional[str] = ..., token: _Optional[bytes] = ..., data: _Optional[bytes] = ..., leaving: _Optional[bool] = ...) -> None: ...

class ReachRequest(_message.Message):
    __slots__ = ("mesh_id", "node")
    MESH_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    mesh_id: str
    node: NodeInfo
    def __init__(self, mesh_id: _Optional[str] = ..., node: _Optional[_Union[NodeInfo, _Mapping]] = ...) -> None: ...

class ReachReply(_message.Message):
    __slots__ = ("reachable", "detail")
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    reachable: bool
    detail: str
    def __init__(self, reachable: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class PushOpen(_message.Message):
    __slots__ = ("mesh_id", "sender", "fingerprint", "sequence", "segment_count", "incarnation", "round", "sequence_base", "deadline_s", "bulk_token", "receiver_incarnation", "settled", "closes")
    MESH_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_COUNT_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_BASE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    BULK_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SETTLED_FIELD_NUMBER: _ClassVar[int]
    CLOSES_FIELD_NUMBER: _ClassVar[int]
    mesh_id: str
    sender: str
    fingerprint: str
    sequence: int
    segment_count: int
    incarnation: int
    round: int
    sequence_base: int
    deadline_s: float
    bulk_token: bytes
    receiver_incarnation: int
    settled: int
    closes: bool
    def __init__(self, mesh_id: _Optional[str] = ..., sender: _Optional[str] = ..., fingerprint: _Optional[str] = ..., sequence: _Optional[int] = ..., segment_count: _Optional[int] = ..., incarnation: _Optional[int] = ..., round: _Optional[int] = ..., sequence_base: _Optional[int] = ..., deadline_s: _Optional[float] = ..., bulk_token: _Optional[bytes] = ..., receiver_incarnation: _Optional[int] = ..., settled: _Optional[int] = ..., closes: _Optional[bool] = ...) -> None: ...

class PushEnd(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SegmentHeader(_message.Message):
    __slots__ = ("sender", "segment", "sequence", "sum_weight", "dtype", "numel", "codec", "payload_bytes", "checksum", "bulk", "base_version", "version")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SUM_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    BULK_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    sender: str
    segment: int
    sequence: int
    sum_weight: float
    dtype: DType
    numel: int
    codec: Codec
    payload_bytes: int
    checksum: int
    bulk: bool
    base_version: int
    version: int
    def __init__(self, sender: _Optional[str] = ..., segment: _Optional[int] = ..., sequence: _Optional[int] = ..., sum_weight: _Optional[float] = ..., dtype: _Optional[_Union[DType, str]] = ..., numel: _Optional[int] = ..., codec: _Optional[_Union[Codec, str]] = ..., payload_bytes: _Optional[int] = ..., checksum: _Optional[int] = ..., bulk: _Optional[bool] = ..., base_version: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class PushFrame(_message.Message):
    __slots__ = ("open", "header", "chunk", "end", "batch")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    open: PushOpen
    header: SegmentHeader
    chunk: bytes
    end: PushEnd
    batch: FrameBatch
    def __init__(self, open: _Optional[_Union[PushOpen, _Mapping]] = ..., header: _Optional[_Union[SegmentHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ..., end: _Optional[_Union[PushEnd, _Mapping]] = ..., batch: _Optional[_Union[FrameBatch, _Mapping]] = ...) -> None: ...

class FrameBatch(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, frames: _Optional[_Iterable[bytes]] = ...) -> None: ...

class SegmentAck(_message.Message):
    __slots__ = ("segment", "result", "receiver_weight", "kept")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    segment: int
    result: SegmentResult
    receiver_weight: float
    kept: bool
    def __init__(self, segment: _Optional[int] = ..., result: _Optional[_Union[SegmentResult, str]] = ..., receiver_weight: _Optional[float] = ..., kept: _Optional[bool] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("acks",)
    ACKS_FIELD_NUMBER: _ClassVar[int]
    acks: _containers.RepeatedCompositeFieldContainer[SegmentAck]
    def __init__(self, acks: _Optional[_Iterable[_Union[SegmentAck, _Mapping]]] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("mesh_id", "requester", "fingerprint", "codec", "segments", "round", "bulk_token")
    MESH_ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    BULK_TOKEN_FIELD_NUMBER: _ClassVar[int]
    mesh_id: str
    requester: str
    fingerprint: str
    codec: Codec
    segments: _containers.RepeatedScalarFieldContainer[int]
    round: int
    bulk_token: bytes
    def __init__(self, mesh_id: _Optional[str] = ..., requester: _Optional[str] = ..., fingerprint: _Optional[str] = ..., codec: _Optional[_Union[Codec, str]] = ..., segments: _Optional[_Iterable[int]] = ..., round: _Optional[int] = ..., bulk_token: _Optional[bytes] = ...) -> None: ...

class PullFrame(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: SegmentHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[SegmentHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("mesh_id", "node_id", "incarnation", "merged")
    MESH_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    MERGED_FIELD_NUMBER: _ClassVar[int]
    mesh_id: str
    node_id: str
    incarnation: int
    merged: _containers.RepeatedCompositeFieldContainer[Receipts]
    def __init__(self, mesh_id: _Optional[str] = ..., node_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., merged: _Optional[_Iterable[_Union[Receipts, _Mapping]]] = ...) -> None: ...

class Receipts(_message.Message):
    __slots__ = ("sender_incarnation", "base", "forgotten_up_to", "sequences", "segments")
    SENDER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    FORGOTTEN_UP_TO_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    sender_incarnation: int
    base: int
    forgotten_up_to: int
    sequences: _containers.RepeatedScalarFieldContainer[int]
    segments: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sender_incarnation: _Optional[int] = ..., base: _Optional[int] = ..., forgotten_up_to: _Optional[int] = ..., sequences: _Optional[_Iterable[int]] = ..., segments: _Optional[_Iterable[int]] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PeersRequest(_message.Message):
    __slots__ = ("mesh_id", "sender", "known")
    MESH_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    mesh_id: str
    sender: NodeInfo
    known: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    def __init__(self, mesh_id: _Optional[str] = ..., sender: _Optional[_Union[NodeInfo, _Mapping]] = ..., known: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ...) -> None: ...

class PeersReply(_message.Message):
    __slots__ = ("peers",)
    PEERS_FIELD_NUMBER: _ClassVar[int]
    peers: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    def __init__(self, peers: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("checksum", "sketch_size")
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    SKETCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    checksum: bool
    sketch_size: int
    def __init__(self, checksum: _Optional[bool] = ..., sketch_size: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("node_id", "mesh_id", "step", "sum_weights", "live_peers", "fingerprint", "params_checksum", "protocol", "loss", "pushes_in_flight", "training_done", "pushes_acked", "pushes_failed", "pushes_merged", "peers", "suspected_peers", "rejected", "reserved_weights", "round", "membership_epoch", "transport_security", "exchanged", "mass_inconsistencies", "wait_s", "wait_fraction", "scheduling", "eval", "eval_step", "model_sketch", "pulls", "ranks", "crash", "weight_cut", "reach", "relay_bytes")
    class RejectedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class EvalEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class PullsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MESH_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SUM_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    LIVE_PEERS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PARAMS_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    PUSHES_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    TRAINING_DONE_FIELD_NUMBER: _ClassVar[int]
    PUSHES_ACKED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_FAILED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_MERGED_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    SUSPECTED_PEERS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    RESERVED_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_SECURITY_FIELD_NUMBER: _ClassVar[int]
    EXCHANGED_FIELD_NUMBER: _ClassVar[int]
    MASS_INCONSISTENCIES_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_FRACTION_FIELD_NUMBER: _ClassVar[int]
    SCHEDULING_FIELD_NUMBER: _ClassVar[int]
    EVAL_FIELD_NUMBER: _ClassVar[int]
    EVAL_STEP_FIELD_NUMBER: _ClassVar[int]
    MODEL_SKETCH_FIELD_NUMBER: _ClassVar[int]
    PULLS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    CRASH_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_CUT_FIELD_NUMBER: _ClassVar[int]
    REACH_FIELD_NUMBER: _ClassVar[int]
    RELAY_BYTES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    mesh_id: str
    step: int
    sum_weights: _containers.RepeatedScalarFieldContainer[float]
    live_peers: _containers.RepeatedScalarFieldContainer[str]
    fingerprint: str
    params_checksum: str
    protocol: str
    loss: float
    pushes_in_flight: int
    training_done: bool
    pushes_acked: int
    pushes_failed: int
    pushes_merged: int
    peers: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    suspected_peers: _containers.RepeatedScalarFieldContainer[str]
    rejected: _containers.ScalarMap[str, int]
    reserved_weights: _containers.RepeatedScalarFieldContainer[float]
    round: int
    membership_epoch: int
    transport_security: str
    exchanged: _containers.RepeatedCompositeFieldContainer[PeerMass]
    mass_inconsistencies: int
    wait_s: float
    wait_fraction: float
    scheduling: str
    eval: _containers.ScalarMap[str, float]
    eval_step: int
    model_sketch: _containers.RepeatedScalarFieldContainer[float]
    pulls: _containers.ScalarMap[str, int]
    ranks: int
    crash: CrashAudit
    weight_cut: float
    reach: str
    relay_bytes: int
    def __init__(self, node_id: _Optional[str] = ..., mesh_id: _Optional[str] = ..., step: _Optional[int] = ..., sum_weights: _Optional[_Iterable[float]] = ..., live_peers: _Optional[_Iterable[str]] = ..., fingerprint: _Optional[str] = ..., params_checksum: _Optional[str] = ..., protocol: _Optional[str] = ..., loss: _Optional[float] = ..., pushes_in_flight: _Optional[int] = ..., training_done: _Optional[bool] = ..., pushes_acked: _Optional[int] = ..., pushes_failed: _Optional[int] = ..., pushes_merged: _Optional[int] = ..., peers: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ..., suspected_peers: _Optional[_Iterable[str]] = ..., rejected: _Optional[_Mapping[str, int]] = ..., reserved_weights: _Optional[_Iterable[float]] = ..., round: _Optional[int] = ..., membership_epoch: _Optional[int] = ..., transport_security: _Optional[str] = ..., exchanged: _Optional[_Iterable[_Union[PeerMass, _Mapping]]] = ..., mass_inconsistencies: _Optional[int] = ..., wait_s: _Optional[float] = ..., wait_fraction: _Optional[float] = ..., scheduling: _Optional[str] = ..., eval: _Optional[_Mapping[str, float]] = ..., eval_step: _Optional[int] = ..., model_sketch: _Optional[_Iterable[float]] = ..., pulls: _Optional[_Mapping[str, int]] = ..., ranks: _Optional[int] = ..., crash: _Optional[_Union[CrashAudit, _Mapping]] = ..., weight_cut: _Optional[float] = ..., reach: _Optional[str] = ..., relay_bytes: _Optional[int] = ...) -> None: ...

class CrashAudit(_message.Message):
    __slots__ = ("resumed", "done", "weight_lost", "merged_after", "sent_after", "peers_answered", "peers_asked", "checkpoint_step")
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_LOST_FIELD_NUMBER: _ClassVar[int]
    MERGED_AFTER_FIELD_NUMBER: _ClassVar[int]
    SENT_AFTER_FIELD_NUMBER: _ClassVar[int]
    PEERS_ANSWERED_FIELD_NUMBER: _ClassVar[int]
    PEERS_ASKED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    resumed: bool
    done: bool
    weight_lost: float
    merged_after: float
    sent_after: float
    peers_answered: int
    peers_asked: int
    checkpoint_step: int
    def __init__(self, resumed: _Optional[bool] = ..., done: _Optional[bool] = ..., weight_lost: _Optional[float] = ..., merged_after: _Optional[float] = ..., sent_after: _Optional[float] = ..., peers_answered: _Optional[int] = ..., peers_asked: _Optional[int] = ..., checkpoint_step: _Optional[int] = ...) -> None: ...

class PeerMass(_message.Message):
    __slots__ = ("node_id", "sent", "received", "sent_before", "received_before", "incarnation")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SENT_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    SENT_BEFORE_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BEFORE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    sent: float
    received: float
    sent_before: float
    received_before: float
    incarnation: int
    def __init__(self, node_id: _Optional[str] = ..., sent: _Optional[float] = ..., received: _Optional[float] = ..., sent_before: _Optional[float] = ..., received_before: _Optional[float] = ..., incarnation: _Optional[int] = ...) -> None: ...
