"""Frontend side: ``FeatureItem`` list -> typed ``MultimodalRequest`` (+ Dynamo routing metadata).

Tensors go into shared memory with ONE copy (``Producer.put_many(digest=True)``: the per-tensor
XXH3-128 tree digest is fused into that copy), and each item's identity is ``identity.combine``
over those per-tensor digests, so nothing is hashed twice. Tensors already in shared memory
(``Handle`` from loan -> commit with ``digest=True``) are referenced, not copied.

Transport modes: ``"shm"`` (default; TensorData.shm handles), ``"inline"`` (TensorData.inline raw
bytes) and ``"msgpack"`` (vLLM's kwargs MessagePack in ``kwargs_msgpack``; the only mode for the
``grpc-mm`` scheme). The inline modes keep vLLM's 64 items / 16 MiB limits. An item holding vLLM's
non-tensor data (ints, floats, lists of tensors: a typed ``Kwarg`` holds one tensor) travels as its
kwargs MessagePack in every mode, within those inline limits.

In ``"shm"`` mode small tensors still ride inline (``InlinePolicy``): a handoff through shared memory
costs two control-plane round trips (Loan, Acquire) whatever the size, while inline bytes cost only
their serialization in a message that is sent anyway. The defaults are the crossovers measured by
``benchmarks/run.py scale`` (see benchmarks/README.md, "Where we gain nothing").
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np
import numpy.typing as npt

from .. import objtable
from ..client import Handle, Producer
from ..embedmask import PlaceholderRange
from ..errors import IdentityMismatch, InvalidArgument
from ..identity import (
    DEFAULT_SCHEME,
    IdentityScheme,
    cache_identifier,
    combine,
    identity_scheme,
    is_tensor_value,
    item_identity,
    tensor_digest,
)
from ..protocol import routing
from ..protocol.envelope import decode_envelope
from ..protocol.items import FeatureItem, modality_to_pb
from ..protocol.limits import DEFAULT_LIMITS, U32_MAX, Limits
from ..protocol.msgpack_kwargs import decode_kwargs_item, encode_kwargs_item
from ..protocol.validate import check_modality_name, check_placeholders, check_uuid, limit_exceeded
from ..tensors import DTYPES, as_byte_array, to_torch
from ..v1 import features_pb2 as fpb

MODES = ("shm", "inline", "msgpack")

# A copied tensor: (shaped array or torch tensor for put, flat uint8 bytes, dtype, shape).
_Source = tuple[Any, npt.NDArray[np.uint8], str, tuple[int, ...]]
# (item index, key, tensor): a tensor to copy, or a ``Handle`` already in shared memory.
_SourceEntry = tuple[int, str, Handle | _Source]
_CopiedEntry = tuple[int, str, _Source]
# identity.combine's per-tensor entry: (key, dtype, shape, nbytes, digest)
_IdentityEntry = tuple[str, str, Sequence[int], int, bytes]


@dataclasses.dataclass(frozen=True)
class InlinePolicy:
    """Which tensors of a ``"shm"``-mode request travel as ``TensorData.inline`` bytes instead.

    ``request_below_nbytes``: a request whose copied tensors total fewer bytes goes inline whole (no
    Loan or Acquire round trip at all). ``tensor_below_nbytes``: in a request that uses shared memory
    anyway, tensors this small ride inline (no allocation or lease each: ``image_grid_thw`` and the
    like). Inline bytes stay within the limits' ``max_inline_items`` / ``max_inline_bytes``."""

    # measured (benchmarks/results/scale.json, "inline_crossover"): with the object table (the C
    # kernels) a handoff costs no round trip, and inline bytes added to a request that is sent
    # anyway stop being cheaper at ~0.5 MiB (alone, shared memory is faster at every size from
    # 4 KiB); through the daemon's RPCs (pure Python) the crossover was ~1 MiB
    request_below_nbytes: int = dataclasses.field(
        default_factory=lambda: (512 << 10) if objtable.available() else (1 << 20))
    # inside a batched put no latency difference is measurable up to 256 KiB; one page or less rides
    # inline to save its allocation and lease
    tensor_below_nbytes: int = 4 << 10

    def __post_init__(self) -> None:
        if self.request_below_nbytes < 0 or self.tensor_below_nbytes < 0:
            raise InvalidArgument(f"inline thresholds must be >= 0: {self}")


DEFAULT_INLINE = InlinePolicy()
NO_INLINE = InlinePolicy(0, 0)

__all__ = ["BuiltRequest", "build_request", "InlinePolicy", "DEFAULT_INLINE", "NO_INLINE", "request_from_envelope",
           "routing_metadata", "placeholder_to_proto", "placeholder_to_json", "MODES"]


class BuiltRequest:
    """The typed request plus the producer references behind its shm tensors.

    Keep it until the worker has acquired (or the response stream ended), then ``release()``
    (or use it as a context manager); the worker's leases keep the bytes alive after that."""

    def __init__(self, request: fpb.MultimodalRequest, producer: Producer | None, handles: list[Handle],
                 inline_nbytes: int = 0):
        self.request = request
        self._producer = producer
        self.handles = handles
        self.inline_nbytes = inline_nbytes  # tensor bytes carried in the message itself

    def release(self) -> None:
        """Drop the producer's references to the request's tensors; idempotent."""
        if self.handles and self._producer is not None:
            handles, self.handles = self.handles, []
            self._producer.release(handles)

    def __enter__(self) -> "BuiltRequest":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def placeholder_to_proto(p: PlaceholderRange) -> fpb.PlaceholderRange:
    """The wire form of a placeholder; InvalidArgument if its positions exceed uint32."""
    if p.offset + p.length > U32_MAX:
        raise InvalidArgument(f"placeholder [{p.offset}, {p.offset + p.length}) does not fit uint32 positions")
    msg = fpb.PlaceholderRange(offset=p.offset, length=p.length)
    if p.is_embed is not None:
        msg.is_embed = p.is_embed.packed
        msg.is_embed_nbits = p.is_embed.nbits
    return msg


def placeholder_to_json(msg: fpb.PlaceholderRange) -> Any:
    """Dynamo's ``_serialize_mm_placeholder``: ``[offset, length]`` when dense, else the object."""
    if not msg.HasField("is_embed_nbits"):
        return [msg.offset, msg.length]
    from ..embedmask import EmbedMask

    bools = EmbedMask(msg.is_embed, msg.is_embed_nbits).to_bools()
    return {"offset": msg.offset, "length": msg.length, "is_embed": [bool(b) for b in bools]}


def _source(key: str, value: Any) -> _Source:
    """(shaped array or torch tensor for put, flat uint8 bytes, dtype, shape) of a tensor-like."""
    if isinstance(value, tuple):
        dtype, shape, buf = value
        if dtype not in DTYPES:
            raise InvalidArgument(f"{key}: dtype {dtype!r} is not one of vLLM's {len(DTYPES)} dtypes")
        flat = np.frombuffer(buf, dtype=np.uint8)
        arr = flat.view(DTYPES[dtype]).reshape(shape)
        shaped = to_torch(arr, "bfloat16") if dtype == "bfloat16" else arr
        return shaped, flat, dtype, tuple(shape)
    flat, dtype, shape = as_byte_array(value)
    return value, flat, dtype, shape


def build_request(producer: Producer | None, items: Sequence[FeatureItem], *, scheme: str = DEFAULT_SCHEME,
                  adapter: str | None = None, prompt_len: int | None = None, mode: str = "shm",
                  with_markers: bool = False, limits: Limits = DEFAULT_LIMITS,
                  inline: InlinePolicy = DEFAULT_INLINE) -> BuiltRequest:
    """Typed request from items (grouped into one batch per modality, first-seen order).

    ``inline`` (``"shm"`` mode): which small tensors travel inline instead (``InlinePolicy``).

    ``with_markers`` sets each item's routing marker; an item's own ``routing_marker`` / ``mm_hash``
    (from an envelope) is verified against the recomputed identity (IdentityMismatch)."""
    if mode not in MODES:
        raise InvalidArgument(f"mode must be one of {MODES}, got {mode!r}")
    spec = identity_scheme(scheme)
    if spec.over_msgpack and mode != "msgpack":
        raise InvalidArgument(f"the {scheme} identity is defined over kwargs MessagePack: use mode='msgpack'")
    if mode == "shm" and producer is None:
        raise InvalidArgument("mode='shm' needs a Producer")
    if adapter:
        check_uuid(adapter, "adapter")
    if not items:
        raise InvalidArgument("no items")
    limit_name, limit = ("max_items", limits.max_items) if mode == "shm" else ("max_inline_items",
                                                                               limits.max_inline_items)
    if len(items) > limit:
        raise limit_exceeded(limit_name, len(items), limit)
    for it in items:
        check_modality_name(it.modality, limits)
        if not it.kwargs and not (it.kwargs_msgpack and mode == "msgpack"):
            raise InvalidArgument(f"{it.modality}: an item without kwargs cannot be built")
    check_placeholders([(it.modality, i, it.placeholder.offset, it.placeholder.length)
                        for i, it in enumerate(items)], prompt_len)
    packed = {i: _kwargs_msgpack(it, f"{it.modality} item {i}") for i, it in enumerate(items)
              if mode == "msgpack" or _has_non_tensor_data(it)}
    packed_nbytes = sum(len(raw) for raw in packed.values())
    if len(packed) > limits.max_inline_items:
        raise limit_exceeded("max_inline_items", len(packed), limits.max_inline_items)
    if packed_nbytes > limits.max_inline_bytes:
        raise limit_exceeded("max_inline_bytes", packed_nbytes, limits.max_inline_bytes)
    # what the packed items leave of the inline limits for small tensors riding inline
    inline_room = dataclasses.replace(limits, max_inline_bytes=limits.max_inline_bytes - packed_nbytes,
                                      max_inline_items=limits.max_inline_items - len(packed))

    # -- tensors: one put_many for the whole request (one Loan RPC, one copy per tensor) ------------
    sources: list[_SourceEntry] = []  # (item index, key, source tuple or Handle)
    total = 0
    for i, it in enumerate(items):
        if i in packed:
            continue
        for key in sorted(it.kwargs):
            value = it.kwargs[key]
            if isinstance(value, Handle):
                sources.append((i, key, value))
                continue
            src = _source(key, value)
            total += src[1].nbytes
            sources.append((i, key, src))
    if mode == "inline" and total + packed_nbytes > limits.max_inline_bytes:
        raise limit_exceeded("max_inline_bytes", total + packed_nbytes, limits.max_inline_bytes)
    shm_index: dict[tuple[int, str], int] = {}
    to_put: list[Any] = []
    inline_nbytes = total
    put: list[Handle] = []
    if mode == "shm":
        for i, key, src in _to_shared_memory(sources, total, inline, inline_room):
            shm_index[(i, key)] = len(to_put)
            to_put.append(src[0])
            inline_nbytes -= src[1].nbytes
        if limits.max_shm_bytes is not None and total - inline_nbytes > limits.max_shm_bytes:
            raise limit_exceeded("max_shm_bytes", total - inline_nbytes, limits.max_shm_bytes)
        if to_put:
            assert producer is not None  # checked above: mode "shm" needs a Producer
            put = producer.put_many(to_put, digest=spec.uses_fused_digest)
    try:
        request = _assemble(items, sources, shm_index, put, packed, spec, adapter, prompt_len, with_markers, limits)
    except BaseException:
        if put and producer is not None:
            producer.release(put)
        raise
    return BuiltRequest(request, producer, put, inline_nbytes)


def _has_non_tensor_data(item: FeatureItem) -> bool:
    return any(not (isinstance(v, Handle) or is_tensor_value(v)) for v in item.kwargs.values())


def _kwargs_msgpack(item: FeatureItem, where: str) -> bytes:
    """The item's kwargs MessagePack: the producer's exact bytes when it has them (the grpc-mm
    identity is over those bytes), else vLLM's encoding of its kwargs."""
    if item.kwargs_msgpack is not None:
        return item.kwargs_msgpack
    handles = [k for k, v in item.kwargs.items() if isinstance(v, Handle)]
    if handles:
        raise InvalidArgument(f"{where}: kwargs {handles[0]!r} is a shared-memory handle, but this item travels as "
                              f"kwargs MessagePack (non-tensor data or mode='msgpack'): pass the tensor")
    return encode_kwargs_item(item.kwargs, item.fields)


def _to_shared_memory(sources: list[_SourceEntry], total: int, inline: InlinePolicy,
                      limits: Limits) -> list[_CopiedEntry]:
    """The copied tensors of a ``"shm"`` request that go into shared memory; the rest ride inline
    (smallest first, within the inline item and byte limits)."""
    copied: list[_CopiedEntry] = [(i, key, src) for i, key, src in sources if not isinstance(src, Handle)]
    referenced = len(copied) < len(sources)
    if not referenced and total < inline.request_below_nbytes:
        below = len(copied)  # the whole request inline: no round trip to the daemon
    else:
        below = sum(1 for s in copied if s[2][1].nbytes < inline.tensor_below_nbytes)
    ranked = sorted(copied, key=lambda s: s[2][1].nbytes)
    inline_items: set[int] = set()
    nbytes = 0
    for n, (i, _, src) in enumerate(ranked[:below]):
        items_after = len(inline_items | {i})
        if nbytes + src[1].nbytes > limits.max_inline_bytes or items_after > limits.max_inline_items:
            return ranked[n:]
        nbytes += src[1].nbytes
        inline_items.add(i)
    return ranked[below:]


def _assemble(items: Sequence[FeatureItem], sources: list[_SourceEntry], shm_index: dict[tuple[int, str], int],
              put: list[Handle], packed: dict[int, bytes], spec: IdentityScheme, adapter: str | None,
              prompt_len: int | None, with_markers: bool, limits: Limits) -> fpb.MultimodalRequest:
    scheme = spec.name
    tensors: dict[int, dict[str, fpb.TensorData]] = {}
    entries: dict[int, list[_IdentityEntry]] = {}
    for i, key, src in sources:
        if isinstance(src, Handle):
            if spec.uses_fused_digest and not src.digest:
                raise InvalidArgument(f"{key}: handle carries no digest: commit the loan with digest=True")
            if not spec.uses_fused_digest:
                raise InvalidArgument(f"{key}: referenced handles carry XXH3-128 digests; scheme {scheme!r} "
                                      f"needs the tensor")
            td = fpb.TensorData(shape=src.shape, dtype=src.dtype, shm=src.shm, digest=src.digest,
                                commit_token=src.commit_token)
            digest, dtype, shape = src.digest, src.dtype, src.shape
            nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize  # 0-size: handle has 1 byte
        else:
            _, flat, dtype, shape = src
            nbytes = flat.nbytes
            if (i, key) in shm_index:
                h = put[shm_index[(i, key)]]
                digest = h.digest if spec.uses_fused_digest else tensor_digest(scheme, flat)
                td = fpb.TensorData(shape=shape, dtype=dtype, shm=h.shm, digest=digest, commit_token=h.commit_token)
            else:
                digest = tensor_digest(scheme, flat)
                td = fpb.TensorData(shape=shape, dtype=dtype, inline=flat.tobytes(), digest=digest)
        tensors.setdefault(i, {})[key] = td
        entries.setdefault(i, []).append((key, dtype, shape, nbytes, digest))

    request = fpb.MultimodalRequest(prompt_len=prompt_len or 0)
    batches: dict[str, fpb.MultimodalInputs] = {}
    for i, it in enumerate(items):
        batch = batches.get(it.modality)
        if batch is None:
            batch = batches[it.modality] = request.batches.add(
                modality=modality_to_pb(it.modality), identity_scheme=spec.pb, adapter=adapter or "")
        msg = batch.items.add(placeholder=placeholder_to_proto(it.placeholder))
        if i in packed:
            raw = msg.kwargs_msgpack = packed[i]
            if spec.msgpack_identity is not None:  # spec.over_msgpack
                identity = spec.msgpack_identity(it.modality, raw)
            else:  # from the bytes that travel, as the worker computes it (non-tensor data included)
                identity = item_identity(it.modality, decode_kwargs_item(raw, limits).values, scheme)
        else:
            for key, td in tensors[i].items():
                kw = msg.kwargs[key]
                kw.tensor.CopyFrom(td)
                kw.field.CopyFrom(it.field(key).to_proto())
            identity = combine(scheme, it.modality, entries[i])
        where = f"{it.modality} item {i}"
        if it.mm_hash is not None and it.mm_hash != identity:
            raise IdentityMismatch(f"{where}: producer mm_hash {it.mm_hash} != content identity {identity}")
        if it.routing_marker is not None:
            routing.check_marker_matches(it.routing_marker, identity, where)
        msg.mm_hash = identity
        msg.cache_identifier = cache_identifier(identity, adapter)
        if with_markers or it.routing_marker is not None:
            msg.routing_marker = routing.routing_marker(identity)
        batch.mm_hashes.append(identity)
        batch.mm_placeholders.append(msg.placeholder)
        keep = sorted(k for k in it.kwargs if it.field(k).keep_on_cpu)
        for k in sorted(it.kwargs):
            f = it.field(k)
            if f.kind == "batched" and k not in batch.batched_keys:
                batch.batched_keys.append(k)
        for k in keep:
            if k not in batch.keep_on_cpu_keys:
                batch.keep_on_cpu_keys.append(k)
    return request


def request_from_envelope(producer: Producer | None, features: Any, *, prompt_len: int | None = None,
                          routing_markers: Sequence[str] | None = None, has_raw_media: bool = False,
                          scheme: str = DEFAULT_SCHEME, adapter: str | None = None, mode: str = "shm",
                          limits: Limits = DEFAULT_LIMITS, inline: InlinePolicy = DEFAULT_INLINE) -> BuiltRequest:
    """Decode + validate a ``vllm_tito.features`` envelope, then build the typed request (tensors
    copied once into shared memory with the identity fused)."""
    items = decode_envelope(features, prompt_len=prompt_len, routing_markers=routing_markers,
                            has_raw_media=has_raw_media, limits=limits)
    if not items:
        raise InvalidArgument("no preprocessed features")
    return build_request(producer, items, scheme=scheme, adapter=adapter, prompt_len=prompt_len, mode=mode,
                         limits=limits, inline=inline)


def routing_metadata(request: fpb.MultimodalRequest, *, exact: bool = True) -> dict[str, Any]:
    """``extra_args`` routing metadata in the form Dynamo's frontend emits (``vllm_processor.py``
    ``_group_mm_feature_metadata`` / ``_prepare_mm_routing``): ``mm_hashes_by_modality`` /
    ``mm_placeholders_by_modality``, plus the legacy flat ``mm_hashes`` / ``mm_placeholders``, which
    carry the image lists when the request is image-only and are ``[]`` otherwise.

    Each hash is the item's routing marker (``routing.routing_marker``), not its identity: Dynamo's
    worker requires 16 leading hex and passes the marker to vLLM unchanged, so vLLM's extra_keys and
    the router's pad values come from the same u64. An item without an mm_hash is left out, its
    placeholder too, as Dynamo's frontend leaves it out (a modality with no hashed item is absent),
    so Dynamo's worker builds the same uuid lists from ours as from its own. ``exact=False`` (the
    router fell back to token-only routing: ``kv_routing.RoutingIdentity.multimodal`` is False) omits
    the hashes, as Dynamo does: their presence turns on multimodal keys in the worker's KV events."""
    from ..protocol.items import modality_from_pb

    hashes: dict[str, list[str]] = {}
    placeholders: dict[str, list[Any]] = {}
    for batch in request.batches:
        modality = modality_from_pb(batch.modality)
        for it in batch.items:
            if not it.mm_hash:
                continue
            hashes.setdefault(modality, []).append(routing.routing_marker(it.mm_hash))
            placeholders.setdefault(modality, []).append(placeholder_to_json(it.placeholder))
    image_only = set(hashes) == {"image"}
    out: dict[str, Any] = {"mm_placeholders": list(placeholders["image"]) if image_only else [],
                           "mm_placeholders_by_modality": placeholders}
    if exact:
        out["mm_hashes"] = list(hashes["image"]) if image_only else []
        out["mm_hashes_by_modality"] = hashes
    return out
