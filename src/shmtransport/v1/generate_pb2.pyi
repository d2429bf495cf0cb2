from shmtransport.v1 import features_pb2 as _features_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_NOT_FINISHED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_ABORTED: _ClassVar[FinishReason]
FINISH_REASON_NOT_FINISHED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_ABORTED: FinishReason

class SamplingControls(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs", "prompt_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    logprobs: int
    prompt_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class StoppingControls(_message.Message):
    __slots__ = ("max_tokens", "min_tokens", "stop", "stop_token_ids", "include_stop_str_in_output", "ignore_eos")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    min_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    include_stop_str_in_output: bool
    ignore_eos: bool
    def __init__(self, max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., include_stop_str_in_output: _Optional[bool] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class ResponseControls(_message.Message):
    __slots__ = ("skip_special_tokens", "output_token_ids", "spaces_between_special_tokens", "return_sampling_mask")
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETURN_SAMPLING_MASK_FIELD_NUMBER: _ClassVar[int]
    skip_special_tokens: bool
    output_token_ids: bool
    spaces_between_special_tokens: bool
    return_sampling_mask: bool
    def __init__(self, skip_special_tokens: _Optional[bool] = ..., output_token_ids: _Optional[bool] = ..., spaces_between_special_tokens: _Optional[bool] = ..., return_sampling_mask: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "multimodal", "sampling", "stopping", "response", "lora_name", "cache_salt", "priority", "model")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MULTIMODAL_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: TokenIds
    text: str
    multimodal: _features_pb2.MultimodalRequest
    sampling: SamplingControls
    stopping: StoppingControls
    response: ResponseControls
    lora_name: str
    cache_salt: str
    priority: int
    model: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., text: _Optional[str] = ..., multimodal: _Optional[_Union[_features_pb2.MultimodalRequest, _Mapping]] = ..., sampling: _Optional[_Union[SamplingControls, _Mapping]] = ..., stopping: _Optional[_Union[StoppingControls, _Mapping]] = ..., response: _Optional[_Union[ResponseControls, _Mapping]] = ..., lora_name: _Optional[str] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class MatchedStop(_message.Message):
    __slots__ = ("stop_token_id", "eos_token_id", "stop_string")
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    stop_token_id: int
    eos_token_id: int
    stop_string: str
    def __init__(self, stop_token_id: _Optional[int] = ..., eos_token_id: _Optional[int] = ..., stop_string: _Optional[str] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class SamplingMask(_message.Message):
    __slots__ = ("token_ids", "offsets")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateStreamChunk(_message.Message):
    __slots__ = ("index", "num_tokens", "token_ids", "logprobs", "top_logprobs", "terminal", "finish_reason", "matched_stop", "num_output_tokens", "sampling_mask", "num_prompt_tokens")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TERMINAL_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_MASK_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    index: int
    num_tokens: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    terminal: bool
    finish_reason: FinishReason
    matched_stop: MatchedStop
    num_output_tokens: int
    sampling_mask: SamplingMask
    num_prompt_tokens: int
    def __init__(self, index: _Optional[int] = ..., num_tokens: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., terminal: _Optional[bool] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., matched_stop: _Optional[_Union[MatchedStop, _Mapping]] = ..., num_output_tokens: _Optional[int] = ..., sampling_mask: _Optional[_Union[SamplingMask, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "logprobs", "top_logprobs", "finish_reason", "matched_stop", "num_output_tokens", "num_prompt_tokens", "sampling_mask")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_MASK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    finish_reason: FinishReason
    matched_stop: MatchedStop
    num_output_tokens: int
    num_prompt_tokens: int
    sampling_mask: SamplingMask
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., matched_stop: _Optional[_Union[MatchedStop, _Mapping]] = ..., num_output_tokens: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., sampling_mask: _Optional[_Union[SamplingMask, _Mapping]] = ...) -> None: ...

class ServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("shm_namespace_id", "identity_schemes", "supports_native_generate", "max_items", "max_shm_bytes", "max_inline_items", "max_inline_bytes", "supports_dedicated_segments", "bridges")
    SHM_NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_SCHEMES_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_NATIVE_GENERATE_FIELD_NUMBER: _ClassVar[int]
    MAX_ITEMS_FIELD_NUMBER: _ClassVar[int]
    MAX_SHM_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_INLINE_ITEMS_FIELD_NUMBER: _ClassVar[int]
    MAX_INLINE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_DEDICATED_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    BRIDGES_FIELD_NUMBER: _ClassVar[int]
    shm_namespace_id: str
    identity_schemes: _containers.RepeatedScalarFieldContainer[str]
    supports_native_generate: bool
    max_items: int
    max_shm_bytes: int
    max_inline_items: int
    max_inline_bytes: int
    supports_dedicated_segments: bool
    bridges: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, shm_namespace_id: _Optional[str] = ..., identity_schemes: _Optional[_Iterable[str]] = ..., supports_native_generate: _Optional[bool] = ..., max_items: _Optional[int] = ..., max_shm_bytes: _Optional[int] = ..., max_inline_items: _Optional[int] = ..., max_inline_bytes: _Optional[int] = ..., supports_dedicated_segments: _Optional[bool] = ..., bridges: _Optional[_Iterable[str]] = ...) -> None: ...
