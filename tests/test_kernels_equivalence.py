"""The C kernels (_native) return exactly what the reference (_purepy) specifies, for every kernel."""
from __future__ import annotations

import os

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmtransport import _purepy as P

if os.environ.get("SHMTRANSPORT_BACKEND", "auto").strip().lower() == "c":
    from shmtransport import _native as N  # under SHMTRANSPORT_BACKEND=c a missing extension fails
else:
    N = pytest.importorskip("shmtransport._native", reason="could not import the C kernels: not built",
                            exc_type=ImportError)

C = P.TREE_CHUNK_NBYTES
EDGE_LENGTHS = [0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 127, 128, 129, 255, 256, 1000]
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _bytes(n: int, seed: int, offset: int = 0) -> np.ndarray:
    """n random bytes starting `offset` bytes into a fresh array (unaligned when offset is odd)."""
    base = np.random.default_rng(seed).integers(0, 256, n + offset, dtype=np.uint8)
    return base[offset:]


def _mask(nbits: int, seed: int, p: float, garbage_padding: bool = True) -> np.ndarray:
    rng = np.random.default_rng(seed)
    packed = np.packbits(rng.random(nbits) < p)
    if garbage_padding and nbits % 8:
        packed[-1] |= (1 << (8 - nbits % 8)) - 1  # padding bits set: must be ignored
    return packed


def test_the_c_backend_implements_every_kernel_the_specification_names():
    """``_native`` takes its ``__all__`` from the specification: each name must be its own
    implementation there (constants excepted), with the specification's parameters."""
    import inspect

    for name in P.__all__:
        spec, impl = getattr(P, name), getattr(N, name, None)
        assert impl is not None, f"_native lacks {name}"
        if callable(spec):
            assert impl is not spec, f"_native.{name} is the pure-Python one"
            if inspect.isfunction(spec):
                assert list(inspect.signature(impl).parameters) == list(inspect.signature(spec).parameters), name
            else:  # a class: the same public methods
                public = {m for m in dir(spec) if not m.startswith("_")}
                assert public <= set(dir(impl)), (name, public - set(dir(impl)))


def test_the_c_extension_was_built_for_this_package_version_and_a_stale_one_is_refused():
    import subprocess
    import sys

    import shmtransport

    assert N._built_for == shmtransport.__version__
    code = ("import shmtransport; shmtransport.__version__ = '0.0.0-other'\n"
            "try:\n    import shmtransport._native\nexcept ImportError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert f"built for shmtransport {N._built_for}, this is 0.0.0-other: a stale build" in out.stdout


def test_tree_chunk_size_is_the_same_in_both_backends():
    assert N.TREE_CHUNK_NBYTES == P.TREE_CHUNK_NBYTES == 1 << 20


# ---------------------------------------------------------------------------------------------
# Hashing
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", EDGE_LENGTHS + [4096, 65536 + 3])
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_xxh3_128_equals_xxhash_package_at_edge_lengths(n, offset):
    buf = _bytes(n, n, offset)
    expected = xxhash.xxh3_128(buf.tobytes()).digest()
    assert P.xxh3_128(buf) == expected
    assert N.xxh3_128(buf) == expected


@SETTINGS
@given(data=st.binary(max_size=5000))
def test_xxh3_128_equals_xxhash_package_for_random_bytes(data):
    expected = xxhash.xxh3_128(data).digest()
    assert N.xxh3_128(data) == P.xxh3_128(data) == expected
    assert N.xxh3_128(bytearray(data)) == expected
    assert N.xxh3_128(memoryview(data)) == expected


def test_xxh3_128_treats_any_dtype_as_raw_bytes():
    arr = np.arange(1000, dtype=np.float32).reshape(10, 100)
    expected = xxhash.xxh3_128(arr.tobytes()).digest()
    assert N.xxh3_128(arr) == P.xxh3_128(arr) == expected
    assert N.xxh3_128(arr[3:7]) == xxhash.xxh3_128(arr[3:7].tobytes()).digest()


@SETTINGS
@given(parts=st.lists(st.binary(max_size=700), max_size=8))
def test_xxh3_128_many_is_the_digest_of_the_concatenation(parts):
    expected = xxhash.xxh3_128(b"".join(parts)).digest()
    assert N.xxh3_128_many(parts) == P.xxh3_128_many(parts) == expected


@SETTINGS
@given(parts=st.lists(st.binary(max_size=3000), max_size=6), big=st.booleans())
def test_stream_update_and_copy_update_match_one_shot(parts, big):
    if big:
        parts = parts + [_bytes(300_000, len(parts), 1).tobytes()]  # above the non-temporal threshold
    whole = b"".join(parts)
    for mod in (N, P):
        s = mod.Xxh3Stream()
        f = mod.Xxh3Stream()
        copies = []
        for part in parts:
            s.update(part)
            dst = bytearray(len(part))
            f.copy_update(dst, part)
            copies.append(bytes(dst))
        assert s.digest() == f.digest() == xxhash.xxh3_128(whole).digest()
        assert copies == parts
        s.reset()
        assert s.digest() == xxhash.xxh3_128(b"").digest()


def test_stream_copy_update_into_unaligned_numpy_slices():
    src = _bytes(200_003, 5, 3)
    dst_base = np.zeros(200_003 + 5, np.uint8)
    dst = dst_base[5:]
    for mod in (N, P):
        dst[:] = 0
        s = mod.Xxh3Stream()
        s.copy_update(dst, src)
        assert s.digest() == xxhash.xxh3_128(src.tobytes()).digest()
        assert np.array_equal(dst, src)


@pytest.mark.parametrize("n", [0, 1, 65, C - 1, C, C + 1, 2 * C, 2 * C + 17, 3 * C - 1])
def test_tree_digest_matches_reference_around_the_chunk_boundary(n):
    buf = _bytes(n, n + 1, 1)
    expected = P.tree_digest(buf)
    assert N.tree_digest(buf) == expected
    assert N.tree_digest(buf, threads=1) == expected
    assert N.tree_digest(buf, threads=3) == expected
    if n <= C:
        assert expected == xxhash.xxh3_128(buf.tobytes()).digest()
    else:
        assert expected != xxhash.xxh3_128(buf.tobytes()).digest()


def test_tree_digest_is_the_documented_root_of_leaf_digests():
    n = 2 * C + 5
    buf = _bytes(n, 9).tobytes()
    leaves = b"".join(xxhash.xxh3_128(buf[i:i + C]).digest() for i in range(0, n, C))
    root = xxhash.xxh3_128(b"shmt-tree-v1\0" + C.to_bytes(8, "little") + n.to_bytes(8, "little") + leaves)
    assert N.tree_digest(buf) == P.tree_digest(buf) == root.digest()


@pytest.mark.parametrize("n", [0, 1, 9, 1000, 300_001, C, C + 1, 2 * C + 3])
def test_copy_tree_digest_copies_and_equals_tree_digest(n):
    src = _bytes(n, n + 2, 1)
    expected = P.tree_digest(src)
    for mod in (N, P):
        dst = np.zeros(n + 3, np.uint8)[3:]
        assert mod.copy_tree_digest(dst, src) == expected
        assert np.array_equal(dst, src)


@pytest.mark.parametrize("threads", [1, 2, 3, None])
@pytest.mark.parametrize("n", [5 * C + 7, 9 * C])
def test_threaded_copy_and_copy_tree_digest_equal_single_threaded(n, threads):
    src = _bytes(n, n + 5, 3)
    expected = P.tree_digest(src)
    for mod in (N, P):
        dst = np.zeros(n + 5, np.uint8)[5:]
        assert mod.copy_tree_digest(dst, src, threads=threads) == expected
        assert np.array_equal(dst, src)
        dst2 = np.zeros(n + 1, np.uint8)[1:]
        mod.copy(dst2, src, threads=threads)
        assert np.array_equal(dst2, src)


@pytest.mark.parametrize("n", EDGE_LENGTHS + [262_143, 262_144, 300_001])
def test_copy_copies_every_byte_into_unaligned_destinations(n):
    src = _bytes(n, n, 1)
    for mod in (N, P):
        dst = np.zeros(n + 7, np.uint8)[7:]
        mod.copy(dst, src)
        assert np.array_equal(dst, src)


def test_copy_accepts_bytearray_memoryview_and_other_dtypes():
    src = np.arange(3000, dtype=np.int64)
    dst = bytearray(src.nbytes)
    N.copy(dst, src)
    assert bytes(dst) == src.tobytes()
    dst2 = np.zeros(3000, np.int64)
    N.copy(memoryview(dst2), memoryview(dst))
    assert np.array_equal(dst2, src)


# ---------------------------------------------------------------------------------------------
# Masks
# ---------------------------------------------------------------------------------------------
def _assert_same_mask_results(packed, nbits):
    assert np.array_equal(N.mask_unpack(packed, nbits), P.mask_unpack(packed, nbits))
    assert N.mask_unpack(packed, nbits).dtype == np.bool_
    assert N.mask_popcount(packed, nbits) == P.mask_popcount(packed, nbits)
    ni, pi = N.mask_indices(packed, nbits), P.mask_indices(packed, nbits)
    assert ni.dtype == pi.dtype == np.int64 and np.array_equal(ni, pi)
    nr, pr = N.mask_runs(packed, nbits), P.mask_runs(packed, nbits)
    assert nr.dtype == pr.dtype == np.int64 and nr.shape == pr.shape and np.array_equal(nr, pr)
    nc, pc = N.mask_cumsum(packed, nbits), P.mask_cumsum(packed, nbits)
    assert nc.dtype == pc.dtype == np.int64 and np.array_equal(nc, pc)


@pytest.mark.parametrize("nbits", [0, 1, 7, 8, 9, 63, 64, 65, 127, 128, 129, 1000])
@pytest.mark.parametrize("p", [0.0, 0.3, 0.5, 1.0])
def test_mask_kernels_match_reference_at_edge_lengths(nbits, p):
    packed = _mask(nbits, nbits * 7 + int(p * 10), p)
    _assert_same_mask_results(packed, nbits)


@SETTINGS
@given(bits=st.lists(st.booleans(), max_size=600), offset=st.integers(0, 7), extra=st.integers(0, 3))
def test_mask_kernels_match_reference_on_unaligned_buffers(bits, offset, extra):
    nbits = len(bits)
    packed = np.packbits(np.array(bits, dtype=bool))
    buf = np.full(offset + packed.size + extra, 0xFF, np.uint8)  # trailing bytes must be ignored
    buf[offset:offset + packed.size] = packed
    view = buf[offset:]
    if nbits % 8:
        view[packed.size - 1] |= (1 << (8 - nbits % 8)) - 1
    _assert_same_mask_results(view, nbits)
    assert np.array_equal(N.mask_unpack(view, nbits), np.array(bits, dtype=bool))


@SETTINGS
@given(nbits=st.integers(0, 300), seed=st.integers(0, 2**32 - 1), runs=st.booleans())
def test_mask_runs_and_indices_match_reference_for_run_shaped_masks(nbits, seed, runs):
    rng = np.random.default_rng(seed)
    if runs:
        bits = np.repeat(rng.random(nbits) < 0.5, rng.integers(1, 90, nbits))[:nbits]
    else:
        bits = rng.random(nbits) < rng.random()
    packed = np.packbits(bits)
    _assert_same_mask_results(packed, nbits)


@SETTINGS
@given(bits=st.lists(st.booleans(), max_size=300), offset=st.integers(0, 3))
def test_mask_pack_matches_numpy_packbits(bits, offset):
    arr = np.zeros(len(bits) + offset, dtype=bool)
    arr[offset:] = bits
    view = arr[offset:]
    expected = np.packbits(np.array(bits, dtype=bool))
    for mod in (N, P):
        out = mod.mask_pack(view)
        assert out.dtype == np.uint8 and np.array_equal(out, expected)
        assert np.array_equal(mod.mask_pack(list(bits)), expected)


def test_mask_pack_treats_nonzero_numbers_as_set():
    values = np.array([0, 2, 0, 255, 1, 0, 0, 7, 3], dtype=np.uint8)
    expected = np.packbits(values != 0)
    assert np.array_equal(N.mask_pack(values), expected)
    assert np.array_equal(P.mask_pack(values), expected)


@pytest.mark.parametrize("nbits", [0, 1, 7, 8, 9, 63, 64, 65, 130])
def test_mask_window_matches_reference_at_every_edge(nbits):
    packed = _mask(nbits, nbits + 3, 0.5)
    for start in range(nbits + 1):
        for end in range(start, nbits + 1):
            assert N.mask_window(packed, nbits, start, end) == P.mask_window(packed, nbits, start, end)


@SETTINGS
@given(nbits=st.integers(0, 5000), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_mask_window_matches_reference_for_random_windows(nbits, seed, data):
    packed = _mask(nbits, seed, 0.4)
    start = data.draw(st.integers(0, nbits))
    end = data.draw(st.integers(start, nbits))
    result = N.mask_window(packed, nbits, start, end)
    assert result == P.mask_window(packed, nbits, start, end)
    bits = np.unpackbits(packed, count=nbits)
    assert result == (int(bits[:start].sum()), int(bits[:end].sum()))


def test_mask_kernels_match_reference_on_a_large_mask():
    nbits = 200_003
    rng = np.random.default_rng(11)
    bits = np.repeat(rng.random(nbits) < 0.3, rng.integers(1, 200, nbits))[:nbits]
    packed = np.packbits(bits)
    _assert_same_mask_results(packed, nbits)
    assert N.mask_popcount(packed, nbits) == int(bits.sum())


def test_kernels_accept_mmap_buffers():
    import mmap

    n = 300_001
    src = _bytes(n, 21)
    with mmap.mmap(-1, n) as m_src, mmap.mmap(-1, n) as m_dst:
        m_src[:] = src.tobytes()
        expected = P.tree_digest(src)
        assert N.tree_digest(m_src) == P.tree_digest(m_src) == expected
        assert N.copy_tree_digest(m_dst, m_src) == expected
        assert m_dst[:] == m_src[:]
        packed = np.packbits(src[:1000] > 100)
        m_dst[:packed.size] = packed.tobytes()
        assert np.array_equal(N.mask_indices(m_dst, 1000), P.mask_indices(packed, 1000))
