"""``arena.protect`` from 2 MiB on: the range's page tables move to a stash (mremap) instead of
each entry being rewritten, so protecting costs the same at any size. The range is read-only and
reads the same bytes meanwhile; ``unprotect`` moves the tables back (writable, pages present);
closing the segment unmaps the stashes (they would keep the segment's pages alive)."""
from __future__ import annotations

import mmap
import os

import pytest

from shmtransport import arena

NBYTES = 8 << 20
PATTERN = bytes(range(256)) * (NBYTES // 256)


def _maps() -> dict[int, tuple[int, str]]:
    """This process's mappings: start -> (end, permissions)."""
    found = {}
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            start, end = (int(x, 16) for x in span.split("-"))
            found[start] = (end, perms)
    return found


def _perms_at(address: int) -> str | None:
    for start, (end, perms) in _maps().items():
        if start <= address < end:
            return perms
    return None


@pytest.fixture
def segment():
    fd = os.memfd_create("protect-stash-test")
    try:
        os.ftruncate(fd, NBYTES)
        mapped = arena._SharedMap(fd, NBYTES, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    finally:
        os.close(fd)
    mapped[:] = PATTERN
    yield mapped
    mapped.close()


def _protect_stashed(segment: arena._SharedMap, start: int, nbytes: int) -> tuple[memoryview, int, int]:
    """Protect ``[start, start + nbytes)``; the view, the protected range's first address, its stash."""
    with memoryview(segment) as whole:
        inside = whole[start: start + nbytes]
    assert arena.protect(inside)
    if not segment._stashes:
        pytest.skip("this kernel cannot move page tables of a shared mapping (MREMAP_DONTUNMAP, Linux 5.13)")
    ((lo, (stash, _)),) = segment._stashes.items()
    return inside, lo, stash


def test_a_stashed_range_is_read_only_reads_the_same_bytes_and_comes_back_writable(segment):
    start, nbytes = 100, 4 << 20  # partial pages at both ends stay writable
    inside, lo, stash = _protect_stashed(segment, start, nbytes)
    assert _perms_at(lo) == "r--s"
    assert _perms_at(stash) is not None
    assert bytes(inside) == PATTERN[start: start + nbytes]  # faulted back in, read-only
    segment[0] = 1  # the partial page before the range
    with memoryview(segment) as whole:
        arena.unprotect(whole[2 << 20: (2 << 20) + 1])  # meets it: all of it lifted
    assert not segment._stashes and not segment._protected_starts
    assert _perms_at(lo) == "rw-s" and _perms_at(stash) is None
    assert bytes(inside) == PATTERN[start: start + nbytes]
    inside[:] = b"\x07" * nbytes
    del inside
    assert segment[start: start + nbytes] == b"\x07" * nbytes
    assert segment[start + nbytes:] == PATTERN[start + nbytes:]


def test_closing_the_segment_unmaps_its_stashes(segment):
    inside, _, stash = _protect_stashed(segment, 0, 2 << 20)
    del inside
    segment.close()
    assert _perms_at(stash) is None


def test_a_range_below_2_mib_is_protected_in_place(segment):
    with memoryview(segment) as whole:
        inside = whole[: (2 << 20) - mmap.PAGESIZE]
    assert arena.protect(inside)
    assert not segment._stashes
    assert _perms_at(arena._address(inside)) == "r--s"
    arena.unprotect(inside)
    del inside
