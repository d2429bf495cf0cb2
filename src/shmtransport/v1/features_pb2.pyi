from shmtransport.v1 import daemon_pb2 as _daemon_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Modality(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODALITY_UNSPECIFIED: _ClassVar[Modality]
    MODALITY_IMAGE: _ClassVar[Modality]
    MODALITY_AUDIO: _ClassVar[Modality]
    MODALITY_VIDEO: _ClassVar[Modality]

class FieldKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FIELD_KIND_UNSPECIFIED: _ClassVar[FieldKind]
    FIELD_KIND_BATCHED: _ClassVar[FieldKind]
    FIELD_KIND_FLAT: _ClassVar[FieldKind]
    FIELD_KIND_SHARED: _ClassVar[FieldKind]

class IdentityScheme(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    IDENTITY_SCHEME_UNSPECIFIED: _ClassVar[IdentityScheme]
    IDENTITY_SCHEME_XXH3_128: _ClassVar[IdentityScheme]
    IDENTITY_SCHEME_BLAKE3: _ClassVar[IdentityScheme]
    IDENTITY_SCHEME_GRPC_MM: _ClassVar[IdentityScheme]
MODALITY_UNSPECIFIED: Modality
MODALITY_IMAGE: Modality
MODALITY_AUDIO: Modality
MODALITY_VIDEO: Modality
FIELD_KIND_UNSPECIFIED: FieldKind
FIELD_KIND_BATCHED: FieldKind
FIELD_KIND_FLAT: FieldKind
FIELD_KIND_SHARED: FieldKind
IDENTITY_SCHEME_UNSPECIFIED: IdentityScheme
IDENTITY_SCHEME_XXH3_128: IdentityScheme
IDENTITY_SCHEME_BLAKE3: IdentityScheme
IDENTITY_SCHEME_GRPC_MM: IdentityScheme

class RemoteTensorHandle(_message.Message):
    __slots__ = ("transport", "descriptor", "nbytes")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    transport: str
    descriptor: bytes
    nbytes: int
    def __init__(self, transport: _Optional[str] = ..., descriptor: _Optional[bytes] = ..., nbytes: _Optional[int] = ...) -> None: ...

class TensorData(_message.Message):
    __slots__ = ("shape", "dtype", "inline", "shm", "remote", "digest", "commit_token")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    INLINE_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    COMMIT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    inline: bytes
    shm: _daemon_pb2.Handle
    remote: RemoteTensorHandle
    digest: bytes
    commit_token: bytes
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., inline: _Optional[bytes] = ..., shm: _Optional[_Union[_daemon_pb2.Handle, _Mapping]] = ..., remote: _Optional[_Union[RemoteTensorHandle, _Mapping]] = ..., digest: _Optional[bytes] = ..., commit_token: _Optional[bytes] = ...) -> None: ...

class PlaceholderRange(_message.Message):
    __slots__ = ("offset", "length", "is_embed", "is_embed_nbits")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    IS_EMBED_FIELD_NUMBER: _ClassVar[int]
    IS_EMBED_NBITS_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    is_embed: bytes
    is_embed_nbits: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ..., is_embed: _Optional[bytes] = ..., is_embed_nbits: _Optional[int] = ...) -> None: ...

class Slice(_message.Message):
    __slots__ = ("start", "stop", "step")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    start: int
    stop: int
    step: int
    def __init__(self, start: _Optional[int] = ..., stop: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class SliceSpec(_message.Message):
    __slots__ = ("slices", "nested")
    SLICES_FIELD_NUMBER: _ClassVar[int]
    NESTED_FIELD_NUMBER: _ClassVar[int]
    slices: _containers.RepeatedCompositeFieldContainer[Slice]
    nested: bool
    def __init__(self, slices: _Optional[_Iterable[_Union[Slice, _Mapping]]] = ..., nested: _Optional[bool] = ...) -> None: ...

class FieldLayout(_message.Message):
    __slots__ = ("kind", "keep_on_cpu", "slices", "dim", "batch_size")
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEEP_ON_CPU_FIELD_NUMBER: _ClassVar[int]
    SLICES_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    kind: FieldKind
    keep_on_cpu: bool
    slices: _containers.RepeatedCompositeFieldContainer[SliceSpec]
    dim: int
    batch_size: int
    def __init__(self, kind: _Optional[_Union[FieldKind, str]] = ..., keep_on_cpu: _Optional[bool] = ..., slices: _Optional[_Iterable[_Union[SliceSpec, _Mapping]]] = ..., dim: _Optional[int] = ..., batch_size: _Optional[int] = ...) -> None: ...

class Kwarg(_message.Message):
    __slots__ = ("tensor", "field")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    tensor: TensorData
    field: FieldLayout
    def __init__(self, tensor: _Optional[_Union[TensorData, _Mapping]] = ..., field: _Optional[_Union[FieldLayout, _Mapping]] = ...) -> None: ...

class MultimodalItem(_message.Message):
    __slots__ = ("kwargs", "kwargs_msgpack", "placeholder", "mm_hash", "cache_identifier", "routing_marker")
    class KwargsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Kwarg
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Kwarg, _Mapping]] = ...) -> None: ...
    KWARGS_FIELD_NUMBER: _ClassVar[int]
    KWARGS_MSGPACK_FIELD_NUMBER: _ClassVar[int]
    PLACEHOLDER_FIELD_NUMBER: _ClassVar[int]
    MM_HASH_FIELD_NUMBER: _ClassVar[int]
    CACHE_IDENTIFIER_FIELD_NUMBER: _ClassVar[int]
    ROUTING_MARKER_FIELD_NUMBER: _ClassVar[int]
    kwargs: _containers.MessageMap[str, Kwarg]
    kwargs_msgpack: bytes
    placeholder: PlaceholderRange
    mm_hash: str
    cache_identifier: str
    routing_marker: str
    def __init__(self, kwargs: _Optional[_Mapping[str, Kwarg]] = ..., kwargs_msgpack: _Optional[bytes] = ..., placeholder: _Optional[_Union[PlaceholderRange, _Mapping]] = ..., mm_hash: _Optional[str] = ..., cache_identifier: _Optional[str] = ..., routing_marker: _Optional[str] = ...) -> None: ...

class MultimodalInputs(_message.Message):
    __slots__ = ("pixel_values", "model_specific_tensors", "im_token_id", "mm_placeholders", "mm_hashes", "batched_keys", "flat_keys", "keep_on_cpu_keys", "modality", "encoder_input_key", "items", "identity_scheme", "adapter")
    class ModelSpecificTensorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: TensorData
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[TensorData, _Mapping]] = ...) -> None: ...
    class FlatKeysEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PIXEL_VALUES_FIELD_NUMBER: _ClassVar[int]
    MODEL_SPECIFIC_TENSORS_FIELD_NUMBER: _ClassVar[int]
    IM_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    MM_PLACEHOLDERS_FIELD_NUMBER: _ClassVar[int]
    MM_HASHES_FIELD_NUMBER: _ClassVar[int]
    BATCHED_KEYS_FIELD_NUMBER: _ClassVar[int]
    FLAT_KEYS_FIELD_NUMBER: _ClassVar[int]
    KEEP_ON_CPU_KEYS_FIELD_NUMBER: _ClassVar[int]
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    ENCODER_INPUT_KEY_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_SCHEME_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    pixel_values: TensorData
    model_specific_tensors: _containers.MessageMap[str, TensorData]
    im_token_id: int
    mm_placeholders: _containers.RepeatedCompositeFieldContainer[PlaceholderRange]
    mm_hashes: _containers.RepeatedScalarFieldContainer[str]
    batched_keys: _containers.RepeatedScalarFieldContainer[str]
    flat_keys: _containers.ScalarMap[str, str]
    keep_on_cpu_keys: _containers.RepeatedScalarFieldContainer[str]
    modality: Modality
    encoder_input_key: str
    items: _containers.RepeatedCompositeFieldContainer[MultimodalItem]
    identity_scheme: IdentityScheme
    adapter: str
    def __init__(self, pixel_values: _Optional[_Union[TensorData, _Mapping]] = ..., model_specific_tensors: _Optional[_Mapping[str, TensorData]] = ..., im_token_id: _Optional[int] = ..., mm_placeholders: _Optional[_Iterable[_Union[PlaceholderRange, _Mapping]]] = ..., mm_hashes: _Optional[_Iterable[str]] = ..., batched_keys: _Optional[_Iterable[str]] = ..., flat_keys: _Optional[_Mapping[str, str]] = ..., keep_on_cpu_keys: _Optional[_Iterable[str]] = ..., modality: _Optional[_Union[Modality, str]] = ..., encoder_input_key: _Optional[str] = ..., items: _Optional[_Iterable[_Union[MultimodalItem, _Mapping]]] = ..., identity_scheme: _Optional[_Union[IdentityScheme, str]] = ..., adapter: _Optional[str] = ...) -> None: ...

class RawMedia(_message.Message):
    __slots__ = ("modality", "url", "data_uri", "raw_bytes", "mime_type", "uuid")
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    DATA_URI_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    modality: Modality
    url: str
    data_uri: str
    raw_bytes: bytes
    mime_type: str
    uuid: str
    def __init__(self, modality: _Optional[_Union[Modality, str]] = ..., url: _Optional[str] = ..., data_uri: _Optional[str] = ..., raw_bytes: _Optional[bytes] = ..., mime_type: _Optional[str] = ..., uuid: _Optional[str] = ...) -> None: ...

class MultimodalRequest(_message.Message):
    __slots__ = ("batches", "raw_media", "prompt_len")
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    RAW_MEDIA_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    batches: _containers.RepeatedCompositeFieldContainer[MultimodalInputs]
    raw_media: _containers.RepeatedCompositeFieldContainer[RawMedia]
    prompt_len: int
    def __init__(self, batches: _Optional[_Iterable[_Union[MultimodalInputs, _Mapping]]] = ..., raw_media: _Optional[_Iterable[_Union[RawMedia, _Mapping]]] = ..., prompt_len: _Optional[int] = ...) -> None: ...
