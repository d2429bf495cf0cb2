"""The kernel API over the C kernels (cffi, API mode: every call releases the GIL).

Same functions, same results as ``_purepy`` (the specification; its docstring defines tree mode
and the mask bit order). This wrapper validates every argument before calling C (the kernels
validate again and never touch memory outside the buffers they are given), allocates outputs and
the XXH3 streaming state, and owns the thread pool of ``tree_digest``.

If the extension was built without XXH3 (``SHMT_XXH=none``) the hashing functions here use the
``xxhash`` package; the copy and mask kernels are C either way.
"""
from __future__ import annotations

import itertools
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Iterable

import numpy as np

from . import __version__, _purepy
from ._purepy import TREE_CHUNK_NBYTES, _bools, _check_threads, _dst_src, _packed, _tree_root, _view, _window_args
from .errors import InvalidArgument, InvalidType


def _load_extension():
    try:
        from . import _shmt_c
    except ImportError as exc:
        if "XXH" not in str(exc):
            raise
        # Built in "pypkg" mode: the XXH3 symbols come from the xxhash package's extension, which
        # must be loaded with RTLD_GLOBAL before ours.
        import ctypes
        import importlib.util

        spec = importlib.util.find_spec("xxhash._xxhash")
        if spec is None or not spec.origin:
            raise
        ctypes.CDLL(spec.origin, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
        from . import _shmt_c
    return _shmt_c.ffi, _shmt_c.lib


ffi, lib = _load_extension()

_built_for = ffi.string(lib.shmt_package_version()).decode()
if _built_for != __version__:
    raise ImportError(f"shmtransport._shmt_c was built for shmtransport {_built_for}, this is {__version__}: "
                      "a stale build; reinstall (or rebuild) the package")
if lib.SHMT_TREE_CHUNK_NBYTES != TREE_CHUNK_NBYTES:  # pragma: no cover - build/source mismatch
    raise ImportError("shmtransport._shmt_c was built with a different tree chunk size; rebuild it")

HAVE_XXH3 = bool(lib.shmt_have_xxh3())
XXH_LINK_MODE = {0: "none", 1: "system", 2: "pypkg"}.get(lib.shmt_xxh_link_mode(), "unknown")

__all__ = list(_purepy.__all__)


def _check(rc: int, what: str) -> None:
    if rc == lib.SHMT_OK:
        return
    if rc == lib.SHMT_ENOHASH:  # pragma: no cover - guarded by HAVE_XXH3
        raise RuntimeError(f"{what}: the C extension was built without XXH3")
    raise InvalidArgument(f"{what}: the C kernel rejected its arguments (code {rc})")


def _ptr(view: memoryview):
    return ffi.from_buffer("uint8_t[]", view)


def _wptr(view: memoryview):
    return ffi.from_buffer("uint8_t[]", view, require_writable=True)


def _i64ptr(arr: np.ndarray):
    return ffi.from_buffer("int64_t[]", arr, require_writable=True)


# ---------------------------------------------------------------------------------------------
# Thread pool of tree_digest: created on first use, dropped in a forked child.
# ---------------------------------------------------------------------------------------------
_TREE_BLOCK_CHUNKS = 4  # at most this many chunks per claim (4 MiB: ~0.2 ms of hashing)
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _get_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="shmt-hash")
        return _pool


def _forget_pool() -> None:
    global _pool, _pool_lock
    _pool = None
    _pool_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


# ---------------------------------------------------------------------------------------------
# Hashing and copies.
# ---------------------------------------------------------------------------------------------
def xxh3_128(buf: Any) -> bytes:
    view = _view(buf, "buf")
    if not HAVE_XXH3:
        return _purepy.xxh3_128(view)
    out = ffi.new("uint8_t[16]")
    _check(lib.shmt_xxh3_128(_ptr(view), view.nbytes, out, 16), "xxh3_128")
    return ffi.buffer(out)[:]


def xxh3_128_many(bufs: Iterable[Any]) -> bytes:
    if isinstance(bufs, (bytes, bytearray, memoryview, str)):
        raise InvalidType("bufs must be an iterable of buffers, not a single buffer")
    stream = Xxh3Stream()
    for buf in bufs:
        stream._update_view(_view(buf, "bufs[i]"))
    return stream.digest()


class Xxh3Stream:
    """Streaming XXH3-128 (seed 0); the state is allocated here and freed by the GC."""

    def __init__(self) -> None:
        if HAVE_XXH3:
            state = lib.XXH3_createState()
            if state == ffi.NULL:
                raise MemoryError("XXH3_createState failed")
            self._state = ffi.gc(state, lib.XXH3_freeState)
            _check(lib.shmt_xxh3_stream_reset(self._state), "Xxh3Stream.reset")
        else:
            self._state = _purepy.Xxh3Stream()

    def _update_view(self, view: memoryview) -> None:
        if HAVE_XXH3:
            _check(lib.shmt_xxh3_stream_update(self._state, _ptr(view), view.nbytes), "Xxh3Stream.update")
        else:
            self._state.update(view)

    def update(self, buf: Any) -> None:
        self._update_view(_view(buf, "buf"))

    def copy_update(self, dst: Any, src: Any) -> None:
        """Copy ``src`` into ``dst`` and feed the ``src`` bytes, in one pass over the data."""
        d, s = _dst_src(dst, src)
        if HAVE_XXH3:
            _check(lib.shmt_xxh3_stream_copy_update(self._state, _wptr(d), d.nbytes, _ptr(s), s.nbytes),
                   "Xxh3Stream.copy_update")
        else:
            copy(d, s)
            self._state.update(s)

    def digest(self) -> bytes:
        if not HAVE_XXH3:
            return self._state.digest()
        out = ffi.new("uint8_t[16]")
        _check(lib.shmt_xxh3_stream_digest(self._state, out, 16), "Xxh3Stream.digest")
        return ffi.buffer(out)[:]

    def reset(self) -> None:
        if HAVE_XXH3:
            _check(lib.shmt_xxh3_stream_reset(self._state), "Xxh3Stream.reset")
        else:
            self._state.reset()


def tree_digest(buf: Any, threads: int | None = None) -> bytes:
    """Tree-mode digest; the chunks are split over ``threads`` threads (None: all cores)."""
    threads = _check_threads(threads)
    view = _view(buf, "buf")
    nbytes = view.nbytes
    if not HAVE_XXH3:
        return _purepy.tree_digest(view)
    if nbytes <= TREE_CHUNK_NBYTES:
        return xxh3_128(view)
    nchunks = -(-nbytes // TREE_CHUNK_NBYTES)
    leaves = bytearray(16 * nchunks)
    src, out = _ptr(view), ffi.from_buffer("uint8_t[]", leaves)

    def hash_range(first: int, last: int) -> None:
        _check(lib.shmt_tree_leaves(src, nbytes, first, last, out + 16 * first, 16 * (last - first)),
               "tree_digest")

    _over_chunks(nchunks, _parallelism(threads, nbytes, nchunks), lambda: hash_range)
    return _tree_root(nbytes, leaves)


# Below this size a thread hand-off costs more than the memory bandwidth a second core adds.
_PARALLEL_MIN_NBYTES = 4 * TREE_CHUNK_NBYTES


def _parallelism(threads: int | None, nbytes: int, nchunks: int) -> int:
    if threads is None:
        threads = os.cpu_count() or 1 if nbytes >= _PARALLEL_MIN_NBYTES else 1
    return max(1, min(threads, nchunks))


def _over_chunks(nchunks: int, nthreads: int, make_worker) -> None:
    """Run ``make_worker()(first, last)`` over chunk ranges covering [0, nchunks), on ``nthreads``
    threads (this one included). Threads claim blocks from a shared counter (next() on
    itertools.count is atomic under the GIL), so a thread that gets less CPU does less work.

    Returns only once no thread touches the buffers any more, also when this thread's part is
    interrupted (KeyboardInterrupt, an error): the caller may then free or reuse them."""
    if nthreads <= 1:
        make_worker()(0, nchunks)
        return
    step = max(1, min(_TREE_BLOCK_CHUNKS, nchunks // (4 * nthreads)))
    blocks = itertools.count()
    stopped = threading.Event()

    def worker() -> None:
        do_range = make_worker()
        while not stopped.is_set():
            first = next(blocks) * step
            if first >= nchunks:
                return
            do_range(first, min(first + step, nchunks))

    pool = _get_pool()
    futures = [pool.submit(worker) for _ in range(nthreads - 1)]
    try:
        worker()
    finally:
        stopped.set()  # the others finish the block they are in, and claim no more
        wait(futures)
    for future in futures:
        future.result()


def copy_tree_digest(dst: Any, src: Any, threads: int | None = None) -> bytes:
    """Copy ``src`` into ``dst`` and return ``tree_digest(src)``, in one pass over the data; the
    chunks are split over ``threads`` threads (None: all cores). Chunk ranges start on chunk
    boundaries, so each thread's leaves are exactly the whole buffer's leaves."""
    threads = _check_threads(threads)
    d, s = _dst_src(dst, src)
    if not HAVE_XXH3:
        copy(d, s)
        return _purepy.tree_digest(s)
    nbytes = s.nbytes
    nchunks = max(1, -(-nbytes // TREE_CHUNK_NBYTES))
    leaves = bytearray(16 * nchunks)
    out, dptr, sptr = ffi.from_buffer("uint8_t[]", leaves), _wptr(d), _ptr(s)

    def make_worker():
        state = ffi.gc(lib.XXH3_createState(), lib.XXH3_freeState)
        if state == ffi.NULL:
            raise MemoryError("XXH3_createState failed")

        def copy_range(first: int, last: int) -> None:
            off = first * TREE_CHUNK_NBYTES
            n = min(nbytes, last * TREE_CHUNK_NBYTES) - off
            _check(lib.shmt_copy_tree_leaves(state, dptr + off, n, sptr + off, n, out + 16 * first,
                                             16 * (last - first)), "copy_tree_digest")
        return copy_range

    _over_chunks(nchunks, _parallelism(threads, nbytes, nchunks), make_worker)
    if nbytes == 0:
        return xxh3_128(b"")
    if nbytes <= TREE_CHUNK_NBYTES:
        return bytes(leaves)  # the single leaf is the plain XXH3-128 of the bytes
    return _tree_root(nbytes, leaves)


def copy(dst: Any, src: Any, threads: int | None = None) -> None:
    """Copy ``src`` into ``dst`` (same nbytes, no overlap); non-temporal stores for large sizes,
    split over ``threads`` threads (None: all cores for large sizes)."""
    threads = _check_threads(threads)
    d, s = _dst_src(dst, src)
    nbytes = s.nbytes
    nchunks = max(1, -(-nbytes // TREE_CHUNK_NBYTES))
    dptr, sptr = _wptr(d), _ptr(s)
    if d.nbytes != nbytes:
        _check(lib.shmt_copy(dptr, d.nbytes, sptr, nbytes), "copy")  # reports the size mismatch

    def copy_range(first: int, last: int) -> None:
        off = first * TREE_CHUNK_NBYTES
        n = min(nbytes, last * TREE_CHUNK_NBYTES) - off
        _check(lib.shmt_copy(dptr + off, n, sptr + off, n), "copy")

    _over_chunks(nchunks, _parallelism(threads, nbytes, nchunks), lambda: copy_range)


# ---------------------------------------------------------------------------------------------
# is_embed bit masks.
# ---------------------------------------------------------------------------------------------
# Outputs in [256 KiB, 4 MiB) are populated up front. From 4 MiB on numpy asks for transparent huge
# pages, whose faults are few and cheap; populating those ranges measured slower here.
_PREFAULT_MIN_NBYTES = 256 * 1024
_PREFAULT_MAX_NBYTES = 4 * 1024 * 1024
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; older kernels answer EINVAL and we fault lazily


def _load_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        return fn
    except (OSError, AttributeError):  # pragma: no cover - no libc madvise
        return None


_madvise = _load_madvise()


def _empty(shape: Any, dtype: Any) -> np.ndarray:
    """np.empty whose pages are populated in one madvise call instead of one page fault per 4 KiB
    page inside the kernel (fresh large allocations come straight from mmap)."""
    out = np.empty(shape, dtype=dtype)
    if _madvise is not None and _PREFAULT_MIN_NBYTES <= out.nbytes < _PREFAULT_MAX_NBYTES:
        addr = out.ctypes.data
        start = (addr + 4095) & ~4095
        end = (addr + out.nbytes) & ~4095
        if end > start:
            _madvise(start, end - start, _MADV_POPULATE_WRITE)  # best effort: errors are ignored
    return out


def mask_pack(bools: Any) -> np.ndarray:
    arr = _bools(bools)
    nbits = arr.size
    out = _empty((nbits + 7) // 8, np.uint8)
    _check(lib.shmt_mask_pack(_ptr(_view(arr, "bools")), nbits, _wptr(_view(out, "out")), out.size), "mask_pack")
    return out


def mask_unpack(packed: Any, nbits: Any) -> np.ndarray:
    view, nbits = _packed(packed, nbits)
    out = _empty(nbits, np.bool_)
    _check(lib.shmt_mask_unpack(_ptr(view), view.nbytes, nbits, _wptr(_view(out, "out")), nbits), "mask_unpack")
    return out


def mask_popcount(packed: Any, nbits: Any) -> int:
    view, nbits = _packed(packed, nbits)
    count = lib.shmt_mask_popcount(_ptr(view), view.nbytes, nbits)
    _check(min(count, 0), "mask_popcount")
    return int(count)


def mask_indices(packed: Any, nbits: Any) -> np.ndarray:
    view, nbits = _packed(packed, nbits)
    src = _ptr(view)
    count = lib.shmt_mask_popcount(src, view.nbytes, nbits)
    _check(min(count, 0), "mask_indices")
    out = _empty(count, np.int64)
    _check(lib.shmt_mask_indices(src, view.nbytes, nbits, _i64ptr(out), count), "mask_indices")
    return out


def mask_runs(packed: Any, nbits: Any) -> np.ndarray:
    view, nbits = _packed(packed, nbits)
    src = _ptr(view)
    count = lib.shmt_mask_count_runs(src, view.nbytes, nbits)
    _check(min(count, 0), "mask_runs")
    out = _empty((count, 2), np.int64)
    _check(lib.shmt_mask_runs(src, view.nbytes, nbits, _i64ptr(out), 2 * count), "mask_runs")
    return out


def mask_cumsum(packed: Any, nbits: Any) -> np.ndarray:
    view, nbits = _packed(packed, nbits)
    out = _empty(nbits, np.int64)
    _check(lib.shmt_mask_cumsum(_ptr(view), view.nbytes, nbits, _i64ptr(out), nbits), "mask_cumsum")
    return out


def mask_window(packed: Any, nbits: Any, start: Any, end: Any) -> tuple[int, int]:
    view, nbits = _packed(packed, nbits)
    start, end = _window_args(nbits, start, end)
    out = ffi.new("int64_t[2]")
    _check(lib.shmt_mask_window(_ptr(view), view.nbytes, nbits, start, end, out, 2), "mask_window")
    return int(out[0]), int(out[1])
