"""Best-fit free-extent allocator over a byte range: the daemon's arena, a producer's grant, the
slots of an object table. Bookkeeping only: it never touches the bytes.

Free space is a set of disjoint extents kept in two sorted lists: by offset (to find a freed
extent's neighbours and coalesce) and by (size, offset) (best fit). Finding is a bisection,
O(log n); inserting into or deleting from a list moves its tail, O(n) in the number of free
extents, with a memmove's constant (fine for the thousands of extents an arena fragments into).
Any live allocation pins only its own bytes, so an unreleased object never blocks reuse of other
free space.

Every allocation starts on a 64-byte boundary (cache line); objects of ``page_align_min_nbytes``
or more start on a page boundary so consumers can hand them to DMA/pinning APIs.
"""
from __future__ import annotations

import bisect

from .errors import InvalidArgument, Reason, ResourceExhausted

CACHE_LINE = 64
PAGE = 4096


def _round_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


class Allocator:
    """Offsets and sizes of the live allocations in ``[0, nbytes)``; not thread-safe (the owner locks)."""

    def __init__(self, nbytes: int, page_align_min_nbytes: int = 64 * 1024):
        if nbytes <= 0 or nbytes % PAGE:
            raise InvalidArgument(f"arena nbytes must be a positive multiple of {PAGE}, got {nbytes}")
        self.nbytes = nbytes
        self.page_align_min_nbytes = page_align_min_nbytes
        self._free_by_offset: dict[int, int] = {0: nbytes}  # offset -> size
        self._free_end: dict[int, int] = {nbytes: 0}  # end -> offset
        self._by_size: list[tuple[int, int]] = [(nbytes, 0)]  # sorted (size, offset)
        self._live: dict[int, int] = {}  # offset -> reserved size
        self.used_nbytes = 0

    # -- queries ---------------------------------------------------------------------------------
    @property
    def free_nbytes(self) -> int:
        """Bytes not reserved by a live allocation (alignment padding counts as reserved)."""
        return self.nbytes - self.used_nbytes

    @property
    def largest_free_nbytes(self) -> int:
        """Size of the largest free extent: an upper bound on what one ``allocate`` can get."""
        return self._by_size[-1][0] if self._by_size else 0

    @property
    def free_extents(self) -> int:
        """Number of disjoint free extents."""
        return len(self._by_size)

    @property
    def live_allocations(self) -> int:
        """Number of allocations not yet freed."""
        return len(self._live)

    def fragmentation(self) -> float:
        """1 - largest free extent / free bytes: 0 when all free space is one extent."""
        free = self.free_nbytes
        return 0.0 if free == 0 else 1.0 - self.largest_free_nbytes / free

    # -- operations ------------------------------------------------------------------------------
    def allocate(self, nbytes: int) -> int:
        """Reserve ``nbytes`` (>= 1) and return its offset; ResourceExhausted when nothing fits."""
        if nbytes < 1:
            raise InvalidArgument(f"nbytes must be >= 1, got {nbytes}")
        align = PAGE if nbytes >= self.page_align_min_nbytes else CACHE_LINE
        size = _round_up(nbytes, CACHE_LINE)
        if size > self.nbytes:
            raise ResourceExhausted(
                f"{nbytes} bytes can never fit: the arena has {self.nbytes} (shmtransport daemon --arena-size, "
                "or a dedicated segment: loan(..., dedicated=True))", Reason.ARENA_FULL,
                field="nbytes", limit=self.nbytes,
            )
        index = bisect.bisect_left(self._by_size, (size, -1))
        while index < len(self._by_size):
            ext_size, ext_off = self._by_size[index]
            start = _round_up(ext_off, align)
            if start + size <= ext_off + ext_size:
                self._take(ext_off, ext_size, index, start, size)
                return start
            index += 1  # alignment padding did not fit: try the next larger extent
        raise ResourceExhausted(
            f"the arena is full: no free extent of {size} bytes (free {self.free_nbytes} of {self.nbytes}, largest "
            f"extent {self.largest_free_nbytes}); the bytes come back as consumers and producers release",
            Reason.ARENA_FULL,
        )

    def free(self, offset: int) -> int:
        """Return the extent at ``offset`` to the free set, coalescing with neighbours; its size."""
        size = self._live.pop(offset, None)
        if size is None:
            raise InvalidArgument(f"no live allocation at offset {offset}")
        self.used_nbytes -= size
        start, end = offset, offset + size
        prev_off = self._free_end.get(start)
        if prev_off is not None:
            self._remove_free(prev_off)
            start = prev_off
        if end in self._free_by_offset:
            end += self._remove_free(end)
        self._add_free(start, end - start)
        return size

    def split(self, offset: int, piece: int) -> None:
        """Cut the live allocation at ``offset`` into allocations of ``piece`` bytes each (its
        reserved size a multiple of ``piece``), each freed on its own from now on."""
        size = self._live.get(offset)
        if size is None or piece <= 0 or size % piece:
            raise InvalidArgument(f"cannot split the allocation at offset {offset} into pieces of {piece} bytes")
        del self._live[offset]
        for start in range(offset, offset + size, piece):
            self._live[start] = piece

    # -- internals -------------------------------------------------------------------------------
    def _take(self, ext_off: int, ext_size: int, index: int, start: int, size: int) -> None:
        del self._by_size[index]
        del self._free_by_offset[ext_off]
        del self._free_end[ext_off + ext_size]
        if start > ext_off:
            self._add_free(ext_off, start - ext_off)
        tail = ext_off + ext_size - (start + size)
        if tail:
            self._add_free(start + size, tail)
        self._live[start] = size
        self.used_nbytes += size

    def _add_free(self, offset: int, size: int) -> None:
        self._free_by_offset[offset] = size
        self._free_end[offset + size] = offset
        bisect.insort(self._by_size, (size, offset))

    def _remove_free(self, offset: int) -> int:
        size = self._free_by_offset.pop(offset)
        del self._free_end[offset + size]
        index = bisect.bisect_left(self._by_size, (size, offset))
        del self._by_size[index]
        return size
