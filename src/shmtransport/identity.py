"""Content identity of one multimodal item.

An identity is ``"{scheme}:{hex}"``. For the ``xxh3-128`` and ``blake3`` schemes it is computed in
two levels, so the producer can fuse hashing into its copy into shared memory and the worker can
verify tensors in parallel:

1. ``tensor_digest(scheme, buf)`` per tensor: xxh3-128 = tree-mode XXH3-128 of the bytes
   (``kernels.tree_digest``: plain XXH3-128 up to ``TREE_CHUNK_NBYTES``, a chunked tree above);
   blake3 = BLAKE3-256 of the bytes.
2. ``combine(scheme, modality, entries)``: the scheme's hash (XXH3-128 / BLAKE3-256) over ::

       b"shmtransport.identity.v1\\0" || framed(scheme) || framed(modality) || u64le(count)
       || for each entry in sorted key order:
            framed(key) || framed(dtype) || u64le(rank) || u64le(dim)*rank || u64le(nbytes) || digest

   with ``framed(s) = u64le(len(utf8(s))) || utf8(s)``. Keys are sorted by code point (= UTF-8
   byte order). Key, dtype and shape are all hashed, so items that differ only in those never
   share an identity.

   A key whose data is not one tensor (vLLM's NestedTensors: an int, a bool, a float or a list of
   these and tensors) is the entry ``framed(key) || framed("nested") || u64le(0) || u64le(0) ||
   value_digest``: "nested" is no dtype name, so it never reads as a tensor entry, and an item of
   tensors only keeps its identity. ``value_digest`` is the scheme's hash over ::

       tensor: b"T" || framed(dtype) || u64le(rank) || u64le(dim)*rank || u64le(nbytes) || digest
       int:    b"I" || i128le          bool: b"B" || u8          float: b"F" || f64le bits
       list:   b"L" || u64le(count) || each element (a tuple that is not a tensor is a list)

The ``grpc-mm`` scheme is vLLM gRPC's identity of a preprocessed item: SHA-256 over the exact
MessagePack bytes of its kwargs (``grpc_mm_identity``; recipe in reference/protocol-facts.md 1.6).
Those bytes are vLLM's ``MsgpackEncoder(size_threshold=2**62).encode(item)[0]``, which
``protocol.msgpack_kwargs.encode_kwargs_item`` reproduces byte for byte (same key order), so an
item has the same grpc-mm identity whichever side encoded it.

Every scheme is one ``IdentityScheme`` entry in ``SCHEMES``: callers look up its properties
(``identity_scheme(name)``, ``scheme_from_pb(value)``) instead of comparing names.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import struct
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from ._backend import kernels
from .errors import InvalidArgument
from .tensors import DTYPE_ITEMSIZE, as_byte_array, dtype_name
from .v1 import features_pb2 as fpb

DEFAULT_SCHEME = "xxh3-128"  # also what a batch's IDENTITY_SCHEME_UNSPECIFIED means

_DOMAIN = b"shmtransport.identity.v1\0"
NESTED = "nested"  # the dtype slot of a non-tensor value's entry: no tensor dtype has this name
_MSGPACK_INT = (-(1 << 63), (1 << 64) - 1)  # the ints a kwargs item can carry
_GRPC_MM_DOMAIN = b"vllm.grpc.preprocessed-mm.v1"

__all__ = [
    "IdentityScheme", "SCHEMES", "identity_scheme", "scheme_from_pb", "DEFAULT_SCHEME", "DTYPE_ITEMSIZE",
    "dtype_name", "tensor_digest", "value_digest", "combine", "item_identity", "is_tensor_value", "NESTED",
    "grpc_mm_identity", "cache_identifier", "validate_uuid",
]


def _u64(n: int) -> bytes:
    return struct.pack("<Q", n)


def _framed(s: str) -> bytes:
    raw = s.encode("utf-8")
    return _u64(len(raw)) + raw


@dataclasses.dataclass(frozen=True)
class IdentityScheme:
    """One identity scheme: everything the frontend, validation and the worker decide by it.

    A two-level scheme (``tensor_hash`` and ``stream_hash``) is computed from the tensors:
    ``tensor_hash(buf, threads)`` gives each tensor's ``digest_nbytes`` digest and ``combine`` hashes
    the framed entries with ``stream_hash``. A scheme with ``msgpack_identity(modality, raw)`` is
    computed over the item's exact kwargs MessagePack bytes instead, so items must carry them."""

    name: str
    pb: int  # features.proto IdentityScheme value naming the scheme on the wire
    tensor_hash: Callable[[Any, int | None], bytes] | None = None
    stream_hash: Callable[[bytes], bytes] | None = None
    digest_nbytes: int = 0
    msgpack_identity: Callable[[str, Any], str] | None = None
    # the producer's digest fused into the copy into shared memory (put/commit with digest=True, a
    # tree XXH3-128) is this scheme's tensor digest: the frontend then hashes nothing itself
    uses_fused_digest: bool = False

    @property
    def over_msgpack(self) -> bool:
        """True when the identity covers the kwargs MessagePack bytes, not the tensors."""
        return self.msgpack_identity is not None


def identity_scheme(name: Any) -> IdentityScheme:
    """The registered scheme called ``name``; InvalidArgument naming the known ones otherwise."""
    scheme = SCHEMES.get(name) if isinstance(name, str) else None
    if scheme is None:
        raise InvalidArgument(f"unknown identity scheme {name!r}: expected one of {', '.join(SCHEMES)}")
    return scheme


def scheme_from_pb(value: int) -> IdentityScheme:
    """The scheme a batch's ``identity_scheme`` enum value names (UNSPECIFIED: ``DEFAULT_SCHEME``)."""
    if value == fpb.IDENTITY_SCHEME_UNSPECIFIED:
        return SCHEMES[DEFAULT_SCHEME]
    for scheme in SCHEMES.values():
        if scheme.pb == value:
            return scheme
    raise InvalidArgument(f"unknown identity scheme {value}")


def _check_scheme(name: Any) -> IdentityScheme:
    """The two-level scheme called ``name`` (what ``tensor_digest`` and ``combine`` compute)."""
    scheme = SCHEMES.get(name) if isinstance(name, str) else None
    if scheme is None:
        allowed = [n for n, s in SCHEMES.items() if not s.over_msgpack]
        raise InvalidArgument(f"scheme must be one of {', '.join(allowed)}, got {name!r}")
    if scheme.msgpack_identity is not None:  # over_msgpack
        raise InvalidArgument(f"scheme {name!r} is computed over the msgpack payload: use "
                              f"{scheme.msgpack_identity.__name__}")
    return scheme


def _check_modality(modality: Any) -> str:
    if not isinstance(modality, str) or not modality:
        raise InvalidArgument(f"modality must be a non-empty str, got {modality!r}")
    return modality


def _tensor_parts(key: str, value: Any) -> tuple[str, tuple[int, ...], memoryview]:
    """(dtype name, shape, C-order bytes) of an ndarray, a torch tensor or a (dtype, shape, buffer)."""
    if isinstance(value, tuple):
        if len(value) != 3:
            raise InvalidArgument(f"tensors[{key!r}]: a tuple must be (dtype_name, shape, buffer)")
        name, shape, buf = value
        name = dtype_name(name)
        shape = _check_shape(key, shape)
        try:
            view = memoryview(buf)
        except TypeError:
            raise InvalidArgument(f"tensors[{key!r}]: {type(buf).__name__} is not a buffer") from None
        if not view.c_contiguous:
            raise InvalidArgument(f"tensors[{key!r}]: buffer must be C-contiguous")
        return name, shape, view.cast("B")
    if isinstance(value, np.ndarray) or type(value).__module__.startswith("torch"):
        if not isinstance(value, np.ndarray) and value.device.type != "cpu":
            value = value.cpu()
        flat, name, shape = as_byte_array(value)
        return name, shape, flat.data  # = memoryview(flat); numpy's stubs make ndarray a Buffer on 3.12+ only
    raise InvalidArgument(f"tensors[{key!r}] must be an ndarray, a torch.Tensor or (dtype, shape, buffer), "
                          f"got {type(value).__name__}")


def is_tensor_value(value: Any) -> bool:
    """Whether a kwargs value is one tensor: vLLM's rule in our value form (a tuple led by a dtype
    name, an ndarray or a torch tensor); anything else is non-tensor data (int, float, list)."""
    if isinstance(value, tuple):
        return bool(value) and isinstance(value[0], str)
    return isinstance(value, np.ndarray) or type(value).__module__.startswith("torch")


def _check_shape(key: str, shape: Any) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in shape)
    except TypeError:
        raise InvalidArgument(f"shape of {key!r} must be a sequence of ints, got {shape!r}") from None
    if any(d < 0 for d in dims):
        raise InvalidArgument(f"shape of {key!r} has a negative dimension: {dims}")
    return dims


# ---------------------------------------------------------------------------------------------
# Two-level identity
# ---------------------------------------------------------------------------------------------
def tensor_digest(scheme: str, buf: Any, threads: int | None = None) -> bytes:
    """Per-tensor digest of the raw bytes: tree-mode XXH3-128 (16 bytes), BLAKE3 (32 bytes), ..."""
    tensor_hash = _check_scheme(scheme).tensor_hash
    assert tensor_hash is not None  # _check_scheme returns a two-level scheme
    return tensor_hash(buf, threads)


def value_digest(scheme: str, value: Any, threads: int | None = None, key: str = "value") -> bytes:
    """Digest of a non-tensor kwargs value (int, bool, float, or a list/tuple of these and tensors),
    the ``value_digest`` of a ``"nested"`` entry (recipe in the module docstring)."""
    spec = _check_scheme(scheme)
    parts: list[bytes] = []
    _encode_value(scheme, key, value, threads, parts)
    assert spec.stream_hash is not None  # _check_scheme returns a two-level scheme
    return spec.stream_hash(b"".join(parts))


def _encode_value(scheme: str, key: str, value: Any, threads: int | None, parts: list[bytes]) -> None:
    if is_tensor_value(value):
        name, shape, view = _tensor_parts(key, value)
        parts += [b"T", _framed(name), _u64(len(shape)), *(_u64(d) for d in shape), _u64(view.nbytes),
                  tensor_digest(scheme, view, threads)]
    elif isinstance(value, bool):  # before int: True and 1 are different data to the model
        parts += [b"B", bytes([value])]
    elif isinstance(value, int):
        if not _MSGPACK_INT[0] <= value <= _MSGPACK_INT[1]:
            raise InvalidArgument(f"tensors[{key!r}]: int {value} is outside int64/uint64")
        parts += [b"I", value.to_bytes(16, "little", signed=True)]
    elif isinstance(value, float):
        parts += [b"F", struct.pack("<d", value)]  # the bits: NaN payloads and -0.0 stay distinct
    elif isinstance(value, (list, tuple)):
        parts += [b"L", _u64(len(value))]
        for v in value:
            _encode_value(scheme, key, v, threads, parts)
    else:
        raise InvalidArgument(f"tensors[{key!r}] must be a tensor, an int, a bool, a float or a list of these, "
                              f"got {type(value).__name__}")


def _xxh3_tree(buf: Any, threads: int | None) -> bytes:
    try:
        return kernels.tree_digest(buf, threads)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(str(exc)) from exc


def _xxh3(stream: bytes) -> bytes:
    return kernels.xxh3_128(stream)  # looked up per call: ``kernels`` is the selected backend


def _blake3_tensor(buf: Any, threads: int | None) -> bytes:
    import blake3

    try:
        view = memoryview(buf)
    except TypeError:
        raise InvalidArgument(f"buf must support the buffer protocol, got {type(buf).__name__}") from None
    if not view.c_contiguous:
        raise InvalidArgument("buf must be C-contiguous")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)):
        raise InvalidArgument(f"threads must be an int or None, got {threads!r}")
    max_threads = blake3.blake3.AUTO if threads is None else int(threads)
    if max_threads != blake3.blake3.AUTO and max_threads < 1:
        raise InvalidArgument(f"threads must be >= 1, got {threads}")
    return blake3.blake3(view.cast("B"), max_threads=max_threads).digest()


def _blake3(stream: bytes) -> bytes:
    import blake3

    return blake3.blake3(stream).digest()


def combine(scheme: str, modality: str, entries: Iterable[tuple[str, str, Sequence[int], int, bytes]]) -> str:
    """Item identity from per-tensor entries ``(key, dtype_name, shape, nbytes, digest)``; a
    non-tensor value's entry is ``(key, NESTED, (), 0, value_digest)``."""
    spec = _check_scheme(scheme)
    _check_modality(modality)
    checked = []
    seen: set[str] = set()
    for row in entries:
        if not isinstance(row, (tuple, list)) or len(row) != 5:
            raise InvalidArgument("entries must be (key, dtype_name, shape, nbytes, digest) tuples")
        key, dtype, shape, nbytes, digest = row
        if not isinstance(key, str) or not key:
            raise InvalidArgument(f"entry key must be a non-empty str, got {key!r}")
        if key in seen:
            raise InvalidArgument(f"entry key {key!r} appears twice")
        seen.add(key)
        dims = _check_shape(key, shape)
        if dtype == NESTED:
            expected = 0
            if dims:
                raise InvalidArgument(f"a {NESTED} entry of {key!r} has no shape, got {list(dims)}")
        else:
            dtype = dtype_name(dtype)
            expected = math.prod(dims) * DTYPE_ITEMSIZE[dtype]
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes != expected:
            raise InvalidArgument(f"nbytes of {key!r} is {nbytes!r} but {dtype}{list(dims)} has {expected}")
        try:
            digest = bytes(digest)
        except TypeError:
            raise InvalidArgument(f"digest of {key!r} must be bytes") from None
        if len(digest) != spec.digest_nbytes:
            raise InvalidArgument(f"digest of {key!r} must be {spec.digest_nbytes} bytes for {scheme}")
        checked.append((key, dtype, dims, nbytes, digest))
    parts = [_DOMAIN, _framed(scheme), _framed(modality), _u64(len(checked))]
    for key, dtype, dims, nbytes, digest in sorted(checked, key=lambda r: r[0]):
        parts += [_framed(key), _framed(dtype), _u64(len(dims)), *(_u64(d) for d in dims), _u64(nbytes), digest]
    assert spec.stream_hash is not None  # _check_scheme returns a two-level scheme
    digest = spec.stream_hash(b"".join(parts))
    return f"{scheme}:{digest.hex()}"


def item_identity(modality: str, tensors: Mapping[str, Any], scheme: str = DEFAULT_SCHEME,
                  threads: int | None = None) -> str:
    """Identity of one item from its kwargs: tensors (ndarray, torch.Tensor or (dtype, shape,
    buffer)) and vLLM's non-tensor data (int, bool, float, list/tuple of these and tensors)."""
    _check_scheme(scheme)
    _check_modality(modality)
    if not isinstance(tensors, Mapping):
        raise InvalidArgument(f"tensors must be a mapping of key -> tensor, got {type(tensors).__name__}")
    entries = []
    for key, value in tensors.items():
        if not isinstance(key, str) or not key:
            raise InvalidArgument(f"tensor key must be a non-empty str, got {key!r}")
        if is_tensor_value(value):
            name, shape, view = _tensor_parts(key, value)
            entries.append((key, name, shape, view.nbytes, tensor_digest(scheme, view, threads)))
        else:
            entries.append((key, NESTED, (), 0, value_digest(scheme, value, threads, key)))
    return combine(scheme, modality, entries)


# ---------------------------------------------------------------------------------------------
# vLLM gRPC compatibility, cache identifiers, UUID validation
# ---------------------------------------------------------------------------------------------
def grpc_mm_identity(modality: str, kwargs_msgpack: bytes) -> str:
    """``"grpc-mm:" + hex(SHA256(b"vllm.grpc.preprocessed-mm.v1" || u64be(len(modality)) || modality
    || u64be(len(raw)) || raw))`` over the exact MessagePack bytes ``raw``: never re-encode them (key
    order, and so the identity, is the producer's)."""
    _check_modality(modality)
    try:
        raw = memoryview(kwargs_msgpack).cast("B")
    except TypeError:
        raise InvalidArgument(f"kwargs_msgpack must be bytes, got {type(kwargs_msgpack).__name__}") from None
    mod = modality.encode("utf-8")
    h = hashlib.sha256(_GRPC_MM_DOMAIN)
    h.update(struct.pack(">Q", len(mod)))
    h.update(mod)
    h.update(struct.pack(">Q", raw.nbytes))
    h.update(raw)
    return "grpc-mm:" + h.hexdigest()


# ---------------------------------------------------------------------------------------------
# The registry: name -> scheme, in the order ServerInfo advertises them. A new scheme is one entry.
# ---------------------------------------------------------------------------------------------
SCHEMES: dict[str, IdentityScheme] = {s.name: s for s in (
    IdentityScheme("xxh3-128", fpb.IDENTITY_SCHEME_XXH3_128, _xxh3_tree, _xxh3, 16, uses_fused_digest=True),
    IdentityScheme("blake3", fpb.IDENTITY_SCHEME_BLAKE3, _blake3_tensor, _blake3, 32),
    IdentityScheme("grpc-mm", fpb.IDENTITY_SCHEME_GRPC_MM, msgpack_identity=grpc_mm_identity),
)}


def cache_identifier(mm_hash: str, adapter: str | None = None) -> str:
    """vLLM's encoder-cache identifier: ``"{adapter}:{mm_hash}"`` with a LoRA adapter, else mm_hash."""
    validate_uuid(mm_hash)
    if adapter is not None and not isinstance(adapter, str):
        raise InvalidArgument(f"adapter must be a str or None, got {type(adapter).__name__}")
    return f"{adapter}:{mm_hash}" if adapter else mm_hash


def validate_uuid(s: Any) -> str:
    """Reject identifiers that are unsafe as cache keys or path components; returns ``s``."""
    if not isinstance(s, str):
        raise InvalidArgument(f"uuid must be a str, got {type(s).__name__}")
    if s in ("", ".", ".."):
        raise InvalidArgument(f"uuid must not be {s!r}")
    for bad in ("/", "\\", "\0"):
        if bad in s:
            raise InvalidArgument(f"uuid must not contain {bad!r}")
    return s
