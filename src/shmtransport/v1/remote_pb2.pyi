from shmtransport.v1 import daemon_pb2 as _daemon_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NixlDescriptor(_message.Message):
    __slots__ = ("version", "endpoint", "agent_name", "shm_namespace", "tensor")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    SHM_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    version: int
    endpoint: str
    agent_name: str
    shm_namespace: str
    tensor: _daemon_pb2.TensorHandle
    def __init__(self, version: _Optional[int] = ..., endpoint: _Optional[str] = ..., agent_name: _Optional[str] = ..., shm_namespace: _Optional[str] = ..., tensor: _Optional[_Union[_daemon_pb2.TensorHandle, _Mapping]] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RemoteInfo(_message.Message):
    __slots__ = ("instance_id", "shm_namespace", "endpoint", "agent_name", "transport")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    shm_namespace: str
    endpoint: str
    agent_name: str
    transport: str
    def __init__(self, instance_id: _Optional[str] = ..., shm_namespace: _Optional[str] = ..., endpoint: _Optional[str] = ..., agent_name: _Optional[str] = ..., transport: _Optional[str] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("peer_name",)
    PEER_NAME_FIELD_NUMBER: _ClassVar[int]
    peer_name: str
    def __init__(self, peer_name: _Optional[str] = ...) -> None: ...

class AttachEvent(_message.Message):
    __slots__ = ("session_token", "agent_name", "agent_metadata", "instance_id", "shm_namespace")
    SESSION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    session_token: str
    agent_name: str
    agent_metadata: bytes
    instance_id: str
    shm_namespace: str
    def __init__(self, session_token: _Optional[str] = ..., agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., instance_id: _Optional[str] = ..., shm_namespace: _Optional[str] = ...) -> None: ...

class NixlRegion(_message.Message):
    __slots__ = ("addr", "nbytes", "dev_id")
    ADDR_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    DEV_ID_FIELD_NUMBER: _ClassVar[int]
    addr: int
    nbytes: int
    dev_id: int
    def __init__(self, addr: _Optional[int] = ..., nbytes: _Optional[int] = ..., dev_id: _Optional[int] = ...) -> None: ...

class RemoteAcquireRequest(_message.Message):
    __slots__ = ("tensors", "ttl_ms")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[_daemon_pb2.TensorHandle]
    ttl_ms: int
    def __init__(self, tensors: _Optional[_Iterable[_Union[_daemon_pb2.TensorHandle, _Mapping]]] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class RemoteAcquireResponse(_message.Message):
    __slots__ = ("lease_ids", "regions")
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    regions: _containers.RepeatedCompositeFieldContainer[NixlRegion]
    def __init__(self, lease_ids: _Optional[_Iterable[int]] = ..., regions: _Optional[_Iterable[_Union[NixlRegion, _Mapping]]] = ...) -> None: ...

class RemoteReleaseRequest(_message.Message):
    __slots__ = ("lease_ids",)
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class RemoteReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
