"""One tenant's object table as the daemon keeps it: where every object's lifetime is.

Clients with the C kernels loan, commit, acquire and release arena objects in the table alone
(``shmtransport.objtable``). The daemon
- gives each live session one holder bit (62 per tenant; later sessions go through the daemon);
- grants producers space in large pieces: an arena byte range plus a range of slots, in which
  the producer places objects itself (``Grant``); a grant is its producer's until the producer
  gives it back or its session ends: the daemon acts on what it was told and recorded, never on
  a word a client wrote. When another producer needs the room it *recalls* grants (a word it
  writes and producers read), and their producers give back the empty ones;
- places objects itself, one slot each, for clients that cannot (``place``: the pure-Python
  backend, sessions without a bit, the remote tier, dedicated segments), held with its proxy bit
  while ``allocations.AllocationBook`` books a reference to them;
- when a session ends, clears its bit in every slot and takes its grants over: an orphaned grant
  goes back to the arena once every object in it is dead;
- ends hand-off windows and holds: a committed object nobody acquired within the window is
  reclaimed (and counted);
- drops holds only a client's writing explains (``drop_forged_holds``);
- reads the table for Stat and metrics.

Every method is called with the tenant registry's lock held (the registry owns the arena
allocator and the quota); none blocks.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Callable, Collection, Mapping, NamedTuple, Sequence

import numpy as np
import numpy.typing as npt

from ..allocator import Allocator
from ..errors import (
    InvalidArgument,
    OwnershipError,
    Reason,
    ResourceExhausted,
    StateError,
)
from ..objtable import (
    COMMITTED,
    FREE,
    HANDOFF,
    HANDOFF_BIT,
    HELD,
    LOANED,
    PROXY_BIT,
    SESSION_BITS,
    SLOT_NBYTES,
    ObjectTable,
    available,
    slot_index,
    wire_slot,
)
from ..v1 import daemon_pb2 as pb
from .records import OwnObjects
from .segments import Segment

ReleaseBytes = Callable[[int], None]  # gives an arena offset back to the registry's allocator

_log = logging.getLogger("shmtransport.daemon")
_NEVER = 1 << 62  # alignment threshold the slot allocator never reaches: slots need only 64 bytes
_NO_OWNER = HANDOFF_BIT  # not a session bit: the owner of an object whose producer is gone


@dataclasses.dataclass
class Grant:
    """A run of arena bytes and table slots a producer places objects in itself."""

    grant_id: int
    session_id: str | None  # None: orphaned (its producer is gone), freed once all objects died
    offset: int
    nbytes: int
    first_slot: int
    nslots: int
    # Once orphaned: its slots not yet retired. Each dead one goes back to the table at once (a
    # producer that handed off one object and closed keeps one slot, not the grant's); the bytes
    # go back when the last one does (the daemon knows no object's extent: its producer wrote it).
    lingering_slots: list[int] | None = None


class ClosedHoldings(NamedTuple):
    """What a session still held in the table when it ended (``ObjectBook.close_session``)."""

    held: int  # slots its bit held: its own objects' and others'
    leases: int  # of those, leases: its bit on other producers' objects
    loans: int  # of those, its own loans never committed
    freed_nbytes: int  # bytes of the objects that died with it


class SessionHoldings(NamedTuple):
    """What a live session holds with its own bit in the table (``ObjectBook.session_holdings``)."""

    leases: int
    loaned_nbytes: int
    committed_nbytes: int


class DaemonSide(NamedTuple):
    """What the daemon books of one table object (``AllocationBook.daemon_side``), for List."""

    owner_session: str | None  # the producer of an object the daemon placed; None: a table producer's
    holder_sessions: list[str]  # one per lease the daemon holds for a client
    producer_held: bool
    segment_name: str
    quarantined_leases: int
    age_s: float


class ObjectBook:
    """The daemon's side of one tenant's object table: session bits, grants, the objects it
    places, and the janitor's passes (hand-off windows, forged holds); called under the tenant's
    lock."""

    def __init__(self, slots: Segment, holds: Segment, nslots: int, handoff_window_ms: int,
                 max_hold_ms: int = 60_000, shared: bool = True):
        """``slots`` and ``holds``: the table's two sealed segments (``objtable``), each of
        ``table_nbytes(nslots)``. ``shared``: clients with the C kernels map it and get holder
        bits; otherwise (or without the C kernels here) only the daemon changes it, and its
        sessions get no bit."""
        if nslots <= 0 or nslots % 64:
            raise InvalidArgument(f"object slots must be a positive multiple of 64, got {nslots}")
        self.slots_segment, self.holds_segment = slots, holds
        self.nslots = nslots
        self.handoff_window_ms = handoff_window_ms
        # No honest commit sets a deadline further ahead than this (plus the sweep's own slack).
        self._longest_deadline_ns = (max(handoff_window_ms, max_hold_ms) + 1000) * 1_000_000
        self._maps = (slots.map(), holds.map())
        self.shared = shared and available()
        self.table = ObjectTable(memoryview(self._maps[0]), memoryview(self._maps[1]), nslots,
                                 single_writer=not available())
        self._slots = Allocator(nslots * SLOT_NBYTES, page_align_min_nbytes=_NEVER)
        self._free_bits = list(range(SESSION_BITS - 1, -1, -1)) if self.shared else []  # pop(): bit 0 first
        self._bits: dict[str, int] = {}  # session id -> its bit
        self._grants: dict[int, Grant] = {}
        self._next_grant_id = 1
        # The size of each object the daemon placed (0: a slot it did not place), as it knows it:
        # a producer of the tenant can rewrite the slot's own word.
        self._placed_nbytes = np.zeros(nslots, dtype=np.uint64)
        self.counters = {"reclaimed_handoff_objects": 0, "reclaimed_handoff_nbytes": 0, "grants_total": 0}
        self._allocation_samples: collections.deque[tuple[float, int]] = collections.deque()
        self._next_handoff_scan = self._next_rate_sample = 0.0

    # -- sessions --------------------------------------------------------------------------------
    def open_session(self, session_id: str) -> int | None:
        """The holder bit of a new session, or None when all are taken (or the table is not shared:
        its objects go through the daemon)."""
        if not self._free_bits:
            return None
        bit = self._free_bits.pop()
        self._bits[session_id] = bit
        return bit

    def close_session(self, session_id: str, release_bytes: ReleaseBytes) -> ClosedHoldings:
        """The session ended (closed or died): clear its bit everywhere and orphan its grants.
        Its bit is free again only after that, so no new session inherits a hold. Returns what
        it still held and the bytes of the objects that died with it."""
        held = leases = loans = freed_nbytes = 0
        bit = self._bits.pop(session_id, None)
        if bit is not None:
            # Which of its holds are its own objects (loans, or committed ones it kept its
            # reference to), read before the bit is cleared: a slot the bit holds is not reused
            # meanwhile, and the session no longer changes its own bit.
            cols = self.table.columns
            mine = (self.table.holders & np.uint64(1 << bit)) != 0
            own = mine & (cols["owner"] == bit)
            loans = int((own & (cols["state"] == LOANED)).sum())
            held, _freed, freed_nbytes = self.table.clear_bit(bit)
            leases = max(held - int(own.sum()), 0)  # its bit on other producers' objects
            # Its objects that live on (handed off) keep no owner: the next session given this bit
            # must not look like their producer (Stat counts an owner's bit as no lease).
            owners = self.table.columns["owner"]
            owners[owners == bit] = _NO_OWNER
            self._free_bits.append(bit)
        for grant in self._grants.values():
            if grant.session_id == session_id:
                self._orphan(grant)
        self.reclaim_orphans(release_bytes)
        return ClosedHoldings(held, leases, loans, freed_nbytes)

    def bit_of(self, session_id: str) -> int | None:
        """The holder bit of a live session, None when it has none (no bit was free)."""
        return self._bits.get(session_id)

    # -- grants ----------------------------------------------------------------------------------
    def grant(self, session_id: str, offset: int, nbytes: int, nslots: int) -> pb.GrantResponse:
        """Record a grant of arena bytes [offset, +nbytes) (allocated by the caller) with
        ``nslots`` slots, or the longest run of free slots when no such run is free (objects
        outliving their grants leave the table in runs); ResourceExhausted when none is free."""
        if session_id not in self._bits:
            raise StateError("this session has no holder bit: it loans through the daemon (Loan)")
        nslots = min(nslots, self._slots.largest_free_nbytes // SLOT_NBYTES)
        if nslots == 0:
            raise ResourceExhausted(f"object table full: all {self.nslots} slots hold objects (raise --object-slots)",
                                    Reason.TABLE_FULL)
        first = self._slots.allocate(nslots * SLOT_NBYTES) // SLOT_NBYTES
        grant = Grant(self._next_grant_id, session_id, offset, nbytes, first, nslots)
        self._next_grant_id += 1
        self.table.columns["recall"][first] = 0  # a recall of the slots' last grant is not this one's
        self._grants[grant.grant_id] = grant
        self.counters["grants_total"] += 1
        return pb.GrantResponse(grant_id=grant.grant_id, offset=offset, nbytes=nbytes,
                                first_slot=first, nslots=nslots)

    def give_back(self, session_id: str, grant_ids: Sequence[int], release_bytes: ReleaseBytes) -> None:
        """A producer returns grants it no longer places objects in; objects still alive in
        them keep the grant (orphaned) until they die. Returning one twice is harmless (a retried
        call); returning another session's is refused, before anything is returned."""
        grants = [self._grants.get(grant_id) for grant_id in grant_ids]
        for grant_id, grant in zip(grant_ids, grants):
            if grant is not None and grant.session_id not in (session_id, None):
                raise OwnershipError(f"grant {grant_id} is not this session's")
        for grant in grants:
            if grant is not None and grant.session_id == session_id:
                self._orphan(grant)
        self.reclaim_orphans(release_bytes)

    def _orphan(self, grant: Grant) -> None:
        """The grant's producer is gone or gave it back: from now on its slots go back to the
        table one by one as their objects die."""
        grant.session_id = None
        self._slots.split(grant.first_slot * SLOT_NBYTES, SLOT_NBYTES)
        grant.lingering_slots = list(range(grant.first_slot, grant.first_slot + grant.nslots))

    # -- objects the daemon places -------------------------------------------------------------
    def place(self, offset: int, nbytes: int) -> tuple[int, int]:
        """A new object at ``offset`` (an arena offset, or ``OUTSIDE_ARENA`` for a dedicated
        segment's) in a slot of its own, held and owned by the proxy bit: (slot, generation).
        ResourceExhausted (TABLE_FULL) when no slot is free."""
        try:
            slot = self._slots.allocate(SLOT_NBYTES) // SLOT_NBYTES
        except ResourceExhausted:
            raise ResourceExhausted(f"object table full: all {self.nslots} slots hold objects (raise --object-slots)",
                                    Reason.TABLE_FULL) from None
        try:
            generation = self.table.publish(slot, offset, nbytes, PROXY_BIT)
        except BaseException:  # a client wrote holders into a free slot: leave it to the janitor
            self._slots.free(slot * SLOT_NBYTES)
            raise
        self._placed_nbytes[slot] = nbytes
        return slot, generation

    def unplace(self, slot: int) -> bool:
        """An object the daemon placed died (nobody holds it): its slot is retired and free again.
        False when a bit appeared in its word (a client wrote it): then nothing is freed, and
        its bytes must stay too."""
        if not self.table.retire(slot):
            return False
        self._placed_nbytes[slot] = 0
        self._slots.free(slot * SLOT_NBYTES)
        return True

    def dead(self, slots: Sequence[int]) -> list[int]:
        """Those of ``slots`` whose object nobody holds any more."""
        if not slots:
            return []
        index = np.asarray(slots, dtype=np.int64)
        dead: list[int] = index[self.table.holders[index] == 0].tolist()
        return dead

    def slot_of(self, handle: pb.Handle) -> int:
        """The table index a handle names; InvalidArgument when it names none of this table's."""
        slot = slot_index(handle.slot)
        if not 0 <= slot < self.nslots:
            raise InvalidArgument(f"handle names object slot {handle.slot}, the table has {self.nslots}")
        return slot

    def generation(self, slot: int) -> int:
        """The generation of the object in (or last in) ``slot``."""
        return int(self.table.columns["generation"][slot])

    def reclaim_orphans(self, release_bytes: ReleaseBytes) -> int:
        """Free every orphaned grant whose objects are all dead; the bytes returned."""
        orphans = [g for g in self._grants.values() if g.session_id is None]
        if not orphans:
            return 0
        holders = self.table.holders
        freed = 0
        for grant in orphans:
            assert grant.lingering_slots is not None
            lingering = []
            for slot in grant.lingering_slots:
                if holders[slot] == 0 and self.table.retire(slot):
                    self._slots.free(slot * SLOT_NBYTES)
                else:
                    lingering.append(slot)
            grant.lingering_slots = lingering
            if lingering:
                continue
            del self._grants[grant.grant_id]
            release_bytes(grant.offset)
            freed += grant.nbytes
        return freed

    def recall_grants(self) -> int:
        """Ask every live producer for its grants back (another producer of the tenant needs the
        room): each gives back those that are empty, through a Grant call, within its background
        thread's next look (0.1 s). The daemon writes the word and never reads it: a producer that
        writes it can only make grants come back early. The grants recalled."""
        recall = self.table.columns["recall"]
        live = [g for g in self._grants.values() if g.session_id is not None]
        for grant in live:
            recall[grant.first_slot] = grant.grant_id
        return len(live)

    @property
    def granted_nbytes(self) -> int:
        """Arena bytes in grants now, orphaned ones included."""
        return sum(g.nbytes for g in self._grants.values())

    # -- the janitor -----------------------------------------------------------------------------
    # Scans of the whole table are paced: a hand-off window of seconds needs no finer clock, and
    # idle daemons should cost nothing measurable per object (the tick itself is 50 ms).
    HANDOFF_SCAN_S = 0.25
    RATE_SAMPLE_S = 0.5
    # Slots one pass changes one at a time (expired windows, forged proxy bits and pins): words a
    # tenant's clients forge by the thousand cost the daemon (one process, every tenant's) a
    # bounded share of its time; the rest waits for the next pass.
    PASS_BUDGET = 1024

    def sweep(self, now: float, release_bytes: ReleaseBytes, rate_window_s: float,
              proxied: Callable[[], Collection[int]]) -> None:
        """One janitor tick: orphaned grants every tick, hand-off windows and the allocation rate
        at their own pace. ``proxied``: the slots the daemon holds with its proxy bit, asked only
        when a scan needs them."""
        self.reclaim_orphans(release_bytes)
        if now >= self._next_handoff_scan:
            self._next_handoff_scan = now + self.HANDOFF_SCAN_S
            if self.drop_forged_holds(proxied()) + self.expire_handoffs(int(now * 1_000_000_000)):
                self.reclaim_orphans(release_bytes)
        if now >= self._next_rate_sample:
            self._next_rate_sample = now + self.RATE_SAMPLE_S
            self.sample_allocations(rate_window_s)

    # -- holds nobody may have -------------------------------------------------------------------
    def drop_forged_holds(self, proxied: Collection[int]) -> int:
        """Drop what only a client's writing into the table explains (lock held), so that it never
        outlives its writer: session bits no live session has, and the proxy bit and the daemon's
        pin on slots not in ``proxied`` (where the daemon books no reference). The objects that died of it (their bytes
        go back with their grants, or as the daemon's dead placements); a forged deadline is
        ``expire_handoffs``'."""
        holders = self.table.holders.copy()  # one read: the words keep changing under us
        if not holders.size:
            return 0
        present = int(np.bitwise_or.reduce(holders))
        live = 0
        for bit in self._bits.values():
            live |= 1 << bit
        died = dropped = 0
        stray = present & ((1 << SESSION_BITS) - 1) & ~live
        while stray:  # a bit no session has: nobody may set it while we hold the lock
            bit = (stray & -stray).bit_length() - 1
            stray &= stray - 1
            held, gone, _ = self.table.clear_bit(bit)
            dropped, died = dropped + held, died + gone
        budget = self.PASS_BUDGET
        if present >> PROXY_BIT & 1:
            for index in np.flatnonzero(holders & np.uint64(1 << PROXY_BIT)).tolist():
                if index not in proxied and budget > 0:
                    budget -= 1
                    held, gone, _ = self.table.clear_bit(PROXY_BIT, index, index + 1)
                    dropped, died = dropped + held, died + gone
        for index in np.flatnonzero(self.table.columns["daemon_pin"]).tolist():
            if index not in proxied and budget > 0:  # a producer wrote it (the daemon pins only what it holds)
                budget -= 1
                self.table.pin(index, False)
                dropped += 1
        if dropped:
            _log.warning("dropped %d holds no live session or proxied lease has (written by a client); "
                         "%d objects died of it", dropped, died)
        return died

    # -- the hand-off window ---------------------------------------------------------------------
    def expire_handoffs(self, now_ns: int | None = None) -> int:
        """End the hand-off windows (and holds) that passed, and those whose deadline lies further
        ahead than any commit may ask for (a client wrote it), at most ``PASS_BUDGET`` of them
        (the rest at the next pass); the objects that died of it."""
        now_ns = time.monotonic_ns() if now_ns is None else now_ns
        cols = self.table.columns
        deadlines = cols["deadline_ns"].copy()
        handoff = (self.table.holders >> np.uint64(HANDOFF_BIT)) != 0
        forged = deadlines > np.uint64(now_ns + self._longest_deadline_ns)
        due = np.flatnonzero(handoff & ((deadlines <= now_ns) | forged))
        died = 0
        for index in due[:self.PASS_BUDGET].tolist():
            nbytes = self._bounded_nbytes(index)
            # A forged deadline ends now: the expiry is asked as of that deadline.
            if self.table.expire(index, max(now_ns, int(deadlines[index]))):
                died += 1
                self.counters["reclaimed_handoff_objects"] += 1
                self.counters["reclaimed_handoff_nbytes"] += nbytes
        return died

    def _bounded_nbytes(self, index: int) -> int:
        """The size of a slot's object: the daemon's own for one it placed; else what its producer
        wrote, no more than the grant it lies in."""
        if self._placed_nbytes[index]:
            return int(self._placed_nbytes[index])
        grant = next((g for g in self._grants.values() if g.first_slot <= index < g.first_slot + g.nslots), None)
        return min(int(self.table.columns["nbytes"][index]), grant.nbytes if grant is not None else 0)

    def _bounded_sizes(self, live: npt.NDArray[np.bool_] | npt.NDArray[np.intp]) -> npt.NDArray[np.uint64]:
        """The sizes of the ``live`` slots' objects (a mask, or indices) for sums: the daemon's own
        for those it placed, none larger than the largest grant for the others (their producers
        wrote them), so a forged word cannot wrap a sum around (or push a counter past what Stat
        can carry)."""
        largest = max((g.nbytes for g in self._grants.values()), default=0)
        placed = self._placed_nbytes[live]
        return np.where(placed != 0, placed, np.minimum(self.table.columns["nbytes"][live], np.uint64(largest)))

    # -- introspection ---------------------------------------------------------------------------
    @property
    def allocations_total(self) -> int:
        """Objects ever placed in the table: every placement adds one to its slot's generation,
        and generations are never reset."""
        return int(self.table.columns["generation"].sum())

    def sample_allocations(self, window_s: float) -> float:
        """Record the count now (the janitor calls this every tick); placements per second over
        the last ``window_s``."""
        now = time.monotonic()
        samples = self._allocation_samples
        samples.append((now, self.allocations_total))
        while len(samples) > 1 and now - samples[1][0] >= window_s:
            samples.popleft()
        return self.allocation_rate(window_s)

    def allocation_rate(self, window_s: float) -> float:
        """Objects placed per second over the last ``window_s``, from the table's generations."""
        samples = self._allocation_samples
        if len(samples) < 2:
            return 0.0
        return (samples[-1][1] - samples[0][1]) / window_s

    def snapshot(self) -> dict[str, int]:
        """Live objects in the table, the bytes of those producers placed (the daemon's own are
        counted where it allocated them), consumer leases held with session bits (other than the
        producer's), and objects waiting for a first acquire."""
        cols = self.table.columns
        holders = self.table.holders.copy()  # one read: the words keep changing under us
        live = holders != 0
        owner_bits = np.left_shift(np.uint64(1), cols["owner"][live] & np.uint64(63))
        consumer = holders[live] & np.uint64((1 << SESSION_BITS) - 1) & ~owner_bits
        leases = int(np.unpackbits(consumer.view(np.uint8)).sum()) if consumer.size else 0
        by_producers = live & (self._placed_nbytes == 0)
        return {
            "objects": int(live.sum()),
            "nbytes": int(self._bounded_sizes(by_producers).sum()),
            "leases": leases,
            "handoff": int(((holders & np.uint64(HANDOFF)) != 0).sum()),
        }

    def session_holdings(self) -> dict[str, SessionHoldings]:
        """Per session with a bit: the leases it holds in the table (its bit on other producers'
        objects) and the bytes of its own objects there, loaned and committed (the daemon books
        none of these; proxied leases are in the registry's books)."""
        cols = self.table.columns
        holders = self.table.holders.copy()  # one read: the words keep changing under us
        live = np.flatnonzero(holders)
        if not live.size or not self._bits:
            return {session_id: SessionHoldings(0, 0, 0) for session_id in self._bits}
        words, owners = holders[live], cols["owner"][live]
        nbytes, loaned = self._bounded_sizes(live), cols["state"][live] == LOANED
        holdings = {}
        for session_id, bit in self._bits.items():
            held = (words & np.uint64(1 << bit)) != 0
            own = held & (owners == bit)
            holdings[session_id] = SessionHoldings(int((held & ~own).sum()), int(nbytes[own & loaned].sum()),
                                                   int(nbytes[own & ~loaned].sum()))
        return holdings

    def own_objects(self, session_id: str) -> OwnObjects:
        """The live session's own objects in the table (a full arena's error tells their producer):
        only its grants' slots are read, as a refusal is answered again at every poll of a wait."""
        bit = self._bits.get(session_id)
        if bit is None:
            return OwnObjects()
        cols = self.table.columns
        slots = [np.arange(g.first_slot, g.first_slot + g.nslots) for g in self._grants.values()
                 if g.session_id == session_id]
        if not slots:
            return OwnObjects()
        grants = np.concatenate(slots)
        held = (self.table.holders[grants] & np.uint64(1 << bit)) != 0
        own = grants[held & (cols["owner"][grants] == bit)]
        nbytes, loaned = self._bounded_sizes(own), cols["state"][own] == LOANED
        return OwnObjects(int(loaned.sum()), int(nbytes[loaned].sum()), int((~loaned).sum()),
                          int(nbytes[~loaned].sum()))

    _STATE_NAMES = {FREE: "free", LOANED: "loaned", COMMITTED: "committed", HELD: "held"}

    def list_objects(self, daemon_side: Mapping[int, DaemonSide]) -> list[pb.ObjectInfo]:
        """Every live object in the table, with its producer's and holders' sessions (one holder
        entry per session bit, and per lease the daemon holds: ``daemon_side``, by slot). Age is
        known for committed objects: their deadline is the commit time plus the hand-off window."""
        cols = self.table.columns
        holders = self.table.holders.copy()  # one read: the words keep changing under us
        session_of = {bit: session_id for session_id, bit in self._bits.items()}
        now_ns, window_ns = time.monotonic_ns(), self.handoff_window_ms * 1_000_000
        infos = []
        for index in np.flatnonzero(holders).tolist():
            word, generation = int(holders[index]), int(cols["generation"][index])
            state, owner_bit = int(cols["state"][index]), int(cols["owner"][index])
            if not 0 <= owner_bit < SESSION_BITS:  # its producer wrote nonsense: no owner (no work sized by it)
                owner_bit = SESSION_BITS
            bits = word & ((1 << SESSION_BITS) - 1) & ~(1 << owner_bit)
            sessions = []
            while bits:
                low = bits & -bits
                sessions.append(session_of.get(low.bit_length() - 1, ""))
                bits ^= low
            age_s = (now_ns - int(cols["deadline_ns"][index]) + window_ns) / 1e9 if state == COMMITTED else -1.0
            info = pb.ObjectInfo(
                offset=int(cols["offset"][index]), nbytes=int(self._placed_nbytes[index]) or int(cols["nbytes"][index]),
                generation=generation,
                slot=wire_slot(index), state=self._STATE_NAMES.get(state, str(state)), handoff=bool(word & HANDOFF),
                owner_session=session_of.get(owner_bit, ""), age_s=age_s,
                producer_held=owner_bit < SESSION_BITS and bool(word >> owner_bit & 1))
            daemon = daemon_side.get(index)
            if daemon is not None:
                sessions += daemon.holder_sessions
                info.quarantined_leases = daemon.quarantined_leases
                if daemon.owner_session is not None:  # an object the daemon placed for a client
                    info.owner_session, info.producer_held = daemon.owner_session, daemon.producer_held
                    info.segment_name, info.age_s = daemon.segment_name, daemon.age_s
                    if daemon.segment_name:
                        info.offset = 0
            info.holder_sessions.extend(sessions)
            infos.append(info)
        return infos

    def close(self) -> None:
        """Unmap the table (the daemon stops); its segments are unlinked by their owner."""
        self.table.close()
        for mapping in self._maps:
            mapping.close()
