"""vLLM's MessagePack encoding of one ``MultiModalKwargsItem`` (protocol-facts 3.3, 3.4), safely.

Wire layout: byte for byte what vLLM's ``MsgpackEncoder(size_threshold=2**62).encode(item)[0]``
emits (the all-inline form vLLM's gRPC sidecar and ``mm_serde`` produce and the Rust gateway
accepts; checked against the real encoder in tests/test_conformance_vllm.py)::

    {key: {"data": value,
           "field": ["batched", {keep_on_cpu}] | ["flat", {keep_on_cpu, slices, dim}]
                    | ["shared", {keep_on_cpu, batch_size}]}}        # keys in the item's order
    value  = [dtype, shape, Ext(3, raw little-endian C-order bytes)]  # a tensor
           | int | float | [value, ...]                              # vLLM's NestedTensors
    slices = [[start, stop, step] | [[start, stop, step], ...], ...]  # nil for None

Map keys keep the caller's order (vLLM writes ``item.items()`` order; it is not sorted), and each
field's options follow the dataclass field order of vLLM's field classes (``keep_on_cpu`` first).
With vLLM's default ``size_threshold`` (256 B) a tensor of >= 256 bytes is written as an int index
into aux frames instead of Ext(3): such bytes are not an inline item and are refused here, as the
gateway refuses them.

Decoding runs a structural preflight over the raw bytes first (depth, node count, reserved 0xC1,
truncation, trailing bytes: the checks of vLLM's gateway), then ``msgpack.unpackb`` with an
``ext_hook`` that accepts only ext type 3 (RAW_VIEW). msgpack-python hands ext payloads to the hook
as fresh ``bytes`` (a copy), so the preflight records each Ext(3) payload's span and msgpack decodes
a skeleton in which each payload is replaced by an 8-byte span index: tensors are zero-copy
memoryviews of the input, and the only copy of their bytes is the one into shared memory. Pickle
exts (1, 2) and aux-frame index references are rejected; nothing is ever unpickled.

Data values are what vLLM's reader (``MsgpackDecoder._decode_nested_tensors``, used by
``mm_serde.decode_mm_kwargs_item``) accepts: a tensor, an int (any MessagePack int: i64 or u64), a
bool (an int to vLLM), a float or a list of these. A str or a nil inside a list is refused, as vLLM
refuses it; a nil ``data`` (vLLM's "cached in EngineCore" element) is refused too: an inline item
must carry its data. The encoder writes only what the Rust gateway's ``NestedTensorValue`` can
also read (no bool, ints within i64).
"""
from __future__ import annotations

import math
import struct
from typing import Any, Callable, Iterator, Mapping

import msgpack
import numpy as np

from ..errors import InvalidArgument
from ..tensors import DTYPE_ITEMSIZE, as_byte_array, dtype_name
from .items import FIELD_KINDS, FieldConfig
from .limits import DEFAULT_LIMITS, Limits

EXT_RAW_VIEW = 3
_I64 = (-(1 << 63), (1 << 63) - 1)  # the gateway's NestedTensorValue::Int(i64)
_MSGPACK_INT = (-(1 << 63), (1 << 64) - 1)  # every int MessagePack (and so vLLM's msgspec) can carry

__all__ = ["preflight", "decode_kwargs_item", "encode_kwargs_item", "map_tensors", "DecodedKwargs", "EXT_RAW_VIEW"]

# Fixed-size payloads after a marker byte: marker -> bytes to skip.
_FIXED = {0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8,
          0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17}
# Length-prefixed payloads: marker -> (length-field bytes, extra bytes after the length (ext type)).
_SIZED = {0xC4: (1, 0), 0xC5: (2, 0), 0xC6: (4, 0), 0xC7: (1, 1), 0xC8: (2, 1), 0xC9: (4, 1),
          0xD9: (1, 0), 0xDA: (2, 0), 0xDB: (4, 0)}
_CONTAINERS = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}
_UINT = {1: "B", 2: ">H", 4: ">I"}
# An Ext(3) span in the raw bytes: (header_start, payload_start, payload_nbytes).
_RawView = tuple[int, int, int]
# A decoded tensor: (dtype, shape, zero-copy bytes of the input).
_RawTensor = tuple[str, tuple[int, ...], memoryview]


def _bad(msg: str) -> InvalidArgument:
    return InvalidArgument(f"kwargs MessagePack: {msg}")


def preflight(buf: Any, limits: Limits = DEFAULT_LIMITS, raw_views: list[_RawView] | None = None) -> int:
    """Walk the structure without building it: exactly one value, depth <= limits.msgpack_max_depth,
    <= limits.msgpack_max_nodes values, no reserved 0xC1, no truncation, no trailing bytes.
    Returns the node count. Cost is per node, not per byte (payloads are skipped).
    ``raw_views`` collects ``(header_start, payload_start, payload_nbytes)`` of every Ext(3)."""
    mv = memoryview(buf).cast("B")
    n = mv.nbytes
    if n == 0:
        raise _bad("empty payload")
    pos = nodes = 0
    stack: list[int] = []  # children still expected by each open container
    while True:
        if pos >= n:
            raise _bad("truncated")
        b = mv[pos]
        pos += 1
        nodes += 1
        if nodes > limits.msgpack_max_nodes:
            raise _bad(f"more than {limits.msgpack_max_nodes} nodes")
        children = -1  # -1: not a container
        if b <= 0x7F or b >= 0xE0 or b in (0xC0, 0xC2, 0xC3):
            pass
        elif b <= 0x8F:
            children = 2 * (b & 0x0F)
        elif b <= 0x9F:
            children = b & 0x0F
        elif b <= 0xBF:
            pos += b & 0x1F
        elif b == 0xC1:
            raise _bad("reserved marker 0xC1")
        elif b in _FIXED:
            if b >= 0xD4 and raw_views is not None and pos < n and mv[pos] == EXT_RAW_VIEW:
                raw_views.append((pos - 1, pos + 1, _FIXED[b] - 1))
            pos += _FIXED[b]
        elif b in _SIZED:
            width, extra = _SIZED[b]
            if pos + width > n:
                raise _bad("truncated")
            (size,) = struct.unpack_from(_UINT[width], mv, pos)
            if extra and raw_views is not None and pos + width < n and mv[pos + width] == EXT_RAW_VIEW:
                raw_views.append((pos - 1, pos + width + 1, size))
            pos += width + extra + size
        else:  # array16/32, map16/32
            width, mult = _CONTAINERS[b]
            if pos + width > n:
                raise _bad("truncated")
            (count,) = struct.unpack_from(_UINT[width], mv, pos)
            pos += width
            children = mult * count
        if pos > n:
            raise _bad("truncated")
        if stack:
            stack[-1] -= 1
        if children >= 0:
            if len(stack) + 1 > limits.msgpack_max_depth:
                raise _bad(f"nesting deeper than {limits.msgpack_max_depth}")
            if children > n - pos:  # every child needs at least one byte
                raise _bad("truncated")
            if children:
                stack.append(children)
        while stack and stack[-1] == 0:
            stack.pop()
        if not stack:
            break
    if pos != n:
        raise _bad(f"{n - pos} trailing bytes after the item")
    return nodes


class _ExtError(Exception):
    pass


_REF = struct.Struct("<Q")


def _skeleton(raw: bytes, raw_views: list[_RawView]) -> bytes:
    """``raw`` with every Ext(3) payload replaced by ``fixext8(3, u64le(index))``: what msgpack
    decodes is the small structure only; tensor bytes stay in ``raw`` and are sliced zero-copy."""
    parts: list[bytes] = []
    prev = 0
    for index, (header, start, size) in enumerate(raw_views):
        parts += [raw[prev:header], b"\xd7\x03", _REF.pack(index)]
        prev = start + size
    parts.append(raw[prev:])
    return b"".join(parts)


def _ext_hook_for(raw: bytes, raw_views: list[_RawView]) -> Callable[[int, bytes], memoryview]:
    whole = memoryview(raw)

    def hook(code: int, data: bytes) -> memoryview:
        if code != EXT_RAW_VIEW:
            raise _ExtError(f"ext type {code} is not allowed (only {EXT_RAW_VIEW}, raw tensor bytes; "
                            f"pickle is never accepted)")
        _, start, size = raw_views[_REF.unpack(data)[0]]
        return whole[start:start + size]

    return hook


class DecodedKwargs:
    """One decoded kwargs item, keys in wire order.

    ``values[key]`` is every field's data: a tensor as the tuple ``(dtype, shape, bytes-like)`` (the
    identity module's form), an int, a bool, a float or a (nested) list of these. ``tensors`` holds
    the keys whose data is one tensor (what a typed ``Kwarg`` can carry); ``fields[key]`` is the
    ``FieldConfig``; ``raw`` is the exact MessagePack bytes."""

    __slots__ = ("tensors", "fields", "raw", "values")

    def __init__(self, tensors: dict[str, _RawTensor], fields: dict[str, FieldConfig], raw: bytes,
                 values: dict[str, Any] | None = None):
        self.tensors = tensors
        self.fields = fields
        self.raw = raw
        self.values = dict(tensors) if values is None else values

    @property
    def nbytes(self) -> int:
        """Bytes of all the item's tensors."""
        return sum(memoryview(t[2]).nbytes for v in self.values.values() for t in _leaves(v))

    @property
    def non_tensor_keys(self) -> list[str]:
        """Keys whose data is an int, a bool, a float or a list: only kwargs_msgpack carries them."""
        return [k for k in self.values if k not in self.tensors]


def _leaves(value: Any) -> Iterator[tuple[Any, ...]]:
    if isinstance(value, tuple):
        yield value
    elif isinstance(value, list):
        for v in value:
            yield from _leaves(v)


def map_tensors(value: Any, convert: Callable[[_RawTensor], Any]) -> Any:
    """A decoded value with every tensor ``(dtype, shape, bytes)`` replaced by ``convert(tensor)``;
    lists stay lists and numbers stay as they are (what vLLM's reader hands the model)."""
    if isinstance(value, tuple):
        return convert(value)
    if isinstance(value, list):
        return [map_tensors(v, convert) for v in value]
    return value


def decode_kwargs_item(raw: Any, limits: Limits = DEFAULT_LIMITS) -> DecodedKwargs:
    """Decode and validate one kwargs item (vLLM's MessagePack) within ``limits``; InvalidArgument if malformed."""
    try:
        raw = bytes(memoryview(raw).cast("B")) if not isinstance(raw, bytes) else raw
    except TypeError:
        raise _bad(f"payload must be bytes, got {type(raw).__name__}") from None
    raw_views: list[_RawView] = []
    preflight(raw, limits, raw_views)
    try:
        obj = msgpack.unpackb(_skeleton(raw, raw_views), raw=False, ext_hook=_ext_hook_for(raw, raw_views),
                              strict_map_key=False, use_list=True)
    except _ExtError as exc:
        raise _bad(str(exc)) from None
    except (ValueError, msgpack.UnpackException, TypeError) as exc:
        raise _bad(f"malformed ({type(exc).__name__}: {exc})") from None
    if not isinstance(obj, dict):
        raise _bad(f"an item must be a map of key -> field element, got {type(obj).__name__}")
    if not 1 <= len(obj) <= limits.max_fields:
        raise _bad(f"an item must have 1..{limits.max_fields} fields, got {len(obj)}")
    values: dict[str, Any] = {}
    tensors: dict[str, _RawTensor] = {}
    fields: dict[str, FieldConfig] = {}
    for key, elem in obj.items():
        if not isinstance(key, str) or not 1 <= len(key.encode()) <= limits.max_key_bytes:
            raise _bad(f"field key must be a str of 1..{limits.max_key_bytes} bytes, got {key!r:.80}")
        if not isinstance(elem, dict) or set(elem) != {"data", "field"}:
            raise _bad(f"field {key!r} must be a map with exactly 'data' and 'field'")
        if elem["data"] is None:
            raise _bad(f"field {key!r} carries no data (cache-only elements are not accepted inline)")
        value = values[key] = _value(key, elem["data"], limits)
        if isinstance(value, tuple):
            tensors[key] = value
        # Non-tensor data has no rank: vLLM concatenates nested lists only along dim 0.
        fields[key] = _field(key, elem["field"], len(value[1]) if isinstance(value, tuple) else None)
    return DecodedKwargs(tensors, fields, raw, values)


def _value(key: str, data: Any, limits: Limits) -> Any:
    """vLLM's NestedTensors rule (``_decode_nested_tensors``): a list whose first element is a str
    is a tensor, any other list is a list of values; ints, bools and floats stand for themselves."""
    if isinstance(data, list):
        if data and isinstance(data[0], str):
            return _tensor(key, data, limits)
        return [_value(key, v, limits) for v in data]
    if data is None:  # vLLM refuses a nil inside a list (TypeError); a nil data is handled above
        raise _bad(f"field {key!r}: nil is not a tensor, int, float or list")
    if isinstance(data, int):  # bool included: vLLM's reader takes it as an int and keeps it
        if not _MSGPACK_INT[0] <= data <= _MSGPACK_INT[1]:
            raise _bad(f"field {key!r}: int data {data} is outside MessagePack's int64/uint64")
        return data
    if isinstance(data, float):
        return data
    if isinstance(data, memoryview):
        raise _bad(f"field {key!r}: bare Ext({EXT_RAW_VIEW}) bytes without dtype and shape are not a tensor")
    raise _bad(f"field {key!r}: {type(data).__name__} data is not a tensor [dtype, shape, Ext({EXT_RAW_VIEW})], "
               f"an int, a float or a list")


def _tensor(key: str, data: list[Any], limits: Limits) -> _RawTensor:
    if len(data) != 3:
        raise _bad(f"field {key!r}: a tensor must be [dtype, shape, Ext({EXT_RAW_VIEW})]")
    dtype, shape, payload = data
    if dtype not in DTYPE_ITEMSIZE:
        raise _bad(f"field {key!r}: dtype {dtype!r} is not one of vLLM's {len(DTYPE_ITEMSIZE)} dtypes")
    if not isinstance(shape, list) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
        raise _bad(f"field {key!r}: shape must be a list of non-negative ints")
    if len(shape) > limits.max_rank:
        raise _bad(f"field {key!r}: rank {len(shape)} exceeds {limits.max_rank}")
    if isinstance(payload, int) and not isinstance(payload, bool):
        raise _bad(f"field {key!r}: aux-frame index reference; inline tensor data is required")
    if not isinstance(payload, memoryview):
        raise _bad(f"field {key!r}: tensor data must be Ext({EXT_RAW_VIEW}, bytes)")
    expected = math.prod(shape) * DTYPE_ITEMSIZE[dtype]
    if payload.nbytes != expected:
        raise _bad(f"field {key!r}: {payload.nbytes} bytes but {dtype}{shape} needs {expected}")
    return dtype, tuple(shape), payload


def _opt_int(v: Any, what: str) -> int | None:
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool):
        raise _bad(f"{what} must be an int or nil, got {v!r}")
    return v


def _slice(entry: Any, key: str) -> slice:
    if not (isinstance(entry, list) and len(entry) == 3):
        raise _bad(f"field {key!r}: a slice must be [start, stop, step]")
    start, stop, step = (_opt_int(v, f"field {key!r} slice bound") for v in entry)
    if step == 0:
        raise _bad(f"field {key!r}: slice step must not be 0")
    return slice(start, stop, step)


def _field(key: str, field: Any, rank: int | None) -> FieldConfig:
    if not (isinstance(field, list) and len(field) == 2 and isinstance(field[0], str) and isinstance(field[1], dict)):
        raise _bad(f"field {key!r}: field must be [name, {{kwargs}}]")
    name, kw = field
    if name not in FIELD_KINDS:
        raise _bad(f"field {key!r}: unknown field kind {name!r}")
    allowed = {"batched": {"keep_on_cpu"}, "flat": {"keep_on_cpu", "slices", "dim"},
               "shared": {"keep_on_cpu", "batch_size"}}[name]
    if not set(kw) <= allowed:
        raise _bad(f"field {key!r}: unknown {name} field options {sorted(set(kw) - allowed)}")
    keep = kw.get("keep_on_cpu", False)
    if not isinstance(keep, bool):
        raise _bad(f"field {key!r}: keep_on_cpu must be a bool")
    if name == "batched":
        return FieldConfig("batched", keep)
    if name == "shared":
        bs = kw.get("batch_size")
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise _bad(f"field {key!r}: shared batch_size must be a positive int")
        return FieldConfig("shared", keep, batch_size=bs)
    dim = kw.get("dim", 0)
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise _bad(f"field {key!r}: flat dim must be an int, got {dim!r}")
    if rank is None and dim != 0:
        raise _bad(f"field {key!r}: flat dim {dim} on non-tensor data (only dim 0 is allowed)")
    if rank is not None and not -max(rank, 1) <= dim < max(rank, 1):
        raise _bad(f"field {key!r}: flat dim {dim!r} outside the tensor's rank {rank}")
    slices = kw.get("slices")
    if not isinstance(slices, list):
        raise _bad(f"field {key!r}: flat slices must be a list")
    out: list[slice | tuple[slice, ...]] = []
    for entry in slices:
        # vLLM's rule: an entry whose first element is a list is a tuple of slices (dim > 0); [] is ().
        if isinstance(entry, list) and (not entry or isinstance(entry[0], list)):
            out.append(tuple(_slice(e, key) for e in entry))
        else:
            out.append(_slice(entry, key))
    return FieldConfig("flat", keep, tuple(out), dim)


def encode_kwargs_item(tensors: Mapping[str, Any], fields: Mapping[str, FieldConfig] | None = None) -> bytes:
    """vLLM's all-inline MessagePack of one kwargs item, keys in ``tensors``' own order (vLLM keeps
    the item's dict order; sort first for a canonical form). Values: ndarray, CPU torch tensor,
    ``(dtype, shape, buffer)``, int, float or a list/tuple of these; ``fields`` default to batched."""
    fields = fields or {}
    item = {key: {"data": _wire_value(key, value), "field": (fields.get(key) or FieldConfig()).to_wire()}
            for key, value in tensors.items()}
    return msgpack.packb(item, use_bin_type=True)


def _wire_value(key: str, value: Any) -> Any:
    if isinstance(value, tuple) and value and isinstance(value[0], str):  # (dtype, shape, buffer)
        if len(value) != 3:
            raise InvalidArgument(f"kwargs[{key!r}]: a tuple tensor must be (dtype, shape, buffer)")
        return _wire_tensor(key, *value)
    if isinstance(value, np.ndarray) or type(value).__module__.startswith("torch"):
        flat, dtype, shape = as_byte_array(value)
        return [dtype, list(shape), msgpack.ExtType(EXT_RAW_VIEW, flat.tobytes())]
    if isinstance(value, bool) or value is None:
        raise InvalidArgument(f"kwargs[{key!r}]: {value!r} is not a tensor, int, float or list")
    if isinstance(value, int):
        if not _I64[0] <= value <= _I64[1]:
            raise InvalidArgument(f"kwargs[{key!r}]: int {value} is outside int64")
        return int(value)
    if isinstance(value, float):
        return float(value)  # msgpack float64, as vLLM's msgspec writes every Python float
    if isinstance(value, (list, tuple)):
        return [_wire_value(key, v) for v in value]
    raise InvalidArgument(f"kwargs[{key!r}] must be a tensor, (dtype, shape, buffer), int, float or list, "
                          f"got {type(value).__name__}")


def _wire_tensor(key: str, dtype: Any, shape: Any, buf: Any) -> list[Any]:
    dtype = dtype_name(dtype)
    try:
        dims = [int(d) for d in shape]
        view = memoryview(buf).cast("B")
    except TypeError:
        raise InvalidArgument(f"kwargs[{key!r}]: needs a shape of ints and a C-contiguous buffer") from None
    if any(d < 0 for d in dims) or view.nbytes != math.prod(dims) * DTYPE_ITEMSIZE[dtype]:
        raise InvalidArgument(f"kwargs[{key!r}]: {view.nbytes} bytes do not make {dtype}{dims}")
    return [dtype, dims, msgpack.ExtType(EXT_RAW_VIEW, view.tobytes())]
