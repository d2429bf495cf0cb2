"""Pure-Python/numpy kernels: the SPECIFICATION of the kernel API.

``_native`` (the C kernels behind cffi) must return bit-identical results for every function here;
``tests/test_kernels_equivalence.py`` checks that. Other code uses whichever module
``shmtransport._backend.kernels`` selected.

Buffers are anything with the buffer protocol (bytes, bytearray, memoryview, C-contiguous numpy
arrays of any dtype, mmap) and are treated as raw bytes. ``dst`` must be writable and have the same
nbytes as ``src``; ``dst`` and ``src`` must not overlap.

Hashing is XXH3-128 with seed 0; digests are 16 bytes in canonical (big-endian) order, equal to
``xxhash.xxh3_128(buf).digest()``.

Tree mode (``tree_digest``, ``copy_tree_digest``): with C = ``TREE_CHUNK_NBYTES`` (1 MiB),
if nbytes <= C the digest is the plain XXH3-128 of the bytes; otherwise::

    root = XXH3-128( b"shmt-tree-v1\\0" || u64le(C) || u64le(nbytes) || leaf_0 || leaf_1 || ... )

where leaf_i is the 16-byte digest of chunk i (bytes [i*C, min((i+1)*C, nbytes)); the last chunk
may be short). Chunks can be hashed in parallel; the value does not depend on the thread count.

is_embed masks are packed bits + a bit count: MSB-first within each byte (``np.packbits`` default
``bitorder="big"``). ``packed`` must hold at least ceil(nbits/8) bytes (later bytes are ignored);
padding bits of the last byte are ignored on input and are zero on output.
"""
from __future__ import annotations

import operator
import struct
from typing import Any, Iterable

import numpy as np
import xxhash

from .errors import InvalidArgument, InvalidType

TREE_CHUNK_NBYTES = 1 << 20
"""Chunk size of tree mode (1 MiB). Part of the digest definition: changing it changes digests."""

_TREE_DOMAIN = b"shmt-tree-v1\0"

__all__ = [
    "TREE_CHUNK_NBYTES", "xxh3_128", "xxh3_128_many", "Xxh3Stream", "tree_digest", "copy_tree_digest",
    "copy", "mask_pack", "mask_unpack", "mask_popcount", "mask_indices", "mask_runs", "mask_cumsum",
    "mask_window",
]


# ---------------------------------------------------------------------------------------------
# Argument validation, shared with _native (errors name the argument).
# ---------------------------------------------------------------------------------------------
def _view(buf: Any, name: str, writable: bool = False) -> memoryview:
    """A flat, C-contiguous byte view of ``buf``."""
    if isinstance(buf, str):
        raise InvalidType(f"{name} must be a bytes-like buffer, not str")
    try:
        view = memoryview(buf)
    except TypeError:
        raise InvalidType(f"{name} must support the buffer protocol, got {type(buf).__name__}") from None
    if not view.c_contiguous:
        raise InvalidArgument(f"{name} must be C-contiguous")
    if writable and view.readonly:
        raise InvalidArgument(f"{name} must be writable")
    if view.format != "B" or view.ndim != 1:
        try:
            view = view.cast("B")
        except TypeError as exc:
            raise InvalidType(f"{name}: cannot view buffer as bytes ({exc})") from None
    return view


def _dst_src(dst: Any, src: Any) -> tuple[memoryview, memoryview]:
    s = _view(src, "src")
    d = _view(dst, "dst", writable=True)
    if d.nbytes != s.nbytes:
        raise InvalidArgument(f"dst has {d.nbytes} bytes but src has {s.nbytes}; they must be equal")
    return d, s


def _check_threads(threads: Any) -> int | None:
    if threads is None:
        return None
    if isinstance(threads, bool):
        raise InvalidType("threads must be an int or None")
    try:
        count = operator.index(threads)
    except TypeError:
        raise InvalidType(f"threads must be an int or None, got {type(threads).__name__}") from None
    if count < 1:
        raise InvalidArgument(f"threads must be >= 1, got {count}")
    return count


def _check_int(value: Any, name: str) -> int:
    if isinstance(value, bool):
        raise InvalidType(f"{name} must be an int, not bool")
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidType(f"{name} must be an int, got {type(value).__name__}") from None


def _packed(packed: Any, nbits: Any) -> tuple[memoryview, int]:
    """Validate a packed mask: the view over ceil(nbits/8) bytes, and nbits."""
    view = _view(packed, "packed")
    nbits = _check_int(nbits, "nbits")
    if nbits < 0:
        raise InvalidArgument(f"nbits must be >= 0, got {nbits}")
    needed = (nbits + 7) // 8
    if needed > view.nbytes:
        raise InvalidArgument(f"nbits={nbits} needs {needed} packed bytes but packed has {view.nbytes}")
    return view[:needed], nbits


def _window_args(nbits: int, start: Any, end: Any) -> tuple[int, int]:
    start = _check_int(start, "start")
    end = _check_int(end, "end")
    if start < 0 or start > nbits:
        raise InvalidArgument(f"start={start} must be in [0, nbits={nbits}]")
    if end < start or end > nbits:
        raise InvalidArgument(f"end={end} must be in [start={start}, nbits={nbits}]")
    return start, end


def _bools(bools: Any) -> np.ndarray:
    arr = np.asarray(bools)
    if arr.ndim != 1:
        raise InvalidArgument(f"bools must be one-dimensional, got shape {arr.shape}")
    if arr.dtype != np.bool_:
        if arr.dtype.kind not in "biuf" and arr.size:
            raise InvalidType(f"bools must hold booleans or numbers, got dtype {arr.dtype}")
        arr = arr.astype(np.bool_)
    return np.ascontiguousarray(arr)


def _tree_root(nbytes: int, leaves: bytes | bytearray) -> bytes:
    header = _TREE_DOMAIN + struct.pack("<QQ", TREE_CHUNK_NBYTES, nbytes)
    return xxhash.xxh3_128(header + bytes(leaves)).digest()


# ---------------------------------------------------------------------------------------------
# Hashing and copies.
# ---------------------------------------------------------------------------------------------
def xxh3_128(buf: Any) -> bytes:
    """16-byte canonical XXH3-128 (seed 0) of ``buf``."""
    return xxhash.xxh3_128(_view(buf, "buf")).digest()


def xxh3_128_many(bufs: Iterable[Any]) -> bytes:
    """XXH3-128 of the concatenation of ``bufs``."""
    if isinstance(bufs, (bytes, bytearray, memoryview, str)):
        raise InvalidType("bufs must be an iterable of buffers, not a single buffer")
    h = xxhash.xxh3_128()
    for buf in bufs:
        h.update(_view(buf, "bufs[i]"))
    return h.digest()


class Xxh3Stream:
    """Streaming XXH3-128 (seed 0)."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_128()

    def update(self, buf: Any) -> None:
        """Feed the bytes of ``buf``."""
        self._h.update(_view(buf, "buf"))

    def copy_update(self, dst: Any, src: Any) -> None:
        """Copy ``src`` into ``dst`` and feed the ``src`` bytes."""
        d, s = _dst_src(dst, src)
        d[:] = s
        self._h.update(s)

    def digest(self) -> bytes:
        """The 16-byte digest of everything fed since the last reset; the stream stays usable."""
        return self._h.digest()

    def reset(self) -> None:
        """Start over, as if newly created."""
        self._h.reset()


def tree_digest(buf: Any, threads: int | None = None) -> bytes:
    """Tree-mode digest (see the module docstring). ``threads`` is accepted and ignored here."""
    _check_threads(threads)
    view = _view(buf, "buf")
    nbytes = view.nbytes
    if nbytes <= TREE_CHUNK_NBYTES:
        return xxhash.xxh3_128(view).digest()
    leaves = b"".join(xxhash.xxh3_128(view[off:off + TREE_CHUNK_NBYTES]).digest()
                      for off in range(0, nbytes, TREE_CHUNK_NBYTES))
    return _tree_root(nbytes, leaves)


def copy_tree_digest(dst: Any, src: Any, threads: int | None = None) -> bytes:
    """Copy ``src`` into ``dst``; return ``tree_digest(src)`` (``threads``: as in tree_digest)."""
    _check_threads(threads)
    d, s = _dst_src(dst, src)
    d[:] = s
    return tree_digest(s)


def copy(dst: Any, src: Any, threads: int | None = None) -> None:
    """Copy ``src`` into ``dst`` (same nbytes, no overlap; ``threads`` as in tree_digest)."""
    _check_threads(threads)
    d, s = _dst_src(dst, src)
    d[:] = s


# ---------------------------------------------------------------------------------------------
# is_embed bit masks.
# ---------------------------------------------------------------------------------------------
def _bits(packed: Any, nbits: Any) -> np.ndarray:
    view, nbits = _packed(packed, nbits)
    return np.unpackbits(np.frombuffer(view, dtype=np.uint8), count=nbits).view(np.bool_)


def mask_pack(bools: Any) -> np.ndarray:
    """Pack booleans (nonzero = set) into MSB-first bytes; padding bits are zero."""
    return np.packbits(_bools(bools))


def mask_unpack(packed: Any, nbits: Any) -> np.ndarray:
    """The ``nbits`` booleans of a packed mask."""
    return _bits(packed, nbits)


def mask_popcount(packed: Any, nbits: Any) -> int:
    """Number of set bits among the first ``nbits``."""
    return int(np.count_nonzero(_bits(packed, nbits)))


def mask_indices(packed: Any, nbits: Any) -> np.ndarray:
    """Positions of the set bits, ascending, int64."""
    return np.flatnonzero(_bits(packed, nbits)).astype(np.int64, copy=False)


def mask_runs(packed: Any, nbits: Any) -> np.ndarray:
    """(start, length) of each maximal run of set bits, int64, shape (k, 2)."""
    bits = _bits(packed, nbits).view(np.int8)
    edges = np.diff(np.concatenate((np.zeros(1, np.int8), bits, np.zeros(1, np.int8))))
    starts = np.flatnonzero(edges == 1)
    ends = np.flatnonzero(edges == -1)
    return np.stack((starts, ends - starts), axis=1).astype(np.int64, copy=False).reshape(-1, 2)


def mask_cumsum(packed: Any, nbits: Any) -> np.ndarray:
    """Inclusive cumulative sum of the bits, int64, length nbits."""
    return np.cumsum(_bits(packed, nbits), dtype=np.int64)


def mask_window(packed: Any, nbits: Any, start: Any, end: Any) -> tuple[int, int]:
    """(#set in [0, start), #set in [0, end)); requires 0 <= start <= end <= nbits."""
    bits = _bits(packed, nbits)
    start, end = _window_args(bits.size, start, end)
    return int(np.count_nonzero(bits[:start])), int(np.count_nonzero(bits[:end]))
