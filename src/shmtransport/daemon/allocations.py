"""The daemon's references to one tenant's objects, for the clients that cannot keep them in the
object table themselves (the pure-Python backend, sessions without a holder bit, the remote tier,
dedicated segments): the daemon "operates the table" for them. Beside ``objects.ObjectBook`` (the
table), the other book of a tenant's ``Registry``, which calls every method under its lock.

Every object lives in the table; the table alone says what an object is and whether it lives
(generation, state, hand-off window or hold, holders). This book only adds what the daemon holds
there with its proxy bit, and why:
- the producer's reference to each object the daemon placed for a client (``Loan``: an arena
  allocation or a dedicated segment, in a slot of its own), from loan until released;
- each lease the daemon holds for a consumer, with its TTL (a lease past its TTL whose session
  lives is *quarantined*, not freed: the client may still hold a view; its bytes are kept until it
  is released or its session dies).
The proxy bit holds an object while a reference to it is booked here. When the last one goes, the
bit goes; an object the daemon placed that nobody else holds then dies and its slot and bytes go
back at once; one still held in the table (a hand-off window, a consumer's bit) *lingers* here
until the janitor sees it die (``reclaim_dead``).

Handles are checked against the table: slot, generation, offset and size, or the call is refused.
Generations only grow, so a handle to freed or reused bytes is always detected (no ABA).
"""
from __future__ import annotations

import collections
import hmac
import logging
import secrets
import threading
import time
from typing import Callable, Sequence

from ..errors import HandleError, InvalidArgument, OwnershipError, Reason, StateError
from ..objtable import HELD, OUTSIDE_ARENA, PROXY_BIT, SlotStatus, raise_for, wire_slot
from ..v1 import daemon_pb2 as pb
from .deadlines import Deadlines
from .dedicated import DedicatedSegments
from .objects import DaemonSide, ObjectBook
from .records import Allocation, LeaseRecord, ObjState, OwnObjects, Session
from .segments import Segment
from .waiting import CommitWaiters, WaitingCalls

_log = logging.getLogger("shmtransport.daemon")
_FOREVER_NS = (1 << 64) - 1  # "now" for ending a hand-off window whatever its deadline

# Bytes went back: an arena offset to give to the allocator, or None for a dedicated segment's
# (unlinked already); either way, calls waiting for room are woken.
BytesFreed = Callable[[int | None], None]


class AllocationBook:
    """The daemon's references to one tenant's objects: producers' references, leases and TTLs."""

    def __init__(self, instance_id: str, segment_name: str, sessions: dict[str, Session], table: ObjectBook,
                 dedicated: DedicatedSegments, counters: collections.Counter[str], bytes_freed: BytesFreed,
                 waiting: WaitingCalls, check_handle: Callable[[pb.Handle], None]) -> None:
        """``sessions``, ``counters`` and ``waiting``: the registry's (shared, not copied);
        ``table``: the tenant's object table; ``bytes_freed``: how freed bytes go back to the
        tenant; ``check_handle``: the registry's checks of a handle's instance, tenant and arena
        bounds, run before it is looked up here."""
        self.instance_id = instance_id
        self.segment_name = segment_name
        self.table = table
        self.dedicated = dedicated
        self._sessions = sessions
        self._counters = counters
        self._bytes_freed = bytes_freed
        self._waiting = waiting
        self._check_handle = check_handle
        self._objects: dict[int, Allocation] = {}  # Allocation.key -> allocation
        self._lingering: set[int] = set()  # keys of placed objects no reference here holds
        self._leases: dict[int, LeaseRecord] = {}
        self._quarantined: dict[int, int] = {}  # lease id -> bytes, leases past their TTL
        self._deadlines = Deadlines()
        self._commit_waiters = CommitWaiters()
        self.next_serial = 1  # names dedicated segments, never reused
        self._next_lease_id = 1

    # -- counts ----------------------------------------------------------------------------------
    @property
    def live_leases(self) -> int:
        """Leases booked now."""
        return len(self._leases)

    @property
    def quarantined(self) -> tuple[int, int]:
        """Leases past their TTL whose bytes are kept, and those bytes."""
        return len(self._quarantined), sum(self._quarantined.values())

    def proxied_slots(self) -> set[int]:
        """The slots the proxy bit holds for a reference booked here."""
        return {obj.slot for obj in self._objects.values() if obj.referenced}

    def was_lease_id(self, lease_id: int) -> bool:
        """Whether ``lease_id`` was handed out (it may be gone since)."""
        return 0 < lease_id < self._next_lease_id

    # -- loans -----------------------------------------------------------------------------------
    def take_serials(self, count: int) -> int:
        """The first of ``count`` new serials (the names of dedicated segments)."""
        first = self.next_serial
        self.next_serial += count
        return first

    def add_arena_loans(self, session: Session, offsets: Sequence[int], sizes: Sequence[int],
                        response: pb.LoanResponse) -> None:
        """New objects at ``offsets`` placed in the table (all or none: ResourceExhausted
        TABLE_FULL when it has too few free slots), ``session``'s loans, named in ``response``."""
        for (offset, nbytes), (slot, generation) in zip(zip(offsets, sizes), self._place(offsets, sizes)):
            obj = Allocation(offset, nbytes, generation, session.session_id, slot,
                             commit_token=secrets.token_bytes(16))
            self._add_loan(session, obj, response)

    def add_dedicated_loans(self, session: Session, first_serial: int, sizes: Sequence[int],
                            segments: Sequence[Segment], response: pb.LoanResponse) -> None:
        """Created dedicated segments placed in the table (all or none) as ``session``'s loans."""
        places = self._place([OUTSIDE_ARENA] * len(sizes), sizes)
        for i, (nbytes, seg, (slot, generation)) in enumerate(zip(sizes, segments, places)):
            key = -(first_serial + i)
            obj = Allocation(key, nbytes, generation, session.session_id, slot,
                             commit_token=secrets.token_bytes(16), segment=seg)
            self.dedicated.add(seg.name, key)
            self._add_loan(session, obj, response)

    def _place(self, offsets: Sequence[int], sizes: Sequence[int]) -> list[tuple[int, int]]:
        placed: list[tuple[int, int]] = []
        try:
            for offset, nbytes in zip(offsets, sizes):
                placed.append(self.table.place(offset, nbytes))
        except BaseException:
            for slot, generation in placed:
                self.table.table.release(slot, generation, PROXY_BIT)
                # A loan never handed out; a bit a client wrote there meanwhile keeps the slot
                # (its tenant's loss), never the bytes: nobody can acquire a loan.
                self.table.unplace(slot)
            raise
        return placed

    def _add_loan(self, session: Session, obj: Allocation, response: pb.LoanResponse) -> None:
        self._objects[obj.key] = obj
        session.producer_refs.add(obj.key)
        session.loaned_nbytes += obj.nbytes
        # Built in place in the response: a Handle built first would be copied into it again.
        name = obj.segment.name if obj.segment is not None else self.segment_name
        response.handles.add(name=name, offset=obj.offset, nbytes=obj.nbytes, owner_id=obj.owner,
                             generation=obj.generation, instance_id=self.instance_id, slot=wire_slot(obj.slot))
        response.commit_tokens.append(obj.commit_token)

    def dedicated_segments(self) -> list[Segment]:
        """Every live dedicated segment."""
        return [seg for key in self.dedicated.keys() if (seg := self._objects[key].segment) is not None]

    # -- commit ----------------------------------------------------------------------------------
    def commit(self, session: Session, handles: Sequence[pb.Handle], hold_ms: int, handoff_window_ms: int,
               release_reference: bool = False) -> None:
        """Seal the session's loans (all or none): each is handed off (``hold_ms`` 0: for the
        hand-off window, until the first acquire), or held for ``hold_ms``. ``release_reference``:
        the session keeps no reference (as at its close, the hand-off or hold goes on)."""
        session_id = session.session_id
        objs = [self.resolve(h) for h in handles]
        for obj in objs:
            if obj.owner != session_id or not obj.producer_ref:
                raise OwnershipError(f"commit of an object this session does not hold (offset {obj.offset})")
            if obj.state is not ObjState.LOANED:
                raise StateError(f"object at offset {obj.offset} is already committed")
        if len({obj.key for obj in objs}) != len(objs):
            raise InvalidArgument("the same handle appears twice in one commit")
        for obj in objs:
            self._commit(obj, hold_ms or handoff_window_ms, hold=bool(hold_ms))
            if release_reference:
                self.drop_producer_ref(obj, session)

    def _commit(self, obj: Allocation, window_ms: int, hold: bool) -> None:
        """Seal ``obj`` in the table: without a hold, the hand-off window (the object outlives its
        producer until the first acquire, or the window passes, so "commit, send the handle,
        close" works); with one, until ``window_ms`` passes whatever acquires it."""
        self.table.table.commit(obj.slot, obj.generation, PROXY_BIT, time.monotonic_ns() + window_ms * 1_000_000,
                                hold)
        obj.state, obj.held = ObjState.COMMITTED, hold
        self._commit_waiters.wake(obj.key)
        # The producer's reference now counts as committed bytes (by Commit, or by handoff in a
        # consumer's Acquire: then the producer is another session than the caller).
        owner = self._sessions.get(obj.owner) if obj.producer_ref else None
        if owner is not None:
            owner.loaned_nbytes -= obj.nbytes
            owner.committed_nbytes += obj.nbytes

    # -- leases ----------------------------------------------------------------------------------
    def wait_committed(self, handles: list[pb.Handle], commit_tokens: Sequence[bytes], commit_wait_s: float,
                       handoff_window_ms: int, lock: threading.Lock) -> list[Allocation | None]:
        """What the handles name once every loan among them the daemon placed is committed: by
        its token here, or by its producer's Commit within ``commit_wait_s`` (``lock`` held,
        released while waiting). None for a table producer's object (the table answers for it)."""
        deadline = None  # the clock is read only when a commit is still missing
        while True:
            objs = [self.find(h) for h in handles]
            for obj, token in zip(objs, commit_tokens):
                if token and obj is not None and obj.state is ObjState.LOANED and obj.producer_ref:
                    if not hmac.compare_digest(token, obj.commit_token):
                        raise HandleError(f"commit token does not match the loan at offset {obj.offset}")
                    self._commit(obj, handoff_window_ms, hold=False)
            pending = [obj for obj in objs if obj is not None and obj.state is ObjState.LOANED]
            if not pending:
                return objs
            if deadline is None:
                deadline = time.monotonic() + commit_wait_s
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not all(obj.producer_ref for obj in pending):
                raise StateError(f"object at offset {pending[0].offset} is not committed")
            keys = [obj.key for obj in pending]
            woken = self._commit_waiters.register(keys)
            lock.release()
            try:
                with self._waiting.waiting():
                    woken.wait(remaining)
            finally:
                lock.acquire()
                self._commit_waiters.forget(woken, keys)

    def lease_all(self, session: Session, handles: Sequence[pb.Handle], objs: Sequence[Allocation | None],
                  expires_at: float) -> list[int]:
        """A lease of ``session`` on each committed object (``objs``: ``wait_committed``'s), until
        ``expires_at``; all or none. Their ids."""
        taken: list[LeaseRecord] = []
        try:
            for h, obj in zip(handles, objs):
                # A table producer's object named twice in one call has a record after its first.
                obj = obj or self.find(h) or self._adopt(h)
                self._hold(obj)
                taken.append(self._lease(session, obj, expires_at))
        except BaseException:
            for lease in taken:
                self.drop_lease(lease, session)
            raise
        return [lease.lease_id for lease in taken]

    def _adopt(self, h: pb.Handle) -> Allocation:
        """A record of the table producer's object ``h`` names, so a lease can be booked on it;
        booked once ``_hold`` took it with the proxy bit."""
        slot = self.table.slot_of(h)
        held = int(self.table.table.columns["state"][slot]) == HELD  # its producer's word: only its tenant's
        return Allocation(h.offset, h.nbytes, h.generation, "", slot, ObjState.COMMITTED, producer_ref=False,
                          placed=False, held=held)

    def _hold(self, obj: Allocation) -> None:
        """Make sure the proxy bit holds ``obj`` for a new lease; the first acquire of a committed
        object ends its hand-off window (a hold stays)."""
        if obj.referenced:
            if obj.state is not ObjState.COMMITTED:
                raise StateError(f"object at offset {obj.offset} is not committed")
            if not obj.held:
                self.table.table.expire(obj.slot, _FOREVER_NS)
            return
        offset = OUTSIDE_ARENA if obj.segment is not None else obj.key
        if not obj.placed:  # its producer reuses its bytes once the holds say 0: pinned first
            self.table.table.pin(obj.slot, True)
        status = self.table.table.acquire(obj.slot, obj.generation, offset, obj.nbytes, PROXY_BIT)
        # ALREADY: a client of the tenant wrote the proxy bit in; from now on it is this lease's.
        if status not in (SlotStatus.OK, SlotStatus.ALREADY):
            if not obj.placed:
                self.table.table.pin(obj.slot, False)
            raise_for(status, obj.slot)
        self._lingering.discard(obj.key)
        self._objects.setdefault(obj.key, obj)  # a table producer's object is booked from now on

    def _lease(self, session: Session, obj: Allocation, expires_at: float) -> LeaseRecord:
        lease = LeaseRecord(self._next_lease_id, obj.key, obj.generation, session.session_id, expires_at)
        self._next_lease_id += 1
        self._leases[lease.lease_id] = lease
        obj.leases.add(lease.lease_id)
        session.leases.add(lease.lease_id)
        self._deadlines.add(expires_at, lease.lease_id)
        return lease

    def lease_record(self, lease_id: int) -> LeaseRecord | None:
        """The booked lease ``lease_id``, if it lives."""
        return self._leases.get(lease_id)

    # -- the identity index's references -------------------------------------------------------
    def index_hold(self, session: Session, h: pb.Handle) -> Allocation:
        """Book the identity index's reference to ``session``'s committed object ``h`` names,
        holding it with the proxy bit (which ends its hand-off window: the index took it over)."""
        obj = self.find(h)
        if obj is None or not obj.placed:  # a table producer's: the session of the slot's owner bit placed it
            bit = self.table.bit_of(session.session_id)
            if bit is None or int(self.table.table.columns["owner"][self.table.slot_of(h)]) != bit:
                raise OwnershipError(f"publish of an object this session did not place (slot {h.slot})")
            obj = obj or self._adopt(h)
        elif obj.owner != session.session_id or not obj.producer_ref:
            raise OwnershipError(f"publish of an object this session does not hold (offset {obj.offset})")
        if obj.indexed:
            raise StateError(f"object at offset {obj.offset} is already published under another identity")
        if obj.placed and obj.state is not ObjState.COMMITTED:
            raise StateError(f"object at offset {obj.offset} is not committed: commit it before publishing")
        self._hold(obj)  # a table object's state is checked there (the table refuses a loan)
        obj.indexed = True
        return obj

    def index_release(self, obj: Allocation) -> None:
        """The identity index dropped its entry: its reference goes (the object dies with it when
        nobody else holds it)."""
        obj.indexed = False
        self._unreference(obj, end_handoff=False)

    def only_indexed(self, obj: Allocation) -> bool:
        """Whether the index's reference is all that holds ``obj`` (no producer reference, no lease,
        no bit of any session or hand-off in the table): it may be evicted."""
        return not obj.producer_ref and not obj.leases and int(self.table.table.holders[obj.slot]) == 1 << PROXY_BIT

    def still_indexed(self, obj: Allocation) -> bool:
        """Whether the object the index booked is still the one in its slot, held by the proxy bit."""
        return self._objects.get(obj.key) is obj and self.table.generation(obj.slot) == obj.generation and \
            bool(int(self.table.table.holders[obj.slot]) >> PROXY_BIT & 1)

    # -- release ---------------------------------------------------------------------------------
    def owned_for_release(self, session_id: str, handles: Sequence[pb.Handle]) -> list[Allocation]:
        """The objects ``session_id`` releases its producer reference to; refused (typed) when
        one is not its own or already released."""
        objs = [self.resolve(h) for h in handles]
        for obj in objs:
            if obj.owner != session_id:
                raise OwnershipError(f"release of another client's object (offset {obj.offset})")
            if not obj.producer_ref:
                raise StateError(f"object at offset {obj.offset} already released", Reason.DOUBLE_RELEASE)
        return objs

    def release_producer_ref(self, obj: Allocation, session: Session) -> None:
        """An explicit release: it also ends the hand-off (a session's end keeps it)."""
        self.drop_producer_ref(obj, session, end_handoff=True)

    def own_objects(self, session: Session) -> OwnObjects:
        """The objects the daemon placed for ``session`` that it still holds a reference to."""
        objs = [self._objects[key] for key in session.producer_refs]
        loans = [obj for obj in objs if obj.state is ObjState.LOANED]
        return OwnObjects(len(loans), session.loaned_nbytes, len(objs) - len(loans), session.committed_nbytes)

    def still_held(self, session: Session, handles: list[pb.Handle]) -> list[pb.Handle]:
        """Those of ``handles`` whose object ``session`` still holds a reference to."""
        held = []
        for h in handles:
            key = self.key(h) if h.instance_id == self.instance_id else None
            if key in session.producer_refs and self._objects[key].generation == h.generation:
                held.append(h)
        return held

    def close_session(self, session: Session) -> tuple[int, int, int]:
        """Drop everything ``session`` held: its (leases, loans never committed, bytes freed)."""
        leases = loans = nbytes = 0
        for lease_id in list(session.leases):
            lease = self._leases.get(lease_id)
            if lease is not None:
                leases += 1
                nbytes += self.drop_lease(lease, session)
        for key in list(session.producer_refs):
            obj = self._objects[key]
            loans += obj.state is ObjState.LOANED  # a reference to a committed object is neither
            nbytes += self.drop_producer_ref(obj, session)
        return leases, loans, nbytes

    # -- deadlines -------------------------------------------------------------------------------
    def expire(self, now: float) -> None:
        """Leases past their TTL are reclaimed (quarantined while a local holder lives). Hand-off
        windows and holds are the table's (``ObjectBook.expire_handoffs``)."""
        for lease_id in self._deadlines.due(now):
            lease = self._leases.get(lease_id)
            if lease is None or lease_id in self._quarantined or lease.expires_at > now:
                continue
            session = self._sessions.get(lease.session_id)
            if session is not None and session.quarantine_expired:
                self._quarantine(lease, session)
            else:
                self._counters["reclaimed_ttl_leases"] += 1
                self._counters["reclaimed_ttl_nbytes"] += self.drop_lease(lease, session)
        live = ((lease.expires_at, lease.lease_id)
                for lease in self._leases.values() if lease.lease_id not in self._quarantined)
        self._deadlines.compact(len(self._leases), live)

    def reclaim_dead(self) -> int:
        """Free the objects the daemon placed that died in the table since it dropped its last
        reference (a consumer's release there, a hand-off window's end); the bytes returned."""
        lingering = [self._objects[key] for key in self._lingering]
        dead = set(self.table.dead([obj.slot for obj in lingering]))
        return sum(self._free(obj) for obj in lingering if obj.slot in dead)

    def _quarantine(self, lease: LeaseRecord, session: Session) -> None:
        """A lease past its TTL whose holder lives: keep its bytes (a view may still read them)."""
        nbytes = self._objects[lease.key].nbytes
        self._quarantined[lease.lease_id] = nbytes
        self._counters["quarantined_leases_total"] += 1
        _log.warning(
            "lease %d (%d bytes) of session %s (pid %d) outlived its TTL: its bytes stay quarantined "
            "until it is released or the process exits", lease.lease_id, nbytes, session.session_id, session.pid,
        )

    # -- introspection ---------------------------------------------------------------------------
    def daemon_side(self, now: float) -> dict[int, DaemonSide]:
        """What List adds to the table's entry of each object booked here, by slot."""
        side = {}
        for obj in self._objects.values():
            leases = [self._leases[i] for i in sorted(obj.leases)]
            side[obj.slot] = DaemonSide(
                owner_session=obj.owner if obj.placed else None,
                holder_sessions=[lease.session_id for lease in leases], producer_held=obj.producer_ref,
                segment_name=obj.segment.name if obj.segment is not None else "",
                quarantined_leases=sum(lease.lease_id in self._quarantined for lease in leases),
                age_s=now - obj.created_at)
        return side

    # -- handles ---------------------------------------------------------------------------------
    def key(self, h: pb.Handle) -> int | None:
        """The key a handle names: its arena offset, or a dedicated segment's key."""
        if h.name == self.segment_name:
            return h.offset
        return self.dedicated.key_of(h.name)

    def find(self, h: pb.Handle) -> Allocation | None:
        """The booked object a handle names; None for a live object a table producer placed that
        nothing here references; a typed refusal for anything else. Never trusts any field alone."""
        self._check_handle(h)
        slot = self.table.slot_of(h)
        obj = self._objects.get(h.offset) if h.name == self.segment_name else self._find_dedicated(h)
        if obj is not None and obj.slot == slot and obj.generation == h.generation:
            if obj.nbytes != h.nbytes:
                raise HandleError(f"handle nbytes {h.nbytes} does not match the object ({obj.nbytes})",
                                  Reason.OUT_OF_BOUNDS)
            return obj
        current = self.table.generation(slot)
        if not 0 < h.generation <= current:
            raise HandleError(f"no object with generation {h.generation} in slot {slot} (offset {h.offset})")
        if obj is not None or h.name != self.segment_name or h.generation != current or \
                not self.table.table.holders[slot]:
            raise HandleError(f"stale handle: the object of generation {h.generation} in slot {slot} "
                              f"(offset {h.offset}) was freed or reused", Reason.STALE_HANDLE)
        return None

    def resolve(self, h: pb.Handle) -> Allocation:
        """The object a handle names, which the daemon placed for a producer; a typed refusal
        for anything else."""
        obj = self.find(h)
        if obj is None or not obj.placed:
            raise OwnershipError(f"object slot {h.slot} holds an object a producer placed in the object table "
                                 "itself: only it commits and releases it, there")
        return obj

    def _find_dedicated(self, h: pb.Handle) -> Allocation:
        key = self.dedicated.key_of(h.name)
        if key is None:
            if self.dedicated.is_stale(h.name, self.next_serial):
                raise HandleError(f"stale handle: dedicated segment {h.name!r} was freed", Reason.STALE_HANDLE)
            raise HandleError(f"unknown segment {h.name!r}")
        obj = self._objects[key]
        if h.offset != 0 or h.nbytes != obj.nbytes:
            raise HandleError(f"handle [{h.offset}, +{h.nbytes}) does not match dedicated segment {h.name!r} "
                              f"({obj.nbytes} bytes at offset 0)", Reason.OUT_OF_BOUNDS)
        if obj.generation != h.generation:
            raise HandleError(f"stale handle: generation {h.generation} != {obj.generation}", Reason.STALE_HANDLE)
        return obj

    # -- dropping references ---------------------------------------------------------------------
    def drop_producer_ref(self, obj: Allocation, session: Session | None, end_handoff: bool = False) -> int:
        """The producer's reference goes (``end_handoff``: and the hand-off window with it); the
        bytes freed (0 if still held)."""
        obj.producer_ref = False
        if session is not None:
            session.producer_refs.discard(obj.key)
            if obj.state is ObjState.LOANED:
                session.loaned_nbytes -= obj.nbytes
            else:
                session.committed_nbytes -= obj.nbytes
        return self._unreference(obj, end_handoff)

    def drop_lease(self, lease: LeaseRecord, session: Session | None) -> int:
        """The lease goes; the bytes freed (0 if still held)."""
        del self._leases[lease.lease_id]
        self._quarantined.pop(lease.lease_id, None)
        if session is not None:
            session.leases.discard(lease.lease_id)
        obj = self._objects[lease.key]
        obj.leases.discard(lease.lease_id)
        return self._unreference(obj, end_handoff=False)

    def _unreference(self, obj: Allocation, end_handoff: bool) -> int:
        """After a reference went: with none left, the proxy bit goes; the bytes freed when that
        left nobody holding an object the daemon placed."""
        if obj.referenced:
            return 0
        try:
            remaining = self.table.table.release(obj.slot, obj.generation, PROXY_BIT, end_handoff and not obj.held)
        except StateError:  # a client of the tenant cleared the proxy bit: the table says what is left
            remaining = int(self.table.table.holders[obj.slot])
        if not obj.placed:
            self.table.table.pin(obj.slot, False)
            del self._objects[obj.key]  # a table producer's object: its bytes are its grant's
            return 0
        if remaining:
            self._lingering.add(obj.key)  # still held in the table: freed once it dies there
            return 0
        return self._free(obj)

    def _free(self, obj: Allocation) -> int:
        """An object the daemon placed died: its slot and bytes go back. The bytes freed."""
        if not self.table.unplace(obj.slot):  # a client wrote a bit into its dead word: wait for it to go
            self._lingering.add(obj.key)
            return 0
        del self._objects[obj.key]
        self._lingering.discard(obj.key)
        self._commit_waiters.wake(obj.key)  # an Acquire waiting for this loan's commit fails now, not at its deadline
        if obj.segment is not None:
            self.dedicated.freed(obj.segment, obj.nbytes)
            self._bytes_freed(None)
        else:
            self._bytes_freed(obj.offset)
        return obj.nbytes
