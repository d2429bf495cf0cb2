"""``objtable.GrantSpace``: a producer's grant placed in by one native call (``shmt_grant_*``,
through the table lane: ``shmt_lane_place``, ``shmt_lane_release_own``).

Hypothesis drives random placements, releases and reclaims on a real table and checks every
choice against the reference it must equal: ``allocator.Allocator`` (the same best-fit offsets)
and a first-in-first-out queue of the grant's slots; each placed object must also be published
in its slot (generation, offset, size, owner), with a view of exactly its bytes and the wire form
of its handle.
"""
from __future__ import annotations

import collections
import mmap

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shmtransport import handle_wire, objtable
from shmtransport.allocator import PAGE, Allocator
from shmtransport.errors import InvalidArgument, ResourceExhausted, StateError
from shmtransport.objtable import GrantSpace, ObjectTable

pytestmark = pytest.mark.skipif(not objtable.available(), reason="grants are placed in by the C kernels only")

TABLE_SLOTS = 24
FIRST_SLOT, NSLOTS = 5, 12  # the grant's slots, inside the table
GRANT_OFFSET, GRANT_NBYTES = 3 * PAGE, 64 * PAGE
BIT = 3
# Around the cache line and the page-alignment threshold (64 KiB), and past the grant.
SIZES = st.one_of(st.integers(1, 300), st.integers(4000, 70_000), st.sampled_from([64, 4096, 65_536, 1 << 20]))


IDS = ("arena", "owner", "instance")  # what the lane writes into a handle's wire form


def _table() -> tuple[mmap.mmap, ObjectTable]:
    nbytes = objtable.table_nbytes(TABLE_SLOTS)
    memory = mmap.mmap(-1, 2 * nbytes)
    return memory, ObjectTable(memoryview(memory)[:nbytes], memoryview(memory)[nbytes:], TABLE_SLOTS)


def _lane(table: ObjectTable, arena: mmap.mmap):
    return table.open_lane(BIT, IDS, memoryview(arena))


class GrantMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.memory, self.table = _table()
        self.arena = mmap.mmap(-1, GRANT_OFFSET + GRANT_NBYTES)
        self.lane = _lane(self.table, self.arena)
        self.space = GrantSpace(GRANT_OFFSET, GRANT_NBYTES, FIRST_SLOT, NSLOTS)
        self.reference = Allocator(GRANT_NBYTES)
        self.free_slots = collections.deque(range(FIRST_SLOT, FIRST_SLOT + NSLOTS))
        self.live: dict[int, tuple[int, int]] = {}  # slot -> (generation, local offset), held by BIT
        self.dead: dict[int, int] = {}  # slot -> local offset: released by everyone, not yet reclaimed
        self.generations = [0] * TABLE_SLOTS

    def teardown(self) -> None:
        self.table.close()

    @rule(nbytes=SIZES)
    def place(self, nbytes: int) -> None:
        placed = self.lane.place(self.space.address, nbytes, nbytes, b"uint8", (nbytes,))
        try:
            expected = self.reference.allocate(nbytes) if self.free_slots else None
        except ResourceExhausted:
            expected = None
        if expected is None:
            assert placed is None
            return
        assert placed is not None
        offset, generation, slot, wire, view = placed
        assert view.nbytes == nbytes and view.obj is self.arena
        assert handle_wire.parse(wire) == handle_wire.WireFields(
            handle_wire.Where(IDS[0], offset, nbytes, IDS[1], generation, IDS[2], slot + 1), "uint8", (nbytes,), b"",
            b"")
        assert (offset, slot) == (GRANT_OFFSET + expected, self.free_slots.popleft())
        self.generations[slot] += 1
        assert generation == self.generations[slot]
        row = self.table.columns[slot]
        assert (int(row["generation"]), int(row["offset"]), int(row["nbytes"]), int(row["owner"])) == \
            (generation, offset, nbytes, BIT)
        assert int(self.table.holders[slot]) == 1 << BIT
        self.live[slot] = (generation, expected)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), reclaim_now=st.booleans())
    def release(self, data: st.DataObject, reclaim_now: bool) -> None:
        """Our release: the last holder's gives the bytes back in the same call; otherwise a
        consumer still holds it, and the object is reclaimed once that hold goes too."""
        slot = data.draw(st.sampled_from(sorted(self.live)))
        generation, local = self.live.pop(slot)
        if reclaim_now:
            assert self.lane.release_own(self.space.address, slot, generation, True) == (0, 0)
            self._returned(slot, local)
            return
        assert self.table.acquire(slot, generation, int(self.table.columns[slot]["offset"]),
                                  int(self.table.columns[slot]["nbytes"]), BIT + 1) is objtable.SlotStatus.NOT_COMMITTED
        self.table.commit(slot, generation, BIT, deadline_ns=0)
        assert self.table.acquire(slot, generation, int(self.table.columns[slot]["offset"]),
                                  int(self.table.columns[slot]["nbytes"]), BIT + 1) is objtable.SlotStatus.OK
        assert self.lane.release_own(self.space.address, slot, generation, True) == (0, 1 << (BIT + 1))
        assert self.table.release(slot, generation, BIT + 1) == 0
        self.dead[slot] = local

    @precondition(lambda self: self.dead)
    @rule()
    def reclaim_the_oldest_dead(self) -> None:
        slot = next(iter(self.dead))
        self.table.reclaim_in(self.space, slot)
        self._returned(slot, self.dead.pop(slot))

    def _returned(self, slot: int, local: int) -> None:
        self.reference.free(local)
        self.free_slots.append(slot)

    @rule(slot=st.integers(0, TABLE_SLOTS - 1))
    def reclaiming_an_object_still_held_or_not_the_grants_is_refused(self, slot: int) -> None:
        """Held by its producer: nothing comes back; no live object of this grant (never placed, or
        already back): refused."""
        if slot in self.dead:
            return
        if slot in self.live:
            assert self.table.reclaim_in(self.space, slot) is False
            return
        with pytest.raises(StateError):
            self.table.reclaim_in(self.space, slot)

    @precondition(lambda self: self.dead)
    @rule(data=st.data(), pinned=st.booleans())
    def a_dead_object_with_a_written_bit_or_a_pin_stays_until_both_go(self, data: st.DataObject,
                                                                      pinned: bool) -> None:
        """A bit a client wrote into a dead object's word, or the daemon's pin, keeps its bytes;
        the slot is retired all the same, and comes back once the word is 0 and the pin gone."""
        slot = data.draw(st.sampled_from(sorted(self.dead)))
        if pinned:
            self.table.pin(slot, True)
        else:
            self.table.holders[slot] |= np.uint64(1 << 40)
        assert self.table.reclaim_in(self.space, slot) is False
        assert int(self.table.columns[slot]["state"]) == objtable.FREE or not pinned
        if pinned:
            self.table.pin(slot, False)
        else:
            self.table.holders[slot] &= ~np.uint64(1 << 40)

    @invariant()
    def agrees_with_the_reference(self) -> None:
        assert self.space.largest_free_nbytes == self.reference.largest_free_nbytes
        assert self.space.used_nbytes == self.reference.used_nbytes
        assert self.space.free_slots == len(self.free_slots)
        assert self.space.empty == (not self.live and not self.dead)


GrantMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=50, deadline=None)
TestGrantSpace = GrantMachine.TestCase


def test_a_grant_that_is_not_whole_pages_or_has_no_slot_is_refused():
    with pytest.raises(InvalidArgument):
        GrantSpace(0, PAGE + 1, 0, 4)
    with pytest.raises(InvalidArgument):
        GrantSpace(0, PAGE, 0, 0)


def test_a_publish_refused_by_the_table_takes_nothing_from_the_grant():
    """A slot that is not free (only a corrupted table has one) refuses the publish: the error
    is the table's, and the grant keeps its bytes and that slot."""
    memory, table = _table()
    arena = mmap.mmap(-1, 4 * PAGE)
    try:
        space = GrantSpace(0, 4 * PAGE, FIRST_SLOT, 2)
        table.publish(FIRST_SLOT, 0, 64, BIT + 1)  # someone else's object in the grant's first slot
        with pytest.raises(StateError):
            _lane(table, arena).place(space.address, 100, 100, b"uint8", (100,))
        assert (space.free_slots, space.used_nbytes, space.largest_free_nbytes) == (2, 0, 4 * PAGE)
    finally:
        table.close()
