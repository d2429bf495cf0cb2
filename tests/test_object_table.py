"""The object table's slot state machine: the C kernels and the single-writer Python kernels
(a daemon's table without the C kernels) against one model of docs/objects.md.

Hypothesis drives random sequences of publish, commit, acquire, release, expire, session
clearing, the daemon's pins, retiring a dead slot (its bytes about to be reused) and a client's
bits written into any word (a hostile consumer's OR) on a real table in shared memory and checks every status and
every holders word against the model, for each kernel set this process has.
"""
from __future__ import annotations

import mmap
import os

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shmtransport import objtable
from shmtransport.errors import HandleError, InvalidArgument, StateError
from shmtransport.objtable import HANDOFF, PROXY_BIT, ObjectTable, SlotStatus

needs_c = pytest.mark.skipif(not objtable.available(), reason="a shared object table needs the C kernels")
NSLOTS = 4
BITS = st.sampled_from([0, 1, 2, 61, PROXY_BIT])
OWNERS = BITS  # sessions own their loans, the proxy bit those the daemon places
SLOT = st.integers(0, NSLOTS - 1)


def _table(nslots: int = NSLOTS, single_writer: bool = False) -> tuple[mmap.mmap, ObjectTable]:
    """One anonymous mapping holding the slots, then the holds."""
    nbytes = objtable.table_nbytes(nslots)
    memory = mmap.mmap(-1, 2 * nbytes)
    return memory, ObjectTable(memoryview(memory)[:nbytes], memoryview(memory)[nbytes:], nslots, single_writer)


class Slot:
    def __init__(self) -> None:
        self.generation = 0
        self.holders: set[int] = set()
        self.handoff = False
        self.state = 0
        self.offset = self.nbytes = 0
        self.deadline = 0
        self.pinned = False

    @property
    def word(self) -> int:
        return sum(1 << b for b in self.holders) | (HANDOFF if self.handoff else 0)


class SlotMachine(RuleBasedStateMachine):
    single_writer = False

    def __init__(self) -> None:
        super().__init__()
        self.memory, self.table = _table(single_writer=self.single_writer)
        self.model = [Slot() for _ in range(NSLOTS)]
        self.now = 1_000

    def teardown(self) -> None:
        self.table.close()
        self.memory.close()

    @rule(slot=SLOT, bit=OWNERS, nbytes=st.integers(1, 1 << 20))
    def publish(self, slot, bit, nbytes):
        m = self.model[slot]
        if m.word:
            with pytest.raises(StateError):
                self.table.publish(slot, 4096 * slot, nbytes, bit)
            return
        assert self.table.publish(slot, 4096 * slot, nbytes, bit) == m.generation + 1
        m.generation += 1
        m.holders, m.handoff, m.state = {bit}, False, objtable.LOANED
        m.offset, m.nbytes = 4096 * slot, nbytes

    @rule(slot=SLOT, bit=OWNERS, window=st.integers(0, 100), hold=st.booleans(), stale=st.booleans())
    def commit(self, slot, bit, window, hold, stale):
        m = self.model[slot]
        generation = max(m.generation - 1, 0) if stale else m.generation
        ok_holder = bit in m.holders and generation == m.generation
        if not ok_holder or m.state != objtable.LOANED:
            with pytest.raises(StateError):
                self.table.commit(slot, generation, bit, self.now + window, hold)
            return
        self.table.commit(slot, generation, bit, self.now + window, hold)
        m.state = objtable.HELD if hold else objtable.COMMITTED
        m.handoff, m.deadline = True, self.now + window

    @rule(slot=SLOT, bit=BITS, stale=st.booleans(), wrong_size=st.booleans())
    def acquire(self, slot, bit, stale, wrong_size):
        m = self.model[slot]
        generation = max(m.generation - 1, 0) if stale else m.generation
        nbytes = m.nbytes + 1 if wrong_size else m.nbytes
        status = self.table.acquire(slot, generation, m.offset, nbytes, bit)
        if generation == 0 or generation > m.generation:
            expected = SlotStatus.UNKNOWN
        elif generation != m.generation or not m.word:
            expected = SlotStatus.STALE
        elif m.state == objtable.LOANED:
            expected = SlotStatus.NOT_COMMITTED
        elif m.state == objtable.FREE:  # retired: whatever bits were written into its word since
            expected = SlotStatus.STALE
        elif wrong_size:
            expected = SlotStatus.MISMATCH
        elif bit in m.holders:  # the very object named, held already: checked like a new hold, nothing taken
            expected = SlotStatus.ALREADY
        else:
            expected = SlotStatus.OK
            m.holders.add(bit)
            if m.state == objtable.COMMITTED:
                m.handoff = False
        assert status is expected

    @rule(slot=SLOT, bit=BITS, cancel=st.booleans())
    def release(self, slot, bit, cancel):
        m = self.model[slot]
        if bit not in m.holders:
            with pytest.raises(StateError):
                self.table.release(slot, m.generation, bit, cancel)
            return
        m.holders.discard(bit)
        if cancel:
            m.handoff = False
        assert self.table.release(slot, m.generation, bit, cancel) == m.word

    @rule(slot=SLOT, advance=st.integers(0, 60))
    def expire(self, slot, advance):
        self.now += advance
        m = self.model[slot]
        result = self.table.expire(slot, self.now)
        if not m.handoff:
            assert result is None
        elif m.deadline > self.now:
            assert result is None
        else:
            m.handoff = False
            assert result is (not m.holders)

    @rule(bit=BITS)
    def session_ends(self, bit):
        held = sum(bit in m.holders for m in self.model)
        died = [m for m in self.model if m.holders == {bit} and not m.handoff]
        for m in self.model:
            m.holders.discard(bit)
        assert self.table.clear_bit(bit) == (held, len(died), sum(m.nbytes for m in died))

    @rule(slot=SLOT)
    def retire(self, slot):
        """The slot's owner takes a dead object's bytes back: only when nobody holds it and the
        daemon does not pin it (the slot is FREE from then on either way)."""
        m = self.model[slot]
        assert self.table.retire(slot) is (m.word == 0 and not m.pinned)
        if m.word == 0:
            m.state = objtable.FREE

    @rule(slot=SLOT, pinned=st.booleans())
    def the_daemon_pins(self, slot, pinned):
        self.table.pin(slot, pinned)
        self.model[slot].pinned = pinned

    @rule(slot=SLOT, bit=BITS)
    def a_client_writes_a_bit(self, slot, bit):
        """A hostile consumer ORs a bit into a word, dead or alive (it may write the holds)."""
        self.table.holders[slot] |= 1 << bit
        self.model[slot].holders.add(bit)

    @precondition(lambda self: any(m.state == objtable.FREE and m.generation for m in self.model))
    @rule(data=st.data(), forged=BITS)
    def a_retired_slot_is_never_acquired_again(self, data, forged):
        """Resurrected by a written bit or not, a retired generation is refused (its bytes may be
        another object's), and the acquire leaves the word as it was."""
        slot = data.draw(st.sampled_from([i for i, m in enumerate(self.model)
                                          if m.state == objtable.FREE and m.generation]))
        m = self.model[slot]
        self.a_client_writes_a_bit(slot, forged)
        assert self.table.acquire(slot, m.generation, m.offset, m.nbytes, 5) is SlotStatus.STALE
        assert int(self.table.holders[slot]) == m.word

    @precondition(lambda self: any(m.word == 0 and m.generation for m in self.model))
    @rule(data=st.data())
    def a_dead_generation_stays_dead(self, data):
        slot = data.draw(st.sampled_from([i for i, m in enumerate(self.model) if m.word == 0 and m.generation]))
        m = self.model[slot]
        assert self.table.acquire(slot, m.generation, m.offset, m.nbytes, 5) is SlotStatus.STALE
        assert self.table.acquire(slot, m.generation + 1, m.offset, m.nbytes, 5) is SlotStatus.UNKNOWN

    @invariant()
    def words_match_the_model(self):
        for index, m in enumerate(self.model):
            assert int(self.table.holders[index]) == m.word, index
            assert int(self.table.columns["generation"][index]) == m.generation
            assert int(self.table.columns["state"][index]) == m.state
            assert int(self.table.columns["daemon_pin"][index]) == m.pinned


class SingleWriterSlotMachine(SlotMachine):
    single_writer = True


SlotMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
SingleWriterSlotMachine.TestCase.settings = SlotMachine.TestCase.settings
test_slot_state_machine_c = needs_c(SlotMachine.TestCase)
test_slot_state_machine_single_writer = SingleWriterSlotMachine.TestCase


@pytest.mark.parametrize("single_writer", [pytest.param(False, marks=needs_c), True], ids=["c", "single-writer"])
def test_every_kernel_refuses_a_slot_outside_the_table(single_writer):
    memory, table = _table(single_writer=single_writer)
    try:
        with pytest.raises(InvalidArgument):
            table.publish(NSLOTS, 0, 1, 0)
        with pytest.raises(InvalidArgument):
            table.acquire(NSLOTS, 1, 0, 1, 0)
        with pytest.raises(InvalidArgument):
            table.release(NSLOTS, 1, 0)
        with pytest.raises(InvalidArgument):
            table.expire(NSLOTS, 0)
        with pytest.raises(InvalidArgument):
            table.clear_bit(0, 0, NSLOTS + 1)
        with pytest.raises(InvalidArgument):
            table.publish(0, 0, 1, PROXY_BIT + 1)  # the hand-off bit never owns an object
        with pytest.raises(InvalidArgument):
            table.acquire(0, 1, 0, 1, PROXY_BIT + 1)
    finally:
        table.close()
        memory.close()


@needs_c
def test_a_stale_acquire_never_keeps_a_bit_on_the_reused_slot():
    """ABA: the handle's generation was freed and the slot reused; the acquire is refused and
    leaves the new object's holders exactly as they were."""
    memory, table = _table()
    try:
        old = table.publish(0, 0, 64, 0)
        table.commit(0, old, 0, 0)
        assert table.release(0, old, 0, cancel_handoff=True) == 0
        new = table.publish(0, 128, 64, 1)
        table.commit(0, new, 1, 10**18)
        before = int(table.holders[0])
        assert table.acquire(0, old, 0, 64, 2) is SlotStatus.STALE
        assert int(table.holders[0]) == before
        with pytest.raises(HandleError):
            objtable.raise_for(SlotStatus.STALE, 0)
    finally:
        table.close()
        memory.close()


@needs_c
def test_the_table_layout_is_the_c_headers():
    """``SLOT_DTYPE`` and ``HOLD_DTYPE`` are declared in Python for numpy and in the header for the
    kernels: every field at the same offset, every record the same size."""
    from shmtransport._native import ffi

    for ctype, dtype in (("shmt_slot", objtable.SLOT_DTYPE), ("shmt_hold", objtable.HOLD_DTYPE)):
        assert ffi.sizeof(ctype) == dtype.itemsize == objtable.SLOT_NBYTES
        for name in dtype.names:
            assert ffi.offsetof(ctype, name) == dtype.fields[name][1], (ctype, name)
    assert list(objtable.SLOT_DTYPE.names) == [
        "generation", "offset", "nbytes", "state", "deadline_ns", "owner", "recall", "daemon_pin"]


@needs_c
def test_a_consumer_acquires_and_releases_through_read_only_slots_and_cannot_change_them():
    """A consumer maps the slots PROT_READ (a write there would kill it, not corrupt anyone):
    acquire and release touch only the holds; every kernel that writes a slot is refused."""
    nbytes = objtable.table_nbytes(NSLOTS)
    slots_fd = os.memfd_create("slots", os.MFD_CLOEXEC)
    os.ftruncate(slots_fd, nbytes)
    slots_rw = mmap.mmap(slots_fd, nbytes)
    slots_ro = mmap.mmap(slots_fd, nbytes, prot=mmap.PROT_READ)
    holds = mmap.mmap(-1, nbytes)
    producer = ObjectTable(memoryview(slots_rw), memoryview(holds), NSLOTS)
    consumer = ObjectTable(memoryview(slots_ro), memoryview(holds), NSLOTS)
    try:
        assert producer.writable and not consumer.writable
        generation = producer.publish(1, 4096, 64, 0)
        producer.commit(1, generation, 0, 10**18)
        assert consumer.acquire(1, generation, 4096, 64, 1) is SlotStatus.OK
        assert int(consumer.holders[1]) == 0b11 and int(consumer.columns["generation"][1]) == generation
        assert consumer.release(1, generation, 1) == 0b1
        for attempt in (lambda: consumer.publish(2, 0, 64, 1), lambda: consumer.commit(1, generation, 1, 0),
                        lambda: consumer.pin(1, True), lambda: consumer.retire(2)):
            with pytest.raises(StateError, match="read-only"):
                attempt()
        with pytest.raises(ValueError):
            consumer.columns["generation"][1] = 0  # numpy sees the read-only mapping too
    finally:
        producer.close()
        consumer.close()
        for mapping in (slots_rw, slots_ro, holds):
            mapping.close()
        os.close(slots_fd)
