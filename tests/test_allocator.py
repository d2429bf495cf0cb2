"""Unit tests of the daemon's best-fit free-extent allocator (bookkeeping only, no shared memory)."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from shmtransport.allocator import CACHE_LINE, PAGE, Allocator
from shmtransport.errors import InvalidArgument, Reason, ResourceExhausted

KiB = 1024
MiB = 1 << 20


def reserved(nbytes: int) -> int:
    """What the allocator reserves for a request: whole cache lines."""
    return -(-nbytes // CACHE_LINE) * CACHE_LINE


def check_invariants(a: Allocator, live: dict[int, int]) -> None:
    """Live allocations never overlap, free extents are disjoint, maximal and account for the rest.

    ``live`` is the test's own record: offset -> requested nbytes.
    """
    total_live = 0
    intervals = []
    for offset, nbytes in live.items():
        align = PAGE if nbytes >= a.page_align_min_nbytes else CACHE_LINE
        if offset % align:
            raise AssertionError(f"allocation of {nbytes} at {offset} is not {align}-aligned")
        size = reserved(nbytes)
        total_live += size
        intervals.append((offset, offset + size, "live"))
    free = sorted(a._free_by_offset.items())
    for offset, size in free:
        if size <= 0:
            raise AssertionError(f"empty free extent at {offset}")
        intervals.append((offset, offset + size, "free"))
    intervals.sort()
    for (s0, e0, k0), (s1, e1, k1) in zip(intervals, intervals[1:]):
        if e0 > s1:
            raise AssertionError(f"{k0} [{s0},{e0}) overlaps {k1} [{s1},{e1})")
    for (o0, s0), (o1, _) in zip(free, free[1:]):
        if o0 + s0 == o1:
            raise AssertionError(f"adjacent free extents at {o0} and {o1} were not coalesced")
    if intervals and (intervals[0][0] < 0 or intervals[-1][1] > a.nbytes):
        raise AssertionError("an extent lies outside the arena")
    free_total = sum(size for _, size in free)
    assert a.used_nbytes == total_live
    assert a.used_nbytes + a.free_nbytes == a.nbytes
    assert free_total == a.free_nbytes
    assert a.live_allocations == len(live)
    assert a.free_extents == len(free)
    assert sorted(a._by_size) == sorted((size, off) for off, size in free)
    assert a.largest_free_nbytes == max((size for _, size in free), default=0)


# -- alignment -----------------------------------------------------------------------------------
def test_small_allocations_start_on_a_cache_line_and_reserve_whole_lines():
    a = Allocator(64 * KiB)
    offsets = [a.allocate(n) for n in (1, 63, 64, 65, 100, 3)]
    assert all(off % CACHE_LINE == 0 for off in offsets)
    assert offsets == [0, 64, 128, 192, 320, 448]
    assert a.used_nbytes == sum(reserved(n) for n in (1, 63, 64, 65, 100, 3))


def test_allocations_at_or_above_page_align_min_start_on_a_page_boundary():
    a = Allocator(1 * MiB, page_align_min_nbytes=16 * KiB)
    small = a.allocate(100)  # [0, 128)
    big = a.allocate(16 * KiB)  # exactly the threshold
    assert small == 0
    assert big % PAGE == 0 and big == PAGE
    below = a.allocate(16 * KiB - 1)  # just below the threshold: cache-line alignment only
    assert below % CACHE_LINE == 0
    # The padding skipped to reach the page boundary stays usable.
    pad = a.allocate(PAGE - 128)
    assert pad == 128
    check_invariants(a, {small: 100, big: 16 * KiB, below: 16 * KiB - 1, pad: PAGE - 128})


def test_page_aligned_request_skips_an_extent_whose_padding_does_not_fit():
    a = Allocator(256 * KiB, page_align_min_nbytes=8 * KiB)
    head = a.allocate(64)  # [0, 64)
    x = a.allocate(7 * KiB)  # below the threshold: [64, 7232)
    y = a.allocate(2 * KiB)  # [7232, 9280)
    guard = a.allocate(64)  # [9280, 9344)
    a.free(x)
    a.free(y)  # one free extent [64, 9280): 9216 bytes, but from 4096 only 5184 remain
    assert a._free_by_offset[64] == 9216
    off = a.allocate(8 * KiB)
    assert off % PAGE == 0 and off >= guard + 64
    assert a._free_by_offset[64] == 9216  # the unsuitable extent was left whole
    check_invariants(a, {head: 64, guard: 64, off: 8 * KiB})


# -- exact fit, full, recovery -------------------------------------------------------------------
def test_exact_fit_takes_the_whole_arena_and_leaves_no_free_extent():
    a = Allocator(64 * KiB)
    off = a.allocate(64 * KiB)
    assert off == 0
    assert a.free_nbytes == 0 and a.free_extents == 0 and a.largest_free_nbytes == 0
    check_invariants(a, {off: 64 * KiB})
    assert a.free(off) == 64 * KiB
    assert a.free_extents == 1 and a.largest_free_nbytes == 64 * KiB


def test_full_arena_raises_arena_full_and_recovers_after_free():
    a = Allocator(8 * KiB)
    offsets = [a.allocate(1 * KiB) for _ in range(8)]
    with pytest.raises(ResourceExhausted) as info:
        a.allocate(1)
    assert info.value.reason is Reason.ARENA_FULL
    a.free(offsets[3])
    assert a.allocate(1 * KiB) == offsets[3]
    with pytest.raises(ResourceExhausted) as info:
        a.allocate(1)
    assert info.value.reason is Reason.ARENA_FULL


def test_request_larger_than_the_arena_raises_arena_full():
    a = Allocator(8 * KiB)
    with pytest.raises(ResourceExhausted) as info:
        a.allocate(8 * KiB + 1)
    assert (info.value.reason, info.value.field, info.value.limit) == (Reason.ARENA_FULL, "nbytes", 8 * KiB)
    assert a.used_nbytes == 0


def test_fragmented_free_space_too_small_for_a_request_raises_arena_full():
    a = Allocator(8 * KiB)
    offsets = [a.allocate(1 * KiB) for _ in range(8)]
    for off in offsets[::2]:
        a.free(off)
    assert a.free_nbytes == 4 * KiB and a.largest_free_nbytes == 1 * KiB
    with pytest.raises(ResourceExhausted) as info:
        a.allocate(2 * KiB)
    assert info.value.reason is Reason.ARENA_FULL
    assert a.fragmentation() == pytest.approx(0.75)


def test_invalid_sizes_and_frees_are_refused():
    with pytest.raises(InvalidArgument):
        Allocator(1000)  # not whole pages
    with pytest.raises(InvalidArgument):
        Allocator(0)
    a = Allocator(8 * KiB)
    with pytest.raises(InvalidArgument):
        a.allocate(0)
    with pytest.raises(InvalidArgument):
        a.free(64)  # nothing there
    off = a.allocate(64)
    a.free(off)
    with pytest.raises(InvalidArgument):
        a.free(off)  # double free
    assert a.used_nbytes == 0


# -- coalescing, best fit, no head-of-line blocking ----------------------------------------------
def test_free_coalesces_with_both_neighbours():
    a = Allocator(64 * KiB)
    x, y, z, guard = (a.allocate(1 * KiB) for _ in range(4))
    a.free(x)
    a.free(z)
    assert a.free_extents == 3  # [x], [z], tail after guard
    a.free(y)  # joins x (left) and z (right)
    assert a.free_extents == 2
    assert a._free_by_offset[x] == 3 * KiB
    check_invariants(a, {guard: 1 * KiB})
    a.free(guard)
    assert a.free_extents == 1 and a.largest_free_nbytes == 64 * KiB


def test_free_coalesces_with_the_left_neighbour_only_and_right_neighbour_only():
    a = Allocator(64 * KiB)
    x, y, z, guard = (a.allocate(1 * KiB) for _ in range(4))
    a.free(x)
    a.free(y)  # left neighbour free, right (z) live
    assert a._free_by_offset[x] == 2 * KiB
    a.free(guard)  # right neighbour is the tail, left (z) live
    assert a._free_by_offset[guard] == 64 * KiB - 3 * KiB
    check_invariants(a, {z: 1 * KiB})


def test_best_fit_picks_the_smallest_extent_that_fits():
    a = Allocator(64 * KiB)
    big_hole = a.allocate(2 * KiB)
    a.allocate(64)
    small_hole = a.allocate(512)
    a.allocate(64)
    mid_hole = a.allocate(1 * KiB)
    a.allocate(64)
    for off in (big_hole, small_hole, mid_hole):
        a.free(off)
    assert a.allocate(500) == small_hole  # 512 fits: smallest
    assert a.allocate(700) == mid_hole  # 1 KiB is the smallest that fits now
    assert a.allocate(1500) == big_hole
    # Among equal sizes, the lowest offset wins (deterministic).
    b = Allocator(64 * KiB)
    h1 = b.allocate(256)
    b.allocate(64)
    h2 = b.allocate(256)
    b.allocate(64)
    b.free(h2)
    b.free(h1)
    assert b.allocate(256) == h1


def test_unreleased_allocation_in_the_middle_does_not_block_allocations_elsewhere():
    a = Allocator(1 * MiB, page_align_min_nbytes=1 * MiB)
    quarter = 256 * KiB
    blocks = [a.allocate(quarter) for _ in range(4)]
    stuck = blocks[1]  # a "slow reader" never releases this one
    for off in blocks[:1] + blocks[2:]:
        a.free(off)
    # Everything except the stuck quarter is usable at once, on both sides of it.
    assert a.free_nbytes == 3 * quarter
    assert a.largest_free_nbytes == 2 * quarter
    right = a.allocate(2 * quarter)
    left = a.allocate(quarter)
    assert left == 0 and right == 2 * quarter
    assert a.free_nbytes == 0
    check_invariants(a, {stuck: quarter, left: quarter, right: 2 * quarter})


# -- randomized ----------------------------------------------------------------------------------
def test_ten_thousand_random_allocate_free_cycles_keep_every_invariant():
    rng = random.Random(20261130)
    a = Allocator(4 * MiB, page_align_min_nbytes=64 * KiB)
    live: dict[int, int] = {}
    sizes = [1, 7, 64, 65, 100, 1000, 4096, 5000, 64 * KiB - 1, 64 * KiB, 100_000, 300_000]
    failures = 0
    for step in range(10_000):
        if live and (rng.random() < 0.45 or a.free_nbytes < 64 * KiB):
            off = rng.choice(list(live))
            assert a.free(off) == reserved(live.pop(off))
        else:
            nbytes = rng.choice(sizes) if rng.random() < 0.7 else rng.randint(1, 200_000)
            try:
                off = a.allocate(nbytes)
            except ResourceExhausted as exc:
                assert exc.reason is Reason.ARENA_FULL
                failures += 1
            else:
                assert off not in live
                live[off] = nbytes
        if step % 10 == 0:
            check_invariants(a, live)
        else:
            assert a.used_nbytes + a.free_nbytes == a.nbytes
    check_invariants(a, live)
    for off in list(live):
        a.free(off)
    assert a.used_nbytes == 0 and a.free_extents == 1 and a.largest_free_nbytes == a.nbytes
    assert failures < 5_000  # the workload really allocated


_sizes = st.one_of(st.integers(1, 256), st.integers(257, 70_000), st.sampled_from([64, 4096, 65_536]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(_sizes, min_size=1, max_size=40), data=st.data())
def test_freeing_everything_in_any_order_restores_one_extent(sizes, data):
    a = Allocator(1 * MiB, page_align_min_nbytes=16 * KiB)
    live = {}
    for nbytes in sizes:
        try:
            live[a.allocate(nbytes)] = nbytes
        except ResourceExhausted:
            pass
    check_invariants(a, live)
    order = data.draw(st.permutations(sorted(live)))
    for off in order:
        a.free(off)
        live.pop(off)
        check_invariants(a, live)
    assert a.free_extents == 1 and a.largest_free_nbytes == a.nbytes


class AllocatorMachine(RuleBasedStateMachine):
    """Any interleaving of allocate/free keeps the allocator's books exact."""

    @initialize(page_align_min=st.sampled_from([4096, 16 * KiB, 1 << 30]))
    def setup(self, page_align_min):
        self.a = Allocator(256 * KiB, page_align_min_nbytes=page_align_min)
        self.live: dict[int, int] = {}

    @rule(nbytes=_sizes)
    def allocate(self, nbytes):
        fits_somewhere = self.a.largest_free_nbytes >= reserved(nbytes) + PAGE
        try:
            off = self.a.allocate(nbytes)
        except ResourceExhausted as exc:
            assert exc.reason is Reason.ARENA_FULL
            # A refusal is only allowed when no extent could hold it even with page padding.
            assert not fits_somewhere
        else:
            assert off not in self.live
            self.live[off] = nbytes

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        off = data.draw(st.sampled_from(sorted(self.live)))
        assert self.a.free(off) == reserved(self.live.pop(off))

    @invariant()
    def books_balance(self):
        if hasattr(self, "a"):
            check_invariants(self.a, self.live)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(
    max_examples=40, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_a_split_allocation_is_freed_piece_by_piece_and_coalesces_back():
    """The daemon splits an orphaned grant's slot range so each dead slot goes back on its own."""
    alloc = Allocator(PAGE, page_align_min_nbytes=1 << 62)
    whole = alloc.allocate(8 * CACHE_LINE)
    alloc.split(whole, CACHE_LINE)
    assert alloc.live_allocations == 8 and alloc.used_nbytes == 8 * CACHE_LINE
    for piece in (1, 3, 5, 7):
        alloc.free(whole + piece * CACHE_LINE)
    assert alloc.allocate(CACHE_LINE) == whole + CACHE_LINE  # a freed piece is reused alone
    for piece in (0, 1, 2, 4, 6):
        alloc.free(whole + piece * CACHE_LINE)
    assert alloc.free_extents == 1 and alloc.free_nbytes == PAGE
    with pytest.raises(InvalidArgument):
        alloc.split(whole, CACHE_LINE)  # nothing live there any more
    other = alloc.allocate(3 * CACHE_LINE)
    with pytest.raises(InvalidArgument):
        alloc.split(other, 2 * CACHE_LINE)  # not a whole number of pieces
