"""Bad arguments to any kernel raise ValueError/TypeError naming the argument, in both backends;
never a crash, never a write outside the given buffers."""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from shmtransport import _purepy
from shmtransport.testing import wait_until

if os.environ.get("SHMTRANSPORT_BACKEND", "auto").strip().lower() == "c":
    from shmtransport import _native
else:
    _native = pytest.importorskip("shmtransport._native", reason="could not import the C kernels: not built",
                                  exc_type=ImportError)

BACKENDS = [pytest.param(_native, id="c"), pytest.param(_purepy, id="python")]


@pytest.fixture(params=BACKENDS)
def k(request):
    return request.param


@pytest.mark.parametrize("call", ["copy", "copy_tree_digest", "stream_copy_update"])
def test_copy_kernels_reject_a_dst_of_another_size_naming_dst(k, call):
    src = bytes(100)
    for dst in (bytearray(99), bytearray(101), bytearray(0)):
        with pytest.raises(ValueError, match="dst"):
            if call == "copy":
                k.copy(dst, src)
            elif call == "copy_tree_digest":
                k.copy_tree_digest(dst, src)
            else:
                k.Xxh3Stream().copy_update(dst, src)


@pytest.mark.parametrize("dst", [bytes(64), memoryview(bytearray(64)).toreadonly()])
def test_copy_kernels_reject_a_read_only_dst_naming_dst(k, dst):
    with pytest.raises(ValueError, match="dst"):
        k.copy(dst, bytes(64))
    with pytest.raises(ValueError, match="dst"):
        k.copy_tree_digest(dst, bytes(64))
    with pytest.raises(ValueError, match="dst"):
        k.Xxh3Stream().copy_update(dst, bytes(64))


def test_read_only_numpy_dst_is_rejected(k):
    dst = np.zeros(64, np.uint8)
    dst.setflags(write=False)
    with pytest.raises(ValueError, match="dst"):
        k.copy(dst, bytes(64))
    assert not dst.any()


def test_non_contiguous_buffers_are_rejected_naming_the_argument(k):
    strided = np.zeros(128, np.uint8)[::2]
    with pytest.raises(ValueError, match="src"):
        k.copy(bytearray(64), strided)
    with pytest.raises(ValueError, match="dst"):
        k.copy(strided, bytes(64))
    with pytest.raises(ValueError, match="buf"):
        k.xxh3_128(strided)
    with pytest.raises(ValueError, match="packed"):
        k.mask_popcount(strided, 8)


@pytest.mark.parametrize("bad", ["text", 12, None, 3.5, object()])
def test_non_buffers_are_rejected_with_type_error_naming_the_argument(k, bad):
    with pytest.raises(TypeError, match="buf"):
        k.xxh3_128(bad)
    with pytest.raises(TypeError, match="buf"):
        k.tree_digest(bad)
    with pytest.raises(TypeError, match="src"):
        k.copy(bytearray(4), bad)
    with pytest.raises(TypeError, match="packed"):
        k.mask_popcount(bad, 0)


def test_xxh3_128_many_rejects_a_single_buffer_and_bad_items(k):
    with pytest.raises(TypeError, match="bufs"):
        k.xxh3_128_many(b"abc")
    with pytest.raises(TypeError, match="bufs"):
        k.xxh3_128_many([b"ok", 5])


@pytest.mark.parametrize("threads,exc", [(0, ValueError), (-1, ValueError), (1.5, TypeError), ("2", TypeError),
                                         (True, TypeError)])
def test_tree_digest_rejects_bad_thread_counts_naming_threads(k, threads, exc):
    with pytest.raises(exc, match="threads"):
        k.tree_digest(bytes(10), threads=threads)


@pytest.mark.parametrize("fn", ["mask_unpack", "mask_popcount", "mask_indices", "mask_runs", "mask_cumsum"])
def test_mask_kernels_reject_bit_counts_that_do_not_fit_naming_nbits(k, fn):
    packed = np.zeros(2, np.uint8)
    for nbits in (17, 24, 10**12):
        with pytest.raises(ValueError, match="nbits"):
            getattr(k, fn)(packed, nbits)
    with pytest.raises(ValueError, match="nbits"):
        getattr(k, fn)(packed, -1)
    with pytest.raises(TypeError, match="nbits"):
        getattr(k, fn)(packed, 3.0)
    with pytest.raises(TypeError, match="nbits"):
        getattr(k, fn)(packed, None)
    with pytest.raises(ValueError, match="nbits"):
        getattr(k, fn)(b"", 1)


def test_mask_kernels_accept_exactly_fitting_and_longer_buffers(k):
    assert k.mask_popcount(np.array([0xFF, 0xFF], np.uint8), 16) == 16
    assert k.mask_popcount(np.array([0xFF, 0xFF, 0xFF], np.uint8), 9) == 9
    assert k.mask_popcount(b"", 0) == 0


@pytest.mark.parametrize("start,end,name", [(-1, 3, "start"), (5, 4, "end"), (0, 11, "end"), (11, 11, "start"),
                                            (3, -1, "end")])
def test_mask_window_rejects_out_of_range_windows_naming_the_bound(k, start, end, name):
    packed = np.packbits(np.ones(10, bool))
    with pytest.raises(ValueError, match=name):
        k.mask_window(packed, 10, start, end)


def test_mask_window_rejects_non_integer_bounds(k):
    packed = np.packbits(np.ones(10, bool))
    with pytest.raises(TypeError, match="start"):
        k.mask_window(packed, 10, 1.0, 2)
    with pytest.raises(TypeError, match="end"):
        k.mask_window(packed, 10, 1, "2")


def test_mask_pack_rejects_multidimensional_input_naming_bools(k):
    with pytest.raises(ValueError, match="bools"):
        k.mask_pack(np.zeros((2, 3), bool))
    with pytest.raises(TypeError, match="bools"):
        k.mask_pack(np.array(["a", "b"]))


def test_c_kernels_reject_inconsistent_sizes_without_touching_memory():
    """Direct calls into the C library with lying sizes return SHMT_EINVAL (defence in depth)."""
    ffi, lib = _native.ffi, _native.lib
    packed = ffi.new("uint8_t[2]", [0xFF, 0xFF])
    out = ffi.new("int64_t[4]", [-7, -7, -7, -7])
    assert lib.shmt_mask_popcount(packed, 2, 17) == lib.SHMT_EINVAL
    assert lib.shmt_mask_indices(packed, 2, 16, out, 4) == lib.SHMT_EINVAL  # 16 set, room for 4
    assert lib.shmt_mask_runs(packed, 2, 16, out, 3) == lib.SHMT_EINVAL
    assert lib.shmt_mask_cumsum(packed, 2, 16, out, 4) == lib.SHMT_EINVAL
    assert lib.shmt_mask_window(packed, 2, 16, 5, 4, out, 2) == lib.SHMT_EINVAL
    assert lib.shmt_mask_window(packed, 2, 16, 0, 17, out, 2) == lib.SHMT_EINVAL
    # the indices kernel stops at the end of `out` (it wrote at most 4 values, all valid indices)
    assert list(out) == [0, 1, 2, 3] or list(out) == [-7, -7, -7, -7]
    buf = ffi.new("uint8_t[8]")
    assert lib.shmt_copy(buf, 8, buf, 9) == lib.SHMT_EINVAL
    assert lib.shmt_mask_unpack(packed, 2, 16, buf, 8) == lib.SHMT_EINVAL
    assert lib.shmt_mask_pack(buf, 8, packed, 2) == lib.SHMT_EINVAL
    if _native.HAVE_XXH3:
        leaves = ffi.new("uint8_t[16]")
        assert lib.shmt_xxh3_128(buf, 8, leaves, 15) == lib.SHMT_EINVAL
        assert lib.shmt_tree_leaves(buf, 8, 0, 2, leaves, 16) == lib.SHMT_EINVAL
        assert lib.shmt_tree_leaves(buf, 8, 1, 0, leaves, 16) == lib.SHMT_EINVAL
        assert lib.shmt_xxh3_stream_update(ffi.NULL, buf, 8) == lib.SHMT_EINVAL


def test_stream_is_usable_after_a_rejected_call(k):
    s = k.Xxh3Stream()
    s.update(b"abc")
    with pytest.raises(ValueError):
        s.copy_update(bytearray(2), b"xyz")
    s.update(b"def")
    import xxhash

    assert s.digest() == xxhash.xxh3_128(b"abcdef").digest()


def test_an_interrupted_parallel_kernel_returns_only_once_no_thread_touches_the_buffers():
    """``put_many`` releases its loans when a copy is interrupted: by then no helper thread may
    still be writing into them."""
    caller = threading.get_ident()
    lock = threading.Lock()
    inside = [0]  # helper threads inside a block right now

    def make_worker():
        def do_range(first: int, last: int) -> None:
            if threading.get_ident() == caller:
                wait_until(lambda: inside[0] > 0, what="a helper thread inside a block")
                raise KeyboardInterrupt  # the caller's part is interrupted while a helper writes
            with lock:
                inside[0] += 1
            time.sleep(0.05)  # a block that takes a while to copy
            with lock:
                inside[0] -= 1
        return do_range

    with pytest.raises(KeyboardInterrupt):
        _native._over_chunks(64, 2, make_worker)
    assert inside[0] == 0


@pytest.mark.parametrize("bad_call, builtin", [
    (lambda k: k.xxh3_128("text"), TypeError),
    (lambda k: k.copy(bytearray(3), bytes(4)), ValueError),
    (lambda k: k.copy_tree_digest(bytearray(4), bytes(4), threads=0), ValueError),
    (lambda k: k.copy_tree_digest(bytearray(4), bytes(4), threads=1.5), TypeError),
    (lambda k: k.mask_popcount(bytes(1), 9), ValueError),
    (lambda k: k.xxh3_128_many(b"one buffer"), TypeError),
], ids=["str buffer", "size mismatch", "zero threads", "float threads", "short mask", "one buffer as many"])
def test_kernel_errors_are_the_packages_typed_errors_and_still_the_builtin_kind(k, bad_call, builtin):
    from shmtransport.errors import InvalidArgument, InvalidType

    with pytest.raises(InvalidType if builtin is TypeError else InvalidArgument) as info:
        bad_call(k)
    assert isinstance(info.value, builtin)
