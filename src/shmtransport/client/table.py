"""A client's side of its tenant's object table: objects loaned, committed, acquired and released
in shared memory alone (``objtable``), with space granted by the daemon in large pieces.

A producer places objects in its grants itself (a best-fit ``Allocator`` per grant, and the
grant's slots). An object's bytes come back to the producer when its slot's holders reach zero,
whoever dropped the last hold: the producer notices that lazily (``collect``), when it needs
space. Grants it no longer needs go back to the daemon, which frees them once every object in
them died; so do all of them when the session ends, which is what lets a handed-off object
outlive its producer. A producer keeps its empty grants for its next objects (a new grant costs a
round trip) and gives them back, through the daemon's Grant call, when the daemon recalls them
(another producer needs the room) or after a long idleness. The daemon so acts only on what it
was told, never on a word in the table, and space a producer holds idle is space the others wait
for only until its next look (0.1 s).

A consumer holds an object with its session's bit; several leases on one object in one client
share the bit (counted here), so the last of them clears it. (A client is a producer or a
consumer, never both: a producer's bit on an object is its reference, a consumer's its leases.)
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable

from ..allocator import PAGE
from ..arena import ArenaMapping
from ..errors import InvalidArgument, Reason, ResourceExhausted, StateError
from ..objtable import (
    PROXY_BIT,
    GrantSpace,
    ObjectTable,
    SlotStatus,
    raise_for,
    status_of,
)
from ..v1 import daemon_pb2 as pb

# Fault injection (the chaos harness): called with a step name between the steps of every
# sequence below; a no-op unless a harness installs a hook in this process.
fault_point: Callable[[str], None] | None = None


def _step(name: str) -> None:
    if fault_point is not None:
        fault_point(name)


SLOT_PER_NBYTES = 4096  # a standard grant first carries one slot per this many bytes
# A producer whose grants run out of slots before bytes (many small objects) asks for 4x denser
# grants next, down to one slot per this many bytes; a table with no room for that many slots
# then still grants the minimum of 64.
MIN_SLOT_PER_NBYTES = 256
MIN_GRANT_SLOTS = 64
MIN_GRANT_NBYTES = 64 * 1024
MAX_GRANT_NBYTES = 16 << 20
GRANT_ARENA_FRACTION = 64  # a standard grant is this fraction of the arena (within the bounds above)
# A producer keeps its empty grants (as many as its peak of bytes in flight: a new grant costs a
# round trip, which a frontend idle between requests would pay on each); idle this long, it gives
# them back unasked.
IDLE_GIVE_BACK_S = 5.0

GrantCall = Callable[[int, int, list[int], int, bool], pb.GrantResponse]  # (nbytes, nslots, give_back, wait_ms, retry)
# A producer waiting for space looks at its own grants again after waits growing from the first to
# the last (its consumers, and its own other threads, free space in its grants without telling the
# daemon). Each look is a Grant call: the tail bounds what a producer waiting long costs the daemon
# (a few calls a second), at the price of noticing room freed in its own grants that much later.
# Room anywhere else ends the wait at once (the daemon wakes a waiting Grant when it frees bytes).
GRANT_POLL_S = (0.0, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2)


@dataclasses.dataclass(slots=True)
class _Grant:
    grant_id: int
    offset: int
    nbytes: int
    space: GrantSpace  # its free bytes and free slots
    first_slot: int  # where the daemon's recall of it is written
    large: bool  # made for an object larger than a standard grant: holds one object at a time


@dataclasses.dataclass(slots=True)
class Placed:
    """One object this producer placed: where it is, and whether this producer still holds it."""

    slot: int
    generation: int
    offset: int  # arena offset
    nbytes: int
    grant: _Grant
    wire: bytes  # its handle's wire form
    memory: memoryview | None  # a view of its bytes, until the loan takes it
    held: bool = True  # this producer's bit is set
    committed: bool = False
    hold: bool = False  # committed with hold_ms: the hand-off bit stays until the hold ends


class TableClient:
    """Not thread-safe by itself: the owning client serializes calls with its lock, except a
    commit (one atomic step in the table, on an object only its own loan commits) and the lease
    calls (the lane counts leases itself)."""

    def __init__(self, table: ObjectTable, bit: int, mapping: ArenaMapping, ids: tuple[str, str, str],
                 arena_nbytes: int, handoff_window_ms: int, max_hold_ms: int, grant: GrantCall):
        # (max_hold_ms is the daemon's; the table cannot check it, so the client does.)
        """``mapping``: the session's arena, whose objects the table's are; ``ids``: what this
        session's handles carry (arena segment name, session id, daemon instance id).
        ``grant(nbytes, nslots, give_back, wait_ms, retry)``: the daemon's Grant RPC; one that
        waits must let the owner's other threads in meanwhile (their releases may be the room it
        waits for)."""
        self.table = table
        self.bit = bit
        self.mapping = mapping
        self.ids = ids
        # Each step in one native call, which also counts a consumer's leases.
        self.lane = table.open_lane(bit, ids, mapping.view(0, mapping.nbytes))
        self.handoff_window_ns = handoff_window_ms * 1_000_000
        self.max_hold_ms = max_hold_ms
        self._grant_rpc = grant
        self.arena_nbytes = arena_nbytes
        self.standard_grant_nbytes = min(arena_nbytes, max(MIN_GRANT_NBYTES, min(MAX_GRANT_NBYTES,
                                                                             arena_nbytes // GRANT_ARENA_FRACTION)))
        self.standard_grant_nbytes = self.standard_grant_nbytes // PAGE * PAGE
        self._grants: list[_Grant] = []
        self._placed: dict[int, Placed] = {}  # slot -> object whose bytes are this producer's
        self._released: dict[int, Placed] = {}  # of those, the ones others still hold
        self.give_back: list[int] = []  # grant ids to return with the next Grant call
        self._placed_at = 0.0  # monotonic time of the last placement
        self._slot_per_nbytes = SLOT_PER_NBYTES  # the density of this producer's next standard grant

    # -- producer --------------------------------------------------------------------------------
    def place(self, specs: list[tuple[int, bytes, tuple[int, ...]]], wait_s: float = 0.0) -> list[Placed]:
        """Loans for every (nbytes, dtype, shape), all or nothing; waits up to ``wait_s`` for
        space (back-pressure: freed by this producer's consumers or by other producers) before
        ResourceExhausted."""
        placed: list[Placed] = []
        deadline = time.monotonic() + wait_s
        try:
            for nbytes, dtype, shape in specs:
                placed.append(self.place_one(nbytes, dtype, shape, deadline))
        except BaseException:
            for obj in placed:
                self.release_own(obj, cancel_handoff=True)
            raise
        return placed

    def place_one(self, nbytes: int, dtype: bytes, shape: tuple[int, ...], deadline: float | None = None,
                  wait_s: float = 0.0) -> Placed:
        """A loan of ``nbytes`` for a tensor of ``dtype`` and ``shape`` (its handle's wire form is
        written with it), waiting until ``deadline`` (``time.monotonic``; default: ``wait_s`` from
        now) for space."""
        self._placed_at = now = time.monotonic()
        obj = self._try_place(nbytes, dtype, shape)  # a handoff's hot path: room in the newest grant
        if obj is not None:
            return obj
        return self._place_waiting(nbytes, dtype, shape, now + wait_s if deadline is None else deadline)

    def _place_waiting(self, nbytes: int, dtype: bytes, shape: tuple[int, ...], deadline: float) -> Placed:
        attempts = itertools.count()
        while True:
            attempt = next(attempts)
            if attempt:
                obj = self._try_place(nbytes, dtype, shape)
                if obj is not None:
                    return obj
            self.collect()
            obj = self._try_place(nbytes, dtype, shape)
            if obj is not None:
                return obj
            remaining = deadline - time.monotonic()
            wait_s = max(0.0, min(remaining, GRANT_POLL_S[min(attempt, len(GRANT_POLL_S) - 1)]))
            try:
                self._new_grant(nbytes, int(wait_s * 1000), retry=remaining - wait_s > 0)
            except ResourceExhausted as exc:
                if self._give_back_empty():
                    continue  # this producer's own idle grants were in the way
                if exc.reason is Reason.TABLE_FULL or time.monotonic() >= deadline or nbytes > self.arena_nbytes:
                    raise  # (an object larger than the arena never fits: no point waiting)
                continue
            obj = self._try_place(nbytes, dtype, shape)
            if obj is None:  # pragma: no cover - a fresh grant always fits its first object
                raise ResourceExhausted(f"no room for {nbytes} bytes in a fresh grant", Reason.ARENA_FULL)
            return obj

    def _give_back_empty(self) -> bool:
        """Queue every empty grant for return (with the next Grant call); whether there was one."""
        return self._give_back([grant for grant in self._grants if grant.space.empty])

    def _give_back(self, grants: list[_Grant]) -> bool:
        """Queue these grants for return with the next Grant call; whether there was one."""
        for grant in grants:
            self._grants.remove(grant)
            self.give_back.append(grant.grant_id)
        return bool(grants)

    def _try_place(self, nbytes: int, dtype: bytes, shape: tuple[int, ...]) -> Placed | None:
        oversized = nbytes > self.standard_grant_nbytes
        for grant in reversed(self._grants):
            space = grant.space
            if grant.large != oversized:
                continue
            if grant.large and (not space.empty or 2 * nbytes <= grant.nbytes):
                continue  # one object at a time, and not one that would leave most of it idle
            # (it says when the grant has no room)
            placed = self.lane.place(space.address, nbytes, nbytes, dtype, shape)
            if placed is None:
                continue
            if fault_point is not None:  # (inline: a handoff's hot path)
                fault_point("t_after_publish")
            offset, generation, slot, wire, memory = placed
            obj = Placed(slot, generation, offset, nbytes, grant, wire, memory)
            self._placed[slot] = obj
            return obj
        return None

    def _new_grant(self, nbytes: int, wait_ms: int, retry: bool) -> None:
        oversized = nbytes > self.standard_grant_nbytes
        size = -(-nbytes // PAGE) * PAGE if oversized else self.standard_grant_nbytes
        if not oversized and any(not g.large and not g.space.free_slots and g.space.largest_free_nbytes >= nbytes
                                 for g in self._grants):
            self._slot_per_nbytes = max(MIN_SLOT_PER_NBYTES, self._slot_per_nbytes // 4)  # slots ran out first
        nslots = MIN_GRANT_SLOTS if oversized else max(MIN_GRANT_SLOTS, size // self._slot_per_nbytes)
        # Given back once sent, whatever the reply: the daemon applies returns before it allocates
        # (and orphans every grant of a session that ends anyway).
        if oversized:  # spare large grants that did not fit go back first, so the daemon has their space
            self._give_back([g for g in self._grants if g.large and g.space.empty])
        give_back, self.give_back = self.give_back, []
        try:
            response = self._grant_rpc(size, nslots, give_back, wait_ms, retry)
        except ResourceExhausted as exc:
            if exc.reason is not Reason.TABLE_FULL or nslots == MIN_GRANT_SLOTS:
                raise
            # Fewer slots may still fit; with bytes for them at this density, not a whole grant's.
            small = max(MIN_GRANT_NBYTES, MIN_GRANT_SLOTS * self._slot_per_nbytes, -(-nbytes // PAGE) * PAGE)
            size = min(size, -(-small // PAGE) * PAGE)
            response = self._grant_rpc(size, MIN_GRANT_SLOTS, [], wait_ms, retry)
        _step("t_after_grant")
        space = GrantSpace(response.offset, response.nbytes, response.first_slot, response.nslots)
        self._grants.append(_Grant(response.grant_id, response.offset, response.nbytes, space, response.first_slot,
                                   oversized))

    def commit(self, obj: Placed, hold_ms: int = 0) -> None:
        """Make ``obj`` readable, held for ``hold_ms`` (0: the hand-off window, which the first
        acquire ends); InvalidArgument past ``max_hold_ms``, StateError if already committed."""
        if hold_ms > self.max_hold_ms:
            raise InvalidArgument(f"hold_ms={hold_ms} exceeds the maximum {self.max_hold_ms}")
        if obj.committed:
            raise StateError(f"object in slot {obj.slot} is already committed")
        window_ns = hold_ms * 1_000_000 if hold_ms else self.handoff_window_ns
        if fault_point is not None:
            fault_point("t_before_commit")
        rc = self.lane.commit(obj.slot, obj.generation, time.monotonic_ns() + window_ns, bool(hold_ms))
        if rc:
            raise_for(status_of(rc), obj.slot)
        if fault_point is not None:
            fault_point("t_after_commit")
        obj.committed, obj.hold = True, bool(hold_ms)

    def owned(self, slot: int, generation: int) -> Placed | None:
        """The object this producer placed at ``slot`` in that generation; None if it is not one."""
        obj = self._placed.get(slot)
        return obj if obj is not None and obj.generation == generation else None

    def release_own(self, obj: Placed, cancel_handoff: bool) -> None:
        """Drop this producer's reference; the bytes come back now if nobody else holds them.
        ``cancel_handoff``: an explicit release (the object lives on only for consumers that
        already hold it); closing keeps the hand-off bit, so a consumer may still take it."""
        if not obj.held:
            raise StateError(f"object in slot {obj.slot} already released", Reason.DOUBLE_RELEASE)
        cancel = not obj.committed or (cancel_handoff and not obj.hold)
        rc, remaining = self.lane.release_own(obj.grant.space.address, obj.slot, obj.generation, cancel)
        if rc:
            if rc < 0:  # (the grant's, SHMT_GRANT_NOT_LIVE)
                raise StateError(f"object slot {obj.slot}: no live object of this grant")
            raise_for(status_of(rc), obj.slot)
        if fault_point is not None:
            fault_point("t_after_release")
        obj.held = False
        if remaining == 0:
            self._forget(obj)  # its bytes and slot came back in the same call
        else:
            self._released[obj.slot] = obj

    def collect(self) -> int:
        """Take back the bytes of every placed object that died; queue for return the empty
        grants the daemon recalled (all of them once idle long). The bytes reclaimed."""
        table = self.table
        holders, recall = table.holders, table.columns["recall"]  # views taken before a close drops them
        freed = 0
        if table.closed:  # the connection dropped the table (the daemon went away): nothing is ours
            return freed
        try:
            for obj in list(self._released.values()):
                if holders[obj.slot] == 0 and table.reclaim_in(obj.grant.space, obj.slot):
                    freed += obj.nbytes
                    self._forget(obj)
        except StateError:
            if table.closed:  # dropped meanwhile
                return freed
            raise
        idle = time.monotonic() - self._placed_at >= IDLE_GIVE_BACK_S
        self._give_back([grant for grant in self._grants if grant.space.empty and (
            idle or recall[grant.first_slot] == grant.grant_id)])
        return freed

    @property
    def has_surplus(self) -> bool:
        """Whether ``collect`` may have work, now or later (its owner then collects in the
        background): grants to give back, objects others still hold, grants the daemon may recall."""
        return bool(self.give_back or self._released or self._grants)

    def _forget(self, obj: Placed) -> None:
        """``obj`` died and its grant has its bytes and slot back (reused first in, first out: a
        slot's next generation comes late)."""
        del self._placed[obj.slot]
        self._released.pop(obj.slot, None)
        if obj.grant.large:
            # One spare large grant saves the next large object a round trip; more would only
            # keep arena space from other producers.
            spares = [g for g in self._grants if g.large and g.space.empty]
            self._give_back(sorted(spares, key=lambda g: g.nbytes)[:-1])

    # -- consumer --------------------------------------------------------------------------------
    def acquire(self, slot: int, generation: int, offset: int, nbytes: int) -> bool:
        """Take one more lease on the object; the first sets this client's hold bit, checked
        against the handle (a refusal raises as ``raise_for`` says). False, and nothing taken, for
        a loan the daemon placed that is not committed yet: its producer's Commit may be in
        flight, which the daemon's Acquire waits for."""
        status = status_of(self.lane.acquire(slot, generation, offset, nbytes))
        _step("t_after_acquire")
        if status is not SlotStatus.OK:
            if status is SlotStatus.NOT_COMMITTED and self.placed_by_daemon(slot):
                return False
            raise_for(status, slot)
        return True

    def placed_by_daemon(self, slot: int) -> bool:
        """Whether the object in ``slot`` is one the daemon placed for a client without a bit."""
        return int(self.table.columns["owner"][slot]) == PROXY_BIT

    def placed_by_me(self, slot: int) -> bool:
        """Whether this producer placed the object now in ``slot`` (or the last one there)."""
        return int(self.table.columns["owner"][slot]) == self.bit

    def release_lease(self, slot: int, generation: int) -> None:
        """Drop one lease; the last clears this client's hold bit. StateError (DOUBLE_RELEASE)
        if this client holds none."""
        rc = self.lane.release(slot, generation)
        if rc:
            status = status_of(rc)
            if status is SlotStatus.NOT_HELD:
                raise StateError(f"object slot {slot}: no lease of this client", Reason.DOUBLE_RELEASE)
        if fault_point is not None:
            fault_point("t_after_release")
        if rc:
            raise_for(status_of(rc), slot)

    @property
    def lease_count(self) -> int:
        """Leases this client holds through the table, counting each object's repeats."""
        return int(self.lane.lease_count())

    # -- the end ---------------------------------------------------------------------------------
    def give_back_all(self) -> list[int]:
        """Every grant, for returning at close (objects still alive keep theirs orphaned)."""
        ids = self.give_back + [grant.grant_id for grant in self._grants]
        self.give_back, self._grants = [], []
        self._placed.clear()
        self._released.clear()
        return ids

    def release_all(self) -> None:
        """Drop every hold of this client (close): leases, and producer references (committed
        objects keep their hand-off bit, so a consumer may still take them). A hold the daemon
        already cleared (it saw the session end first) is skipped."""
        self.lane.release_all()
        for obj in list(self._placed.values()):
            if obj.held:
                try:
                    self.release_own(obj, cancel_handoff=False)
                except StateError:
                    obj.held = False
