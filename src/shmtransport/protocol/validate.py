"""Validation rules shared by the envelope decoder, the frontend and the worker.

Every rule raises a typed error: ``InvalidArgument`` (INVALID_ARGUMENT) for malformed input,
``ResourceExhausted`` with ``Reason.QUOTA_EXCEEDED`` (RESOURCE_EXHAUSTED) naming the limit for
size limits, ``IdentityMismatch`` (DATA_LOSS) for identities and markers that do not match the
payload. ``validate_request`` checks a whole typed ``MultimodalRequest`` before any shared memory
is touched and returns the checked view the worker executes.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Sequence

from ..embedmask import EmbedMask, PlaceholderRange
from ..errors import InvalidArgument, Reason, ResourceExhausted
from ..handle import Handle
from ..identity import cache_identifier, scheme_from_pb, validate_uuid
from ..tensors import DTYPE_ITEMSIZE
from ..v1 import features_pb2 as fpb
from . import routing
from .items import FieldConfig, modality_from_pb
from .limits import DEFAULT_LIMITS, MODALITIES, U64_MAX, Limits
from .msgpack_kwargs import DecodedKwargs, decode_kwargs_item

__all__ = [
    "check_modality_name", "check_hash", "check_position", "check_placeholders", "check_tensor_manifest",
    "check_routing_markers", "check_field_metadata", "check_uuid", "limit_exceeded", "validate_request",
    "CheckedItem", "CheckedBatch", "CheckedRequest",
]


def limit_exceeded(name: str, value: int, limit: int, field: str | None = None) -> ResourceExhausted:
    """The refusal of ``value`` over the limit ``name``; ``field``: the request field that carries it."""
    return ResourceExhausted(f"limit {name}={limit} exceeded: {value}", Reason.QUOTA_EXCEEDED, field=field, limit=limit)


def check_modality_name(name: Any, limits: Limits = DEFAULT_LIMITS) -> str:
    """``name`` if it is a known modality within the length limit; InvalidArgument otherwise."""
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"modality name must be a non-empty str, got {name!r}")
    if len(name.encode("utf-8")) > limits.max_modality_bytes:
        raise InvalidArgument(f"modality name longer than {limits.max_modality_bytes} bytes")
    if name not in MODALITIES:
        raise InvalidArgument(f"unknown modality {name!r}: expected one of {', '.join(MODALITIES)}")
    return name


def check_hash(h: Any, limits: Limits = DEFAULT_LIMITS, what: str = "mm_hash") -> str:
    """``h`` if it is a non-empty identity within ``max_hash_bytes``, safe as a cache key and path
    component; InvalidArgument otherwise."""
    if not isinstance(h, str) or not h:
        raise InvalidArgument(f"{what} must be a non-empty str, got {h!r:.80}")
    if len(h.encode("utf-8")) > limits.max_hash_bytes:
        raise InvalidArgument(f"{what} longer than {limits.max_hash_bytes} bytes")
    return check_uuid(h, what)


def check_uuid(s: Any, what: str = "uuid") -> str:
    """Identifiers become cache keys and path components: reject '.', '..', '/', '\\', NUL."""
    try:
        return validate_uuid(s)
    except InvalidArgument as exc:
        raise InvalidArgument(f"unsafe {what}: {exc}") from None


def check_position(value: Any, what: str, positive: bool = False) -> int:
    """A JSON/proto position: an int (not a bool), >= 0 (> 0 with ``positive``), <= u64 max."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgument(f"{what} must be an integer, got {type(value).__name__} {value!r:.40}")
    if value < 0:
        raise InvalidArgument(f"{what} must not be negative, got {value}")
    if positive and value == 0:
        raise InvalidArgument(f"{what} must be > 0")
    if value > U64_MAX:
        raise InvalidArgument(f"{what} does not fit in u64")
    return value


def check_placeholders(entries: Iterable[tuple[str, int, int, int]], prompt_len: int | None = None) -> None:
    """``(modality, index, offset, length)`` of every item of a request: no u64 overflow, inside the
    prompt, and no two ranges overlapping (all modalities together, after sorting by offset)."""
    spans = []
    for modality, index, offset, length in entries:
        end = offset + length
        if end > U64_MAX:
            raise InvalidArgument(f"{modality}[{index}]: offset + length overflows u64")
        if prompt_len is not None and end > prompt_len:
            raise InvalidArgument(f"{modality}[{index}]: placeholder [{offset}, {end}) exceeds the prompt "
                                  f"({prompt_len} tokens)")
        spans.append((offset, end, modality, index))
    spans.sort()
    for (o1, e1, m1, i1), (o2, e2, m2, i2) in zip(spans, spans[1:]):
        if e1 > o2:
            raise InvalidArgument(f"placeholders overlap: {m1}[{i1}] [{o1}, {e1}) and {m2}[{i2}] [{o2}, {e2})")


def check_tensor_manifest(key: str, dtype: Any, shape: Sequence[int], limits: Limits = DEFAULT_LIMITS) -> int:
    """dtype in vLLM's 13, rank <= max_rank, dims >= 0; returns the byte size numel x itemsize."""
    if not isinstance(key, str) or not 1 <= len(key.encode("utf-8")) <= limits.max_key_bytes:
        raise InvalidArgument(f"kwarg key must be 1..{limits.max_key_bytes} bytes, got {key!r:.80}")
    if dtype not in DTYPE_ITEMSIZE:
        raise InvalidArgument(f"{key}: dtype {dtype!r} is not one of vLLM's {len(DTYPE_ITEMSIZE)} dtypes")
    if len(shape) > limits.max_rank:
        raise InvalidArgument(f"{key}: rank {len(shape)} exceeds {limits.max_rank}")
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"{key}: negative dimension in {list(shape)}")
    return math.prod(shape) * DTYPE_ITEMSIZE[dtype]


def check_routing_markers(markers: Sequence[Any] | None, item_count: int, has_features: bool) -> list[str] | None:
    """Dynamo's ``dynamo_mm_routing_hashes`` rules: only with features, one per item, none empty."""
    if markers is None:
        return None
    if not has_features:
        raise InvalidArgument("routing markers given without preprocessed features")
    if not isinstance(markers, (list, tuple)):
        raise InvalidArgument("routing markers must be a list")
    if len(markers) != item_count:
        raise InvalidArgument(f"{len(markers)} routing markers for {item_count} items")
    return [routing.check_marker_format(m) for m in markers]


def check_field_metadata(occurrences: dict[tuple[str, str], list[tuple[FieldConfig, int]]]) -> None:
    """vLLM ``validate_mm_field_metadata``: every item of one (modality, key) uses the same field
    config; shared batch_size = occurrences; flat len(slices) = occurrences; flat dim within rank."""
    for (modality, key), uses in occurrences.items():
        first = uses[0][0]
        for field, rank in uses:
            if field != first:
                raise InvalidArgument(f"{modality}.{key}: items use different field configs")
            if field.kind == "flat" and not -max(rank, 1) <= field.dim < max(rank, 1):
                raise InvalidArgument(f"{modality}.{key}: flat dim {field.dim} outside rank {rank}")
            if field.kind == "flat":
                for entry in field.slices:
                    for s in entry if isinstance(entry, tuple) else (entry,):
                        if s.step == 0:
                            raise InvalidArgument(f"{modality}.{key}: flat slice step must not be 0")
        if first.kind == "shared" and first.batch_size != len(uses):
            raise InvalidArgument(f"{modality}.{key}: shared batch_size {first.batch_size} != {len(uses)} items")
        if first.kind == "flat" and len(first.slices) != len(uses):
            raise InvalidArgument(f"{modality}.{key}: flat has {len(first.slices)} slices for {len(uses)} items")


# ---------------------------------------------------------------------------------------------
# A whole typed request
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class CheckedTensor:
    """One validated tensor: dtype, shape, byte count, and where its bytes are (a handle or bytes)."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    kind: str  # "shm" | "inline" | "msgpack"
    source: Any  # Handle (shm) or a bytes-like (inline / msgpack)


@dataclasses.dataclass
class CheckedItem:
    """One validated item. ``tensors`` are its single-tensor kwargs; an item sent as kwargs
    MessagePack also has ``msgpack``, whose ``values`` hold every key (non-tensor data included)."""

    index: int
    placeholder: PlaceholderRange
    tensors: dict[str, CheckedTensor]
    fields: dict[str, FieldConfig]
    mm_hash: str  # "" when the producer sent none
    cache_identifier: str
    routing_marker: str | None
    msgpack: DecodedKwargs | None = None


@dataclasses.dataclass
class CheckedBatch:
    """One validated batch: its modality, identity scheme, adapter and items."""

    modality: str
    scheme: str
    adapter: str
    items: list[CheckedItem]


@dataclasses.dataclass
class CheckedRequest:
    """A validated request: its batches of features, or its raw media."""

    batches: list[CheckedBatch]
    raw_media: list[fpb.RawMedia]

    @property
    def items(self) -> list[tuple[str, CheckedItem]]:
        """Every item with its batch's modality, in request order."""
        return [(b.modality, it) for b in self.batches for it in b.items]


def _placeholder(msg: fpb.PlaceholderRange, where: str) -> PlaceholderRange:
    check_position(msg.length, f"{where} placeholder length", positive=True)
    mask = None
    if msg.HasField("is_embed_nbits"):
        if msg.is_embed_nbits != msg.length:
            raise InvalidArgument(f"{where}: is_embed has {msg.is_embed_nbits} bits but length is {msg.length}")
        if len(msg.is_embed) != (msg.is_embed_nbits + 7) // 8:
            raise InvalidArgument(f"{where}: is_embed needs {(msg.is_embed_nbits + 7) // 8} bytes")
        mask = EmbedMask(msg.is_embed, msg.is_embed_nbits)
    elif msg.is_embed:
        raise InvalidArgument(f"{where}: is_embed bytes without is_embed_nbits")
    return PlaceholderRange(msg.offset, msg.length, mask)


def _tensor(key: str, td: fpb.TensorData, limits: Limits, where: str) -> CheckedTensor:
    shape = tuple(td.shape)
    expected = check_tensor_manifest(key, td.dtype, shape, limits)
    which = td.WhichOneof("payload")
    if which == "inline":
        if len(td.inline) != expected:
            raise InvalidArgument(f"{where}.{key}: {len(td.inline)} inline bytes but {td.dtype}{list(shape)} "
                                  f"needs {expected}")
        return CheckedTensor(td.dtype, shape, expected, "inline", td.inline)
    if which == "shm":
        if td.shm.nbytes != expected and not (expected == 0 and td.shm.nbytes == 1):
            raise InvalidArgument(f"{where}.{key}: handle nbytes {td.shm.nbytes} != manifest "
                                  f"{td.dtype}{list(shape)} ({expected} bytes)")
        return CheckedTensor(td.dtype, shape, expected, "shm",
                             Handle(td.shm, td.dtype, shape, digest=td.digest, commit_token=td.commit_token))
    if which == "remote":
        raise InvalidArgument(f"{where}.{key}: remote tensor transport {td.remote.transport!r} is not served")
    raise InvalidArgument(f"{where}.{key}: tensor has no payload")


def validate_request(req: fpb.MultimodalRequest, limits: Limits = DEFAULT_LIMITS,
                     prompt_len: int | None = None) -> CheckedRequest:
    """Every structural rule of a typed request; shared memory is not touched."""
    if req.batches and req.raw_media:
        raise InvalidArgument("raw media and preprocessed media features cannot be mixed")
    for i, media in enumerate(req.raw_media):
        modality_from_pb(media.modality)
        if media.WhichOneof("source") is None:
            raise InvalidArgument(f"raw_media[{i}] has no source")
        if media.uuid:
            check_uuid(media.uuid, f"raw_media[{i}].uuid")
    if prompt_len is None and req.prompt_len:
        prompt_len = req.prompt_len
    batches: list[CheckedBatch] = []
    seen: set[str] = set()
    n_items = n_inline_items = inline_bytes = shm_bytes = 0
    spans = []
    occurrences: dict[tuple[str, str], list[tuple[FieldConfig, int]]] = {}
    for b, batch in enumerate(req.batches):
        modality = modality_from_pb(batch.modality)
        if modality in seen:
            raise InvalidArgument(f"two batches of modality {modality!r}: one batch per modality")
        seen.add(modality)
        spec = scheme_from_pb(batch.identity_scheme)
        scheme = spec.name
        if batch.adapter:
            check_uuid(batch.adapter, "adapter")
        if not batch.items:
            raise InvalidArgument(f"batch {modality!r} has no items")
        n_items += len(batch.items)
        if n_items > limits.max_items:
            raise limit_exceeded("max_items", n_items, limits.max_items, f"batches[{b}].items")
        if batch.mm_hashes and list(batch.mm_hashes) != [it.mm_hash for it in batch.items]:
            raise InvalidArgument(f"batch {modality!r}: mm_hashes disagree with its items")
        if batch.mm_placeholders and list(batch.mm_placeholders) != [it.placeholder for it in batch.items]:
            raise InvalidArgument(f"batch {modality!r}: mm_placeholders disagree with its items")
        items = []
        for i, it in enumerate(batch.items):
            where = f"{modality}[{i}]"
            placeholder = _placeholder(it.placeholder, where)
            spans.append((modality, i, placeholder.offset, placeholder.length))
            if it.mm_hash:
                check_hash(it.mm_hash, limits, f"{where}.mm_hash")
                if not it.mm_hash.startswith(scheme + ":"):
                    raise InvalidArgument(f"{where}: mm_hash is not a {scheme} identity")
                expected_id = cache_identifier(it.mm_hash, batch.adapter or None)
                if it.cache_identifier and it.cache_identifier != expected_id:
                    raise InvalidArgument(f"{where}: cache_identifier {it.cache_identifier!r:.80} != {expected_id!r}")
            elif it.cache_identifier:
                raise InvalidArgument(f"{where}: cache_identifier without mm_hash")
            marker = None
            if it.HasField("routing_marker"):
                marker = routing.check_marker_format(it.routing_marker)
                if it.mm_hash:
                    routing.check_marker_matches(marker, it.mm_hash, where)
            tensors: dict[str, CheckedTensor] = {}
            fields: dict[str, FieldConfig] = {}
            decoded = None
            if it.HasField("kwargs_msgpack"):
                if it.kwargs:
                    raise InvalidArgument(f"{where}: kwargs and kwargs_msgpack are exclusive")
                n_inline_items += 1
                inline_bytes += len(it.kwargs_msgpack)
                if inline_bytes > limits.max_inline_bytes:  # checked before decoding
                    raise limit_exceeded("max_inline_bytes", inline_bytes, limits.max_inline_bytes,
                                         f"batches[{b}].items[{i}].kwargs_msgpack")
                decoded = decode_kwargs_item(it.kwargs_msgpack, limits)
                for key, (dtype, shape, data) in decoded.tensors.items():
                    tensors[key] = CheckedTensor(dtype, shape, memoryview(data).nbytes, "msgpack", data)
                fields = dict(decoded.fields)
                for key in decoded.non_tensor_keys:  # rank 0: vLLM takes such data along dim 0 only
                    occurrences.setdefault((modality, key), []).append((fields[key], 0))
            elif it.kwargs:
                if len(it.kwargs) > limits.max_fields:
                    raise InvalidArgument(f"{where}: more than {limits.max_fields} kwargs")
                any_inline = False
                for key in sorted(it.kwargs):
                    kw = it.kwargs[key]
                    t = _tensor(key, kw.tensor, limits, where)
                    tensors[key] = t
                    fields[key] = FieldConfig.from_proto(kw.field) if kw.HasField("field") else FieldConfig()
                    if t.kind == "inline":
                        any_inline = True
                        inline_bytes += t.nbytes
                    else:
                        shm_bytes += t.nbytes
                n_inline_items += any_inline
                if inline_bytes > limits.max_inline_bytes:
                    raise limit_exceeded("max_inline_bytes", inline_bytes, limits.max_inline_bytes,
                                         f"batches[{b}].items[{i}].kwargs")
                if limits.max_shm_bytes is not None and shm_bytes > limits.max_shm_bytes:
                    raise limit_exceeded("max_shm_bytes", shm_bytes, limits.max_shm_bytes,
                                         f"batches[{b}].items[{i}].kwargs")
            elif not limits.allow_cache_only:
                raise InvalidArgument(f"{where}: features without kwargs (cache-only reference) are not enabled")
            elif not it.mm_hash:
                raise InvalidArgument(f"{where}: a cache-only reference needs its mm_hash")
            if n_inline_items > limits.max_inline_items:
                raise limit_exceeded("max_inline_items", n_inline_items, limits.max_inline_items,
                                     f"batches[{b}].items[{i}]")
            for key, t in tensors.items():
                occurrences.setdefault((modality, key), []).append((fields[key], len(t.shape)))
            if spec.over_msgpack and decoded is None and tensors:
                raise InvalidArgument(f"{where}: the {scheme} identity needs kwargs_msgpack (inline)")
            items.append(CheckedItem(i, placeholder, tensors, fields, it.mm_hash,
                                     it.cache_identifier or (cache_identifier(it.mm_hash, batch.adapter or None)
                                                             if it.mm_hash else ""),
                                     marker, decoded))
        batches.append(CheckedBatch(modality, scheme, batch.adapter, items))
    check_placeholders(spans, prompt_len)
    check_field_metadata(occurrences)
    return CheckedRequest(batches, list(req.raw_media))
