from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SessionAccess(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_ACCESS_UNSPECIFIED: _ClassVar[SessionAccess]
    SESSION_ACCESS_READ_WRITE: _ClassVar[SessionAccess]
    SESSION_ACCESS_READ_ONLY: _ClassVar[SessionAccess]
SESSION_ACCESS_UNSPECIFIED: SessionAccess
SESSION_ACCESS_READ_WRITE: SessionAccess
SESSION_ACCESS_READ_ONLY: SessionAccess

class Handle(_message.Message):
    __slots__ = ("name", "offset", "nbytes", "owner_id", "generation", "instance_id", "slot")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    nbytes: int
    owner_id: str
    generation: int
    instance_id: str
    slot: int
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., owner_id: _Optional[str] = ..., generation: _Optional[int] = ..., instance_id: _Optional[str] = ..., slot: _Optional[int] = ...) -> None: ...

class TensorHandle(_message.Message):
    __slots__ = ("shm", "dtype", "shape", "digest", "commit_token")
    SHM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    COMMIT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    shm: Handle
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    digest: bytes
    commit_token: bytes
    def __init__(self, shm: _Optional[_Union[Handle, _Mapping]] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., digest: _Optional[bytes] = ..., commit_token: _Optional[bytes] = ...) -> None: ...

class ArenaInfo(_message.Message):
    __slots__ = ("instance_id", "segment_name", "nbytes", "shm_namespace")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_NAME_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    segment_name: str
    nbytes: int
    shm_namespace: str
    def __init__(self, instance_id: _Optional[str] = ..., segment_name: _Optional[str] = ..., nbytes: _Optional[int] = ..., shm_namespace: _Optional[str] = ...) -> None: ...

class LoanRequest(_message.Message):
    __slots__ = ("nbytes", "wait_ms", "release", "dedicated")
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    DEDICATED_FIELD_NUMBER: _ClassVar[int]
    nbytes: _containers.RepeatedScalarFieldContainer[int]
    wait_ms: int
    release: ReleaseRequest
    dedicated: bool
    def __init__(self, nbytes: _Optional[_Iterable[int]] = ..., wait_ms: _Optional[int] = ..., release: _Optional[_Union[ReleaseRequest, _Mapping]] = ..., dedicated: _Optional[bool] = ...) -> None: ...

class LoanResponse(_message.Message):
    __slots__ = ("handles", "commit_tokens")
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    COMMIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    handles: _containers.RepeatedCompositeFieldContainer[Handle]
    commit_tokens: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, handles: _Optional[_Iterable[_Union[Handle, _Mapping]]] = ..., commit_tokens: _Optional[_Iterable[bytes]] = ...) -> None: ...

class GrantRequest(_message.Message):
    __slots__ = ("nbytes", "nslots", "wait_ms", "give_back", "retry")
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    NSLOTS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    GIVE_BACK_FIELD_NUMBER: _ClassVar[int]
    RETRY_FIELD_NUMBER: _ClassVar[int]
    nbytes: int
    nslots: int
    wait_ms: int
    give_back: _containers.RepeatedScalarFieldContainer[int]
    retry: bool
    def __init__(self, nbytes: _Optional[int] = ..., nslots: _Optional[int] = ..., wait_ms: _Optional[int] = ..., give_back: _Optional[_Iterable[int]] = ..., retry: _Optional[bool] = ...) -> None: ...

class GrantResponse(_message.Message):
    __slots__ = ("grant_id", "offset", "nbytes", "first_slot", "nslots")
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    FIRST_SLOT_FIELD_NUMBER: _ClassVar[int]
    NSLOTS_FIELD_NUMBER: _ClassVar[int]
    grant_id: int
    offset: int
    nbytes: int
    first_slot: int
    nslots: int
    def __init__(self, grant_id: _Optional[int] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., first_slot: _Optional[int] = ..., nslots: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("handles", "hold_ms", "release_reference", "release")
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    HOLD_MS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_REFERENCE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    handles: _containers.RepeatedCompositeFieldContainer[Handle]
    hold_ms: int
    release_reference: bool
    release: ReleaseRequest
    def __init__(self, handles: _Optional[_Iterable[_Union[Handle, _Mapping]]] = ..., hold_ms: _Optional[int] = ..., release_reference: _Optional[bool] = ..., release: _Optional[_Union[ReleaseRequest, _Mapping]] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("handles", "ttl_ms", "commit_tokens", "release")
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    handles: _containers.RepeatedCompositeFieldContainer[Handle]
    ttl_ms: int
    commit_tokens: _containers.RepeatedScalarFieldContainer[bytes]
    release: ReleaseRequest
    def __init__(self, handles: _Optional[_Iterable[_Union[Handle, _Mapping]]] = ..., ttl_ms: _Optional[int] = ..., commit_tokens: _Optional[_Iterable[bytes]] = ..., release: _Optional[_Union[ReleaseRequest, _Mapping]] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("lease_ids",)
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("handles", "lease_ids", "skip_gone")
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_GONE_FIELD_NUMBER: _ClassVar[int]
    handles: _containers.RepeatedCompositeFieldContainer[Handle]
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_gone: bool
    def __init__(self, handles: _Optional[_Iterable[_Union[Handle, _Mapping]]] = ..., lease_ids: _Optional[_Iterable[int]] = ..., skip_gone: _Optional[bool] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClientStat(_message.Message):
    __slots__ = ("session_id", "pid", "uid", "loaned_nbytes", "committed_nbytes", "leases", "table_leases", "table_loaned_nbytes", "table_committed_nbytes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    LOANED_NBYTES_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_NBYTES_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    TABLE_LEASES_FIELD_NUMBER: _ClassVar[int]
    TABLE_LOANED_NBYTES_FIELD_NUMBER: _ClassVar[int]
    TABLE_COMMITTED_NBYTES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    pid: int
    uid: int
    loaned_nbytes: int
    committed_nbytes: int
    leases: int
    table_leases: int
    table_loaned_nbytes: int
    table_committed_nbytes: int
    def __init__(self, session_id: _Optional[str] = ..., pid: _Optional[int] = ..., uid: _Optional[int] = ..., loaned_nbytes: _Optional[int] = ..., committed_nbytes: _Optional[int] = ..., leases: _Optional[int] = ..., table_leases: _Optional[int] = ..., table_loaned_nbytes: _Optional[int] = ..., table_committed_nbytes: _Optional[int] = ...) -> None: ...

class StatResponse(_message.Message):
    __slots__ = ("arena", "used_nbytes", "free_nbytes", "largest_free_nbytes", "free_extents", "live_objects", "live_leases", "clients", "allocations_total", "allocations_per_s", "reclaimed_ttl_nbytes", "reclaimed_ttl_leases", "reclaimed_death_nbytes", "reclaimed_death_leases", "allocation_failures", "sessions_total", "tenant", "quota_nbytes", "quota_leases", "dedicated_nbytes", "quarantined_leases", "quarantined_nbytes", "quarantined_leases_total", "granted_nbytes", "table_objects", "handoff_objects", "reclaimed_handoff_objects", "reclaimed_handoff_nbytes", "sessions_closed", "released_at_close_leases", "released_at_close_nbytes", "waiting_calls", "reclaimed_death_loans", "released_at_close_loans", "observer_sessions_closed", "index_entries", "index_nbytes", "index_budget_nbytes", "index_hits", "index_misses", "index_published", "index_duplicates", "index_evictions", "cpu_share_waits", "cpu_share_refusals")
    ARENA_FIELD_NUMBER: _ClassVar[int]
    USED_NBYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_NBYTES_FIELD_NUMBER: _ClassVar[int]
    LARGEST_FREE_NBYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_EXTENTS_FIELD_NUMBER: _ClassVar[int]
    LIVE_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    LIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    ALLOCATIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ALLOCATIONS_PER_S_FIELD_NUMBER: _ClassVar[int]
    RECLAIMED_TTL_NBYTES_FIELD_NUMBER: _ClassVar[int]
    RECLAIMED_TTL_LEASES_FIELD_NUMBER: _ClassVar[int]
    RECLAIMED_DEATH_NBYTES_FIELD_NUMBER: _ClassVar[int]
    RECLAIMED_DEATH_LEASES_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_FAILURES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    QUOTA_NBYTES_FIELD_NUMBER: _ClassVar[int]
    QUOTA_LEASES_FIELD_NUMBER: _ClassVar[int]
    DEDICATED_NBYTES_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_LEASES_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_NBYTES_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_LEASES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GRANTED_NBYTES_FIELD_NUMBER: _ClassVar[int]
    TABLE_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    RECLAIMED_HANDOFF_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    RECLAIMED_HANDOFF_NBYTES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_CLOSED_FIELD_NUMBER: _ClassVar[int]
    RELEASED_AT_CLOSE_LEASES_FIELD_NUMBER: _ClassVar[int]
    RELEASED_AT_CLOSE_NBYTES_FIELD_NUMBER: _ClassVar[int]
    WAITING_CALLS_FIELD_NUMBER: _ClassVar[int]
    RECLAIMED_DEATH_LOANS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_AT_CLOSE_LOANS_FIELD_NUMBER: _ClassVar[int]
    OBSERVER_SESSIONS_CLOSED_FIELD_NUMBER: _ClassVar[int]
    INDEX_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    INDEX_NBYTES_FIELD_NUMBER: _ClassVar[int]
    INDEX_BUDGET_NBYTES_FIELD_NUMBER: _ClassVar[int]
    INDEX_HITS_FIELD_NUMBER: _ClassVar[int]
    INDEX_MISSES_FIELD_NUMBER: _ClassVar[int]
    INDEX_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    INDEX_DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    INDEX_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    CPU_SHARE_WAITS_FIELD_NUMBER: _ClassVar[int]
    CPU_SHARE_REFUSALS_FIELD_NUMBER: _ClassVar[int]
    arena: ArenaInfo
    used_nbytes: int
    free_nbytes: int
    largest_free_nbytes: int
    free_extents: int
    live_objects: int
    live_leases: int
    clients: _containers.RepeatedCompositeFieldContainer[ClientStat]
    allocations_total: int
    allocations_per_s: float
    reclaimed_ttl_nbytes: int
    reclaimed_ttl_leases: int
    reclaimed_death_nbytes: int
    reclaimed_death_leases: int
    allocation_failures: int
    sessions_total: int
    tenant: str
    quota_nbytes: int
    quota_leases: int
    dedicated_nbytes: int
    quarantined_leases: int
    quarantined_nbytes: int
    quarantined_leases_total: int
    granted_nbytes: int
    table_objects: int
    handoff_objects: int
    reclaimed_handoff_objects: int
    reclaimed_handoff_nbytes: int
    sessions_closed: int
    released_at_close_leases: int
    released_at_close_nbytes: int
    waiting_calls: int
    reclaimed_death_loans: int
    released_at_close_loans: int
    observer_sessions_closed: int
    index_entries: int
    index_nbytes: int
    index_budget_nbytes: int
    index_hits: int
    index_misses: int
    index_published: int
    index_duplicates: int
    index_evictions: int
    cpu_share_waits: int
    cpu_share_refusals: int
    def __init__(self, arena: _Optional[_Union[ArenaInfo, _Mapping]] = ..., used_nbytes: _Optional[int] = ..., free_nbytes: _Optional[int] = ..., largest_free_nbytes: _Optional[int] = ..., free_extents: _Optional[int] = ..., live_objects: _Optional[int] = ..., live_leases: _Optional[int] = ..., clients: _Optional[_Iterable[_Union[ClientStat, _Mapping]]] = ..., allocations_total: _Optional[int] = ..., allocations_per_s: _Optional[float] = ..., reclaimed_ttl_nbytes: _Optional[int] = ..., reclaimed_ttl_leases: _Optional[int] = ..., reclaimed_death_nbytes: _Optional[int] = ..., reclaimed_death_leases: _Optional[int] = ..., allocation_failures: _Optional[int] = ..., sessions_total: _Optional[int] = ..., tenant: _Optional[str] = ..., quota_nbytes: _Optional[int] = ..., quota_leases: _Optional[int] = ..., dedicated_nbytes: _Optional[int] = ..., quarantined_leases: _Optional[int] = ..., quarantined_nbytes: _Optional[int] = ..., quarantined_leases_total: _Optional[int] = ..., granted_nbytes: _Optional[int] = ..., table_objects: _Optional[int] = ..., handoff_objects: _Optional[int] = ..., reclaimed_handoff_objects: _Optional[int] = ..., reclaimed_handoff_nbytes: _Optional[int] = ..., sessions_closed: _Optional[int] = ..., released_at_close_leases: _Optional[int] = ..., released_at_close_nbytes: _Optional[int] = ..., waiting_calls: _Optional[int] = ..., reclaimed_death_loans: _Optional[int] = ..., released_at_close_loans: _Optional[int] = ..., observer_sessions_closed: _Optional[int] = ..., index_entries: _Optional[int] = ..., index_nbytes: _Optional[int] = ..., index_budget_nbytes: _Optional[int] = ..., index_hits: _Optional[int] = ..., index_misses: _Optional[int] = ..., index_published: _Optional[int] = ..., index_duplicates: _Optional[int] = ..., index_evictions: _Optional[int] = ..., cpu_share_waits: _Optional[int] = ..., cpu_share_refusals: _Optional[int] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("scope", "identity", "tensor")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    scope: bytes
    identity: bytes
    tensor: TensorHandle
    def __init__(self, scope: _Optional[bytes] = ..., identity: _Optional[bytes] = ..., tensor: _Optional[_Union[TensorHandle, _Mapping]] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("tensor", "published")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    tensor: TensorHandle
    published: bool
    def __init__(self, tensor: _Optional[_Union[TensorHandle, _Mapping]] = ..., published: _Optional[bool] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("scope", "identities")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    IDENTITIES_FIELD_NUMBER: _ClassVar[int]
    scope: bytes
    identities: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, scope: _Optional[bytes] = ..., identities: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorHandle]
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorHandle, _Mapping]]] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CloseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class ObjectInfo(_message.Message):
    __slots__ = ("offset", "nbytes", "generation", "slot", "state", "handoff", "owner_session", "owner_pid", "holder_pids", "holder_sessions", "age_s", "segment_name", "producer_held", "quarantined_leases", "identity")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    OWNER_SESSION_FIELD_NUMBER: _ClassVar[int]
    OWNER_PID_FIELD_NUMBER: _ClassVar[int]
    HOLDER_PIDS_FIELD_NUMBER: _ClassVar[int]
    HOLDER_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_NAME_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_HELD_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_LEASES_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    offset: int
    nbytes: int
    generation: int
    slot: int
    state: str
    handoff: bool
    owner_session: str
    owner_pid: int
    holder_pids: _containers.RepeatedScalarFieldContainer[int]
    holder_sessions: _containers.RepeatedScalarFieldContainer[str]
    age_s: float
    segment_name: str
    producer_held: bool
    quarantined_leases: int
    identity: str
    def __init__(self, offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., generation: _Optional[int] = ..., slot: _Optional[int] = ..., state: _Optional[str] = ..., handoff: _Optional[bool] = ..., owner_session: _Optional[str] = ..., owner_pid: _Optional[int] = ..., holder_pids: _Optional[_Iterable[int]] = ..., holder_sessions: _Optional[_Iterable[str]] = ..., age_s: _Optional[float] = ..., segment_name: _Optional[str] = ..., producer_held: _Optional[bool] = ..., quarantined_leases: _Optional[int] = ..., identity: _Optional[str] = ...) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("tenant", "objects", "total_objects", "clients")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    objects: _containers.RepeatedCompositeFieldContainer[ObjectInfo]
    total_objects: int
    clients: _containers.RepeatedCompositeFieldContainer[ClientStat]
    def __init__(self, tenant: _Optional[str] = ..., objects: _Optional[_Iterable[_Union[ObjectInfo, _Mapping]]] = ..., total_objects: _Optional[int] = ..., clients: _Optional[_Iterable[_Union[ClientStat, _Mapping]]] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("access",)
    ACCESS_FIELD_NUMBER: _ClassVar[int]
    access: SessionAccess
    def __init__(self, access: _Optional[_Union[SessionAccess, str]] = ...) -> None: ...

class ObjectTableInfo(_message.Message):
    __slots__ = ("segment_name", "nslots", "handoff_window_ms", "max_hold_ms", "holds_segment_name")
    SEGMENT_NAME_FIELD_NUMBER: _ClassVar[int]
    NSLOTS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_WINDOW_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_HOLD_MS_FIELD_NUMBER: _ClassVar[int]
    HOLDS_SEGMENT_NAME_FIELD_NUMBER: _ClassVar[int]
    segment_name: str
    nslots: int
    handoff_window_ms: int
    max_hold_ms: int
    holds_segment_name: str
    def __init__(self, segment_name: _Optional[str] = ..., nslots: _Optional[int] = ..., handoff_window_ms: _Optional[int] = ..., max_hold_ms: _Optional[int] = ..., holds_segment_name: _Optional[str] = ...) -> None: ...

class SessionHello(_message.Message):
    __slots__ = ("session_id", "token", "instance_id", "segment_name", "arena_nbytes", "shm_namespace", "tenant", "pid", "object_table", "holder_bit")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_NAME_FIELD_NUMBER: _ClassVar[int]
    ARENA_NBYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    OBJECT_TABLE_FIELD_NUMBER: _ClassVar[int]
    HOLDER_BIT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token: str
    instance_id: str
    segment_name: str
    arena_nbytes: int
    shm_namespace: str
    tenant: str
    pid: int
    object_table: ObjectTableInfo
    holder_bit: int
    def __init__(self, session_id: _Optional[str] = ..., token: _Optional[str] = ..., instance_id: _Optional[str] = ..., segment_name: _Optional[str] = ..., arena_nbytes: _Optional[int] = ..., shm_namespace: _Optional[str] = ..., tenant: _Optional[str] = ..., pid: _Optional[int] = ..., object_table: _Optional[_Union[ObjectTableInfo, _Mapping]] = ..., holder_bit: _Optional[int] = ...) -> None: ...

class SessionRefusal(_message.Message):
    __slots__ = ("reason", "message")
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    reason: str
    message: str
    def __init__(self, reason: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class SessionReply(_message.Message):
    __slots__ = ("hello", "refusal")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    hello: SessionHello
    refusal: SessionRefusal
    def __init__(self, hello: _Optional[_Union[SessionHello, _Mapping]] = ..., refusal: _Optional[_Union[SessionRefusal, _Mapping]] = ...) -> None: ...
