"""The object table: the lifetime of every object in shared memory, in two segments.

The **slots** (64 bytes each) say what an object is: generation, offset, size, state, hand-off
deadline, owner, the daemon's recall of a grant and its pin. Producers and the daemon write them;
consumers map them read-only, so a consumer cannot change what anyone reads. The **holds** give
each slot one ``holders`` word on a cache line of its own, the word every party changes, only with
atomic read-modify-writes (the C kernels, ``shmt_slot_*`` in ``csrc/shmt_kernels.h``): a loan is
a publish into a free slot, commit sets the hand-off bit, acquire ORs in the caller's session bit,
release clears it. No syscall, no daemon. ``docs/objects.md`` states the invariants and what a death
between any two steps leaves behind.

Every object lives here, whoever placed it. Pure Python has no atomic read-modify-write on shared
memory, so only processes with the C kernels change a table they share; a client without them
(``available() is False``) reaches the same objects through the daemon, which places and holds
them on its behalf (its proxy bit). A daemon without them keeps its tables to itself and changes
them under one lock (``single_writer``).
"""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from ._backend import BACKEND
from .errors import HandleError, InvalidArgument, Reason, StateError, Unavailable
from .single_writer_slots import SingleWriterSlots

if TYPE_CHECKING:
    from ._shmt_lane import Lane

SLOT_NBYTES = 64
SESSION_BITS = 62  # bits 0..61: one per session holding a bit
PROXY_BIT = 62  # the daemon, holding on behalf of clients without a bit
HANDOFF_BIT = 63
HANDOFF = 1 << HANDOFF_BIT

FREE, LOANED, COMMITTED, HELD = 0, 1, 2, 3  # slot states (FREE: no object; retired)
# The offset in the slot of a dedicated segment's object (the daemon places those): past any
# arena, so no handle of the arena matches it.
OUTSIDE_ARENA = 1 << 62


def slot_index(wire_slot: int) -> int:
    """The table index a handle's ``slot`` names: the wire counts from 1, so that 0 can mean
    "names no slot" (every handle the daemon hands out names one; 0 is refused)."""
    return wire_slot - 1


def wire_slot(index: int) -> int:
    """``slot_index``'s inverse: what a handle carries for table index ``index``."""
    return index + 1


# A slot's fields, as the numpy view of ``columns`` names them (little-endian u64 each), and a
# hold record's; both are the C header's ``shmt_slot`` and ``shmt_hold`` (tests/test_object_table.py).
SLOT_DTYPE = np.dtype([
    ("generation", "<u8"), ("offset", "<u8"), ("nbytes", "<u8"), ("state", "<u8"),
    ("deadline_ns", "<u8"), ("owner", "<u8"), ("recall", "<u8"), ("daemon_pin", "<u8"),
])
HOLD_DTYPE = np.dtype([("holders", "<u8"), ("unused", "<u8", (7,))])
assert SLOT_DTYPE.itemsize == HOLD_DTYPE.itemsize == SLOT_NBYTES


class SlotStatus(enum.IntEnum):
    """Outcome of a slot operation, as the C kernels return it; ``raise_for`` turns a refusal into an error."""

    OK = 0
    STALE = 1
    NOT_COMMITTED = 2
    MISMATCH = 3
    ALREADY = 4
    NOT_HELD = 5
    UNKNOWN = 6


_STATUSES = tuple(SlotStatus)  # by code: faster than SlotStatus(rc) on a hot path
assert all(status.value == code for code, status in enumerate(_STATUSES))


def available() -> bool:
    """Whether this process can change an object table itself (the C kernels are loaded)."""
    return BACKEND == "c"


def table_nbytes(nslots: int) -> int:
    """The size of each of a table's two segments, the slots and the holds."""
    return nslots * SLOT_NBYTES


class _CSlots:
    """The C kernels (``shmt_slot_*``) with ``SingleWriterSlots``' signatures: atomic, so any
    number of processes may share the table."""

    def __init__(self, slots: memoryview, holds: memoryview, nslots: int):
        from ._native import ffi, lib

        self._ffi, self._lib, self.nslots = ffi, lib, nslots
        self.slots = ffi.from_buffer("uint8_t[]", slots)
        self.holds = ffi.from_buffer("uint8_t[]", holds, require_writable=True)

    def address(self, memory: object) -> int:
        """The address of ``slots`` or ``holds``."""
        return int(self._ffi.cast("uintptr_t", memory))

    def publish(self, index: int, offset: int, nbytes: int, bit: int) -> tuple[int, int]:
        out = self._ffi.new("uint64_t[1]")
        rc = self._lib.shmt_slot_publish(self.slots, self.holds, self.nslots, index, offset, nbytes, bit, out)
        return rc, int(out[0])

    def commit(self, index: int, generation: int, bit: int, deadline_ns: int, hold: bool) -> int:
        return int(self._lib.shmt_slot_commit(self.slots, self.holds, self.nslots, index, generation, bit,
                                              deadline_ns, hold))

    def acquire(self, index: int, generation: int, offset: int, nbytes: int, bit: int) -> int:
        return int(self._lib.shmt_slot_acquire(self.slots, self.holds, self.nslots, index, generation, offset,
                                               nbytes, bit))

    def release(self, index: int, generation: int, bit: int, cancel_handoff: bool) -> tuple[int, int]:
        out = self._ffi.new("uint64_t[1]")
        rc = self._lib.shmt_slot_release(self.slots, self.holds, self.nslots, index, generation, bit,
                                         cancel_handoff, out)
        return rc, int(out[0])

    def retire(self, index: int) -> int:
        return int(self._lib.shmt_slot_retire(self.slots, self.holds, self.nslots, index))

    def pin(self, index: int, pinned: bool) -> int:
        return int(self._lib.shmt_slot_pin(self.slots, self.nslots, index, pinned))

    def expire(self, index: int, now_ns: int) -> tuple[int, bool]:
        out = self._ffi.new("int32_t[1]")
        rc = self._lib.shmt_slot_expire(self.slots, self.holds, self.nslots, index, now_ns, out)
        return rc, bool(out[0])

    def clear_bit(self, first: int, last: int, bit: int) -> tuple[int, int, int, int]:
        out = self._ffi.new("uint64_t[3]")
        rc = self._lib.shmt_slots_clear_bit(self.slots, self.holds, self.nslots, first, last, bit, out, 3)
        return rc, int(out[0]), int(out[1]), int(out[2])


class GrantSpace:
    """A producer's grant, as the C kernels place in it (``shmt_grant_*``): its free bytes (the
    best-fit policy of ``allocator.Allocator``, which tests check it against) and its free slots
    (reused first in, first out), in process-local memory. A table lane (``ObjectTable.open_lane``)
    places an object there with one native call and gives it back with another, as does
    ``ObjectTable.reclaim_in`` for one that died while others held it; only with the C kernels (a
    client without them has no table). Not thread-safe: the producer's lock serializes it."""

    __slots__ = ("_memory", "_space", "nslots", "address")

    def __init__(self, offset: int, nbytes: int, first_slot: int, nslots: int, page_align_min: int = 64 * 1024):
        """The grant of ``nbytes`` at arena ``offset`` with slots ``[first_slot, first_slot + nslots)``."""
        from ._native import ffi, lib

        self._memory = ffi.new("uint8_t[]", lib.shmt_grant_space_nbytes(nslots))
        self._space = ffi.cast("shmt_grant_space *", self._memory)
        self.address = int(ffi.cast("uintptr_t", self._space))  # for the table lane's calls
        self.nslots = nslots
        if lib.shmt_grant_space_init(self._space, offset, nbytes, first_slot, nslots, page_align_min) != 0:
            raise InvalidArgument(f"a grant of {nbytes} bytes and {nslots} slots")

    @property
    def largest_free_nbytes(self) -> int:
        """The largest free extent: an upper bound on what one placement can get."""
        return int(self._space.largest)

    @property
    def free_slots(self) -> int:
        """Slots free for a placement."""
        return int(self._space.free_slots)

    @property
    def used_nbytes(self) -> int:
        """Bytes reserved by live objects, alignment padding included."""
        return int(self._space.used)

    @property
    def empty(self) -> bool:
        """Whether no object of the grant is alive."""
        return int(self._space.free_slots) == self.nslots



class ObjectTable:
    """A mapped table of ``nslots`` slots; thread-safe (every change is atomic), unless made with
    ``single_writer``.

    ``slots`` is read-only for a consumer (it can only acquire and release), writable for a
    producer and the daemon; ``holds`` is always writable."""

    def __init__(self, slots: memoryview, holds: memoryview, nslots: int, single_writer: bool = False):
        """``single_writer``: the table is changed by one thread of this process at a time and
        mapped by no other process; its kernels are then pure Python (``single_writer_slots``), and
        it needs no C kernels (a daemon without them keeps its tables so)."""
        if not single_writer and not available():
            raise StateError("the object table needs the C kernels (SHMTRANSPORT_BACKEND=c)")
        if slots.nbytes < table_nbytes(nslots) or holds.nbytes < table_nbytes(nslots) or holds.readonly:
            raise InvalidArgument(f"an object table of {nslots} slots needs {table_nbytes(nslots)} bytes of "
                                  "slots and as many writable bytes of holds")
        self.nslots = nslots
        self.writable = not slots.readonly
        self.single_writer = single_writer
        self._memory = (slots, holds)
        self.columns: npt.NDArray[np.void] = np.frombuffer(slots, dtype=SLOT_DTYPE, count=nslots)
        self.holders: npt.NDArray[np.uint64] = np.frombuffer(holds, dtype=HOLD_DTYPE, count=nslots)["holders"]
        self._kernels: _CSlots | SingleWriterSlots = (
            SingleWriterSlots(self.columns, self.holders) if single_writer else _CSlots(slots, holds, nslots))
        self._lanes: list[Lane] = []
        self.closed = False

    def open_lane(self, bit: int, ids: tuple[str, str, str], arena: memoryview) -> Lane:
        """A client's fast lane into this table (``_shmt_lane.Lane``, ``shmt_lane`` in the C
        kernels): each step of a handoff in one native call that also builds its Python results,
        with the session's ``bit`` and the ``ids`` its handles carry (arena segment name, session
        id, daemon instance id); views of objects are cut from ``arena``, the whole arena. A
        consumer's leases are counted there. The lane keeps the table mapped until ``close``."""
        kernels = self._kernels
        if not isinstance(kernels, _CSlots):
            raise StateError("a table lane needs the C kernels and a table shared with other processes")
        from ._native import Lane

        name, owner, instance = (s.encode("ascii") for s in ids)
        try:
            lane = Lane(kernels.address(kernels.slots), kernels.address(kernels.holds), self.nslots, bit, name, owner,
                        instance, arena.nbytes, arena, kernels, _refuse)
        except ValueError as exc:
            raise InvalidArgument(f"cannot open a lane into the object table: {exc}") from exc
        self._lanes.append(lane)
        return lane

    def publish(self, index: int, offset: int, nbytes: int, bit: int) -> int:
        """A new object in free slot ``index``, held by ``bit`` (a session's, or the proxy bit for
        an object the daemon places); its generation."""
        self._require_writable("publish")
        rc, generation = self._kernels.publish(index, offset, nbytes, bit)
        self._ok(rc, index)
        return generation

    def reclaim_in(self, space: GrantSpace, index: int) -> bool:
        """The object of the grant ``space`` in ``index`` died: its slot is retired and its bytes
        and slot come back to the grant. False (nothing comes back) while anyone holds it, a bit
        was written into its word, or the daemon pins it; StateError when it is no live object of
        the grant."""
        kernels = self._kernels
        if not isinstance(kernels, _CSlots):
            raise StateError("reclaim_in: this process does not place objects in this table")
        rc = kernels._lib.shmt_grant_reclaim(space._space, kernels.slots, kernels.holds, self.nslots, index)
        if rc == kernels._lib.SHMT_GRANT_NOT_LIVE:
            raise StateError(f"object slot {index}: no live object of this grant")
        if rc == SlotStatus.ALREADY:
            return False
        if rc:
            raise_for(self._status(rc), index)
        return True

    def commit(self, index: int, generation: int, bit: int, deadline_ns: int, hold: bool = False) -> None:
        """Seal the loan in slot ``index``: its hand-off window (or hold) ends at ``deadline_ns``."""
        if not self.writable:
            self._require_writable("commit")
        rc = self._kernels.commit(index, generation, bit, deadline_ns, hold)
        if rc:
            raise_for(self._status(rc), index)

    def acquire(self, index: int, generation: int, offset: int, nbytes: int, bit: int) -> SlotStatus:
        """Hold the committed object ``generation`` of slot ``index`` with ``bit``, if it is still
        that object at that offset and size."""
        return self._status(self._kernels.acquire(index, generation, offset, nbytes, bit))

    def release(self, index: int, generation: int, bit: int, cancel_handoff: bool = False) -> int:
        """Drop ``bit``; the holders left (0: the object is dead, its slot and bytes reusable)."""
        rc, remaining = self._kernels.release(index, generation, bit, cancel_handoff)
        if rc:
            raise_for(self._status(rc), index)
        return remaining

    def retire(self, index: int) -> bool:
        """Mark slot ``index`` FREE before its bytes are reused: whether they may be (not while
        someone holds it, a client wrote a bit into its dead word, or the daemon pins it)."""
        self._require_writable("retire")
        return self._status(self._kernels.retire(index)) is SlotStatus.OK

    def pin(self, index: int, pinned: bool) -> None:
        """Daemon: pin slot ``index``'s bytes (before holding its object with the proxy bit) or
        unpin them (after letting it go). A pinned object's bytes are not reused whatever the holds
        say: a consumer can clear the proxy bit there, never the pin (it cannot write the slots)."""
        self._require_writable("pin")
        self._ok(self._kernels.pin(index, pinned), index)

    def expire(self, index: int, now_ns: int) -> bool | None:
        """Drop an ended hand-off window's bit: True when that freed the object, False when others
        still hold it, None when there was nothing to expire."""
        rc, freed = self._kernels.expire(index, now_ns)
        return freed if self._status(rc) is SlotStatus.OK else None

    def clear_bit(self, bit: int, first: int = 0, last: int | None = None) -> tuple[int, int, int]:
        """Drop ``bit`` from slots [first, last): (slots it held, objects that died, their bytes)."""
        last = self.nslots if last is None else last
        rc, held, died, died_nbytes = self._kernels.clear_bit(first, last, bit)
        if rc != 0:
            raise InvalidArgument(f"clear_bit({bit}, {first}, {last}) outside a table of {self.nslots} slots")
        return held, died, died_nbytes

    def close(self) -> None:
        """Drop this table's references to the mappings (so they can be unmapped); it has no slots
        left, and its lanes take no more calls."""
        self.closed = True  # first: a thread that took views before this sees it before using them
        for lane in self._lanes:
            lane.close()
        self._lanes = []
        self.columns = np.empty(0, dtype=SLOT_DTYPE)
        self.holders = np.empty(0, dtype=np.uint64)
        self._kernels = SingleWriterSlots(self.columns, self.holders)
        self._memory = (memoryview(b""), memoryview(bytearray()))

    def _require_writable(self, what: str) -> None:
        # A consumer's slots are mapped read-only: a write there would be a segfault, not an error.
        if not self.writable:
            raise StateError(f"{what}: this session maps the object table's slots read-only (a consumer)")

    def _status(self, rc: int) -> SlotStatus:
        if rc < 0:
            raise InvalidArgument(f"object-table call refused its arguments (code {rc})")
        return _STATUSES[rc] if rc < len(_STATUSES) else SlotStatus(rc)

    def _ok(self, rc: int, index: int) -> None:
        if rc != 0:
            raise_for(self._status(rc), index)


def status_of(rc: int) -> SlotStatus:
    """The status a slot kernel's code (>= 0) means."""
    return _STATUSES[rc] if rc < len(_STATUSES) else SlotStatus(rc)


LANE_CLOSED = -40  # SHMT_LANE_CLOSED: a call on the lane of a table closed since (the session ended)


def _refuse(rc: int, index: int) -> None:
    """Raise a table lane's refusal (called from C): a slot status, or a closed lane."""
    if rc == LANE_CLOSED:
        raise Unavailable("the daemon of this session is gone (its object table was let go)")
    if rc < 0:
        raise InvalidArgument(f"object-table call refused its arguments (code {rc})")
    raise_for(status_of(rc), index)


def raise_for(status: SlotStatus, index: int, what: str = "") -> None:
    """The typed error a refused slot operation means to the caller."""
    where = f"object slot {index}" + (f" ({what})" if what else "")
    if status is SlotStatus.STALE:
        raise HandleError(f"stale handle: {where} was freed or reused", Reason.STALE_HANDLE)
    if status is SlotStatus.UNKNOWN:
        raise HandleError(f"no such object: {where} never had that generation")
    if status is SlotStatus.NOT_COMMITTED:
        raise StateError(f"{where} is still a loan: it was not committed")
    if status is SlotStatus.MISMATCH:
        raise HandleError(f"handle does not match {where}: other offset or size", Reason.OUT_OF_BOUNDS)
    if status is SlotStatus.ALREADY:
        raise StateError(f"{where}: already held or already committed")
    raise StateError(f"{where}: not held by this client")
