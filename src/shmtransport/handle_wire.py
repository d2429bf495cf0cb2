"""The ``TensorHandle`` wire form read and written by the C kernels (``shmt_wire_*``), without
building protobuf objects: a handoff's hot path. Byte for byte protobuf's own encoding; what the
C reader does not take (unknown or repeated fields, non-ASCII strings, ...) is parsed by protobuf,
which stays the authority. Without the C kernels every function here answers None, and the
caller uses protobuf."""
from __future__ import annotations

import struct
import threading
from typing import NamedTuple, Sequence

from ._backend import BACKEND

if BACKEND == "c":
    from ._native import ffi, lib
else:  # pragma: no cover - exercised under SHMTRANSPORT_BACKEND=python
    ffi = lib = None

# A shmt_wire_handle as the C kernels fill it: 17 u64 fields (offset ... ndim), then the dims.
_HEAD = struct.Struct("<17Q")
_DIMS = [struct.Struct(f"<{n}Q") for n in range(33)]
if ffi is not None and (ffi.offsetof("shmt_wire_handle", "shape") != _HEAD.size
                        or ffi.sizeof("shmt_wire_handle") != _HEAD.size + _DIMS[32].size):
    raise ImportError("shmt_wire_handle's layout is not the one handle_wire reads; rebuild the C kernels")


class Where(NamedTuple):
    """A ``pb.Handle``'s fields as plain values: where the bytes are and whose they are."""

    name: str
    offset: int
    nbytes: int
    owner_id: str
    generation: int
    instance_id: str
    slot: int


class WireFields(NamedTuple):
    """A parsed ``TensorHandle``: its ``shm`` fields, then the tensor's."""

    where: Where
    dtype: str
    shape: tuple[int, ...]
    digest: bytes
    commit_token: bytes


class WireReader:
    """One reusable ``shmt_wire_handle`` for the C calls (``ptr``) and its fields read back in
    one go (``head``, ``shape``); one thread at a time."""

    __slots__ = ("buffer", "ptr")

    def __init__(self) -> None:
        self.buffer = bytearray(_HEAD.size + _DIMS[32].size)
        self.ptr = ffi.from_buffer("shmt_wire_handle *", self.buffer)

    def head(self) -> tuple[int, ...]:
        """offset, nbytes, generation, slot, the (at, len) of name, owner_id, instance_id, dtype,
        digest and commit_token, ndim."""
        return _HEAD.unpack_from(self.buffer)

    def shape(self, ndim: int) -> tuple[int, ...]:
        """The dims."""
        return _DIMS[ndim].unpack_from(self.buffer, _HEAD.size)

    def fields(self, data: bytes) -> WireFields:
        """Every field, after a parse of ``data``."""
        (offset, nbytes, generation, slot, name_at, name_len, owner_at, owner_len, instance_at, instance_len,
         dtype_at, dtype_len, digest_at, digest_len, token_at, token_len, ndim) = self.head()
        return WireFields(
            Where(data[name_at:name_at + name_len].decode("ascii"), offset, nbytes,
                  data[owner_at:owner_at + owner_len].decode("ascii"), generation,
                  data[instance_at:instance_at + instance_len].decode("ascii"), slot),
            data[dtype_at:dtype_at + dtype_len].decode("ascii"), self.shape(ndim),
            data[digest_at:digest_at + digest_len], data[token_at:token_at + token_len],
        )


_readers = threading.local()


def parse(data: bytes) -> WireFields | None:
    """The fields of ``data``, or None when the C reader does not take it (protobuf decides)."""
    if lib is None:
        return None
    reader = getattr(_readers, "reader", None)
    if reader is None:
        reader = _readers.reader = WireReader()
    if lib.shmt_wire_parse(data, len(data), reader.ptr) != 0:
        return None
    return reader.fields(data)


def write(name: bytes, offset: int, nbytes: int, owner_id: bytes, generation: int, instance_id: bytes,
          slot: int, dtype: bytes, shape: Sequence[int], digest: bytes, commit_token: bytes) -> bytes | None:
    """The wire form protobuf writes for these fields; None where the C writer does not run
    (no C kernels, a value past uint64 or a rank past 32)."""
    ndim = len(shape)
    if lib is None or ndim > 32:
        return None
    name_len, owner_len, instance_len, dtype_len = len(name), len(owner_id), len(instance_id), len(dtype)
    digest_len, token_len = len(digest), len(commit_token)
    # Every field's tag and length take at most 3 + 10 bytes; each dim at most 10.
    cap = 13 * 12 + 10 * ndim + name_len + owner_len + instance_len + dtype_len + digest_len + token_len
    out = getattr(_readers, "out", None)
    if out is None or out[2] < cap:
        buffer = bytearray(max(cap, 1024))
        out = _readers.out = (buffer, ffi.from_buffer("uint8_t[]", buffer), len(buffer))
    try:
        n = lib.shmt_wire_write(out[1], cap, name, name_len, offset, nbytes, owner_id, owner_len, generation,
                                instance_id, instance_len, slot, dtype, dtype_len, _DIMS[ndim].pack(*shape), ndim,
                                digest, digest_len, commit_token, token_len)
    except (OverflowError, struct.error):  # a value protobuf would refuse too
        return None
    return ffi.buffer(out[1], n)[:] if n >= 0 else None


def dtype_itemsize(name: str) -> int:
    """The C kernels' item size of a dtype name (0: not one); the same as ``tensors.DTYPES``."""
    encoded = name.encode()
    return int(lib.shmt_dtype_itemsize(encoded, len(encoded))) if lib is not None else 0
