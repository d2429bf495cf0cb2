"""The object table's slot kernels in pure Python, for a table only one thread of one process
changes at a time: a daemon without the C kernels keeps its tenants' tables this way, under each
tenant's lock, and hands them to no client (a client's atomic writes would race these plain ones).

Each method is its C twin's (``shmt_slot_*`` in ``csrc/shmt_kernels.h``): the same status codes,
the same words written; ``tests/test_object_table.py`` runs one model of the state machine against
both.
"""
from __future__ import annotations

import numpy as np
import numpy.typing as npt

EINVAL = -1  # SHMT_EINVAL: an argument outside the table or the bits
OK, STALE, NOT_COMMITTED, MISMATCH, ALREADY, NOT_HELD, UNKNOWN = range(7)
_PROXY_BIT, _HANDOFF = 62, 1 << 63
_FREE, _LOANED, _COMMITTED, _HELD = 0, 1, 2, 3


class SingleWriterSlots:
    """Slot kernels over a table's numpy views (``columns``: the slots, ``holders``: the holds)."""

    def __init__(self, columns: npt.NDArray[np.void], holders: npt.NDArray[np.uint64]):
        """``columns`` and ``holders``: writable views of the table's two segments, one row per slot."""
        self.columns = columns
        self.holders = holders
        self.nslots = len(holders)

    def _field(self, name: str, index: int) -> int:
        return int(self.columns[name][index])

    def _set(self, name: str, index: int, value: int) -> None:
        self.columns[name][index] = value

    def _held(self, index: int) -> int:
        return int(self.holders[index])

    def publish(self, index: int, offset: int, nbytes: int, bit: int) -> tuple[int, int]:
        """(status, generation): a new object in free slot ``index``, held by ``bit``."""
        if not 0 <= index < self.nslots or not 0 <= bit <= _PROXY_BIT or nbytes <= 0:
            return EINVAL, 0
        if self._held(index):
            return ALREADY, 0
        generation = self._field("generation", index) + 1
        for name, value in (("generation", generation), ("offset", offset), ("nbytes", nbytes),
                            ("state", _LOANED), ("deadline_ns", 0), ("owner", bit)):
            self._set(name, index, value)
        self.holders[index] = 1 << bit
        return OK, generation

    def commit(self, index: int, generation: int, bit: int, deadline_ns: int, hold: bool) -> int:
        """Seal the loan ``bit`` holds in slot ``index``."""
        if not 0 <= index < self.nslots or not 0 <= bit <= _PROXY_BIT:
            return EINVAL
        if not self._held(index) >> bit & 1 or self._field("generation", index) != generation:
            return NOT_HELD
        if self._field("state", index) != _LOANED:
            return ALREADY
        self._set("deadline_ns", index, deadline_ns)
        self.holders[index] = self._held(index) | _HANDOFF
        self._set("state", index, _HELD if hold else _COMMITTED)
        return OK

    def acquire(self, index: int, generation: int, offset: int, nbytes: int, bit: int) -> int:
        """Add ``bit`` to the live committed object ``generation`` at that offset and size."""
        if not 0 <= index < self.nslots or not 0 <= bit <= _PROXY_BIT:
            return EINVAL
        current, held = self._field("generation", index), self._held(index)
        if generation == 0 or generation > current:
            return UNKNOWN
        if current != generation or not held:
            return STALE
        state = self._field("state", index)
        if state == _LOANED:
            return NOT_COMMITTED
        if state not in (_COMMITTED, _HELD):
            return STALE  # retired: its bytes may be another object's now
        if (self._field("offset", index), self._field("nbytes", index)) != (offset, nbytes):
            return MISMATCH
        if held >> bit & 1:
            return ALREADY
        held |= 1 << bit
        if state == _COMMITTED:  # the first acquire takes the hand-off over
            held &= ~_HANDOFF
        self.holders[index] = held
        return OK

    def release(self, index: int, generation: int, bit: int, cancel_handoff: bool) -> tuple[int, int]:
        """(status, holders left): drop ``bit``, and the hand-off bit too when ``cancel_handoff``."""
        if not 0 <= index < self.nslots or not 0 <= bit <= _PROXY_BIT:
            return EINVAL, 0
        held = self._held(index)
        if not held >> bit & 1 or self._field("generation", index) != generation:
            return NOT_HELD, 0
        held &= ~((1 << bit) | (_HANDOFF if cancel_handoff else 0))
        self.holders[index] = held
        return OK, held

    def retire(self, index: int) -> int:
        """Mark slot ``index`` FREE when nobody holds it (else ALREADY), before its bytes are reused;
        ALREADY too when the daemon pins it."""
        if not 0 <= index < self.nslots:
            return EINVAL
        if self._held(index):
            return ALREADY
        self._set("state", index, _FREE)
        return ALREADY if self._field("daemon_pin", index) else OK

    def pin(self, index: int, pinned: bool) -> int:
        """Set or clear slot ``index``'s daemon pin (its bytes are not reused while set)."""
        if not 0 <= index < self.nslots:
            return EINVAL
        self._set("daemon_pin", index, int(pinned))
        return OK

    def expire(self, index: int, now_ns: int) -> tuple[int, bool]:
        """(status, freed): drop the hand-off bit of a window that ended before ``now_ns``."""
        if not 0 <= index < self.nslots:
            return EINVAL, False
        held = self._held(index)
        if not held & _HANDOFF:
            return NOT_HELD, False
        if self._field("deadline_ns", index) > now_ns:
            return ALREADY, False
        self.holders[index] = held & ~_HANDOFF
        return OK, not held & ~_HANDOFF

    def clear_bit(self, first: int, last: int, bit: int) -> tuple[int, int, int, int]:
        """(status, slots it held, objects that died, their bytes): drop ``bit`` from [first, last)."""
        if not 0 <= first <= last <= self.nslots or not 0 <= bit <= _PROXY_BIT:
            return EINVAL, 0, 0, 0
        mask = np.uint64(1 << bit)
        words = self.holders[first:last]
        held = (words & mask) != 0
        died = held & ((words & ~mask) == 0)
        words[held] &= ~mask
        sizes = self.columns["nbytes"][first:last][died]
        return OK, int(held.sum()), int(died.sum()), sum(int(n) for n in sizes)
