"""One tenant's objects that the daemon keeps itself (the RPC path): arena allocations of clients
that do not place objects in the object table, and dedicated segments. Beside ``objects.ObjectBook``
(the table), the other book of a tenant's ``Registry``, which calls every method under its lock.

Lifetime (``docs/design.md``, lifetime rules): a producer loans an ``Allocation`` (owned by its
session, writable, not visible), commits it (sealed; consumers may lease it), and releases its
reference. Bytes go back when no producer reference, no lease and no hold remain. A lease that
outlives its TTL while its session is alive is *quarantined*, not freed: the client may still hold a
view of the bytes, so they are never reused under it; it is reported (log, Stat) and its bytes are
freed when it is released or its session dies.

Handles are checked against the allocation that lives at their offset now: same segment, offset,
size and generation, or the call is refused. Generations are never reused, so a handle to freed or
re-allocated bytes is always detected (no ABA).
"""
from __future__ import annotations

import collections
import hmac
import itertools
import logging
import secrets
import threading
import time
from typing import Callable, Sequence

from ..errors import HandleError, InvalidArgument, OwnershipError, Reason, StateError
from ..v1 import daemon_pb2 as pb
from .deadlines import Deadline, Deadlines
from .dedicated import DedicatedSegments
from .records import Allocation, LeaseRecord, ObjState, Session
from .segments import Segment
from .waiting import CommitWaiters, WaitingCalls

_log = logging.getLogger("shmtransport.daemon")

# Bytes went back: an arena offset to give to the allocator, or None for a dedicated segment's
# (unlinked already); either way, calls waiting for room are woken.
BytesFreed = Callable[[int | None], None]


class AllocationBook:
    """The daemon's own objects of one tenant: allocations, their leases, holds and TTLs."""

    def __init__(self, instance_id: str, segment_name: str, sessions: dict[str, Session],
                 dedicated: DedicatedSegments, counters: collections.Counter[str], bytes_freed: BytesFreed,
                 waiting: WaitingCalls, check_handle: Callable[[pb.Handle], None]) -> None:
        """``sessions``, ``counters`` and ``waiting``: the registry's (shared, not copied);
        ``bytes_freed``: how freed bytes go back to the tenant; ``check_handle``: the registry's
        checks of a handle's instance, tenant and arena bounds, run before it is looked up here."""
        self.instance_id = instance_id
        self.segment_name = segment_name
        self.dedicated = dedicated
        self._sessions = sessions
        self._counters = counters
        self._bytes_freed = bytes_freed
        self._waiting = waiting
        self._check_handle = check_handle
        self._objects: dict[int, Allocation] = {}  # Allocation.key -> allocation
        self._leases: dict[int, LeaseRecord] = {}
        self._quarantined: dict[int, int] = {}  # lease id -> bytes, leases past their TTL
        self._deadlines = Deadlines()
        self._commit_waiters = CommitWaiters()
        self.next_generation = 1
        self._next_lease_id = 1

    # -- counts ----------------------------------------------------------------------------------
    @property
    def live_objects(self) -> int:
        """Objects booked now."""
        return len(self._objects)

    @property
    def live_leases(self) -> int:
        """Leases booked now."""
        return len(self._leases)

    @property
    def quarantined(self) -> tuple[int, int]:
        """Leases past their TTL whose bytes are kept, and those bytes."""
        return len(self._quarantined), sum(self._quarantined.values())

    def new_lease_id(self) -> int:
        """A lease id never handed out before (the table's proxy leases take theirs here too)."""
        lease_id = self._next_lease_id
        self._next_lease_id += 1
        return lease_id

    def was_lease_id(self, lease_id: int) -> bool:
        """Whether ``lease_id`` was handed out (it may be gone since)."""
        return 0 < lease_id < self._next_lease_id

    # -- loans -----------------------------------------------------------------------------------
    def take_generations(self, count: int) -> int:
        """The first of ``count`` new generations."""
        first = self.next_generation
        self.next_generation += count
        return first

    def add_arena_loans(self, session: Session, offsets: Sequence[int], sizes: Sequence[int],
                        response: pb.LoanResponse) -> None:
        """New allocations at ``offsets``, ``session``'s loans, named in ``response``."""
        for offset, nbytes in zip(offsets, sizes):
            obj = Allocation(offset, nbytes, self.take_generations(1), session.session_id,
                             commit_token=secrets.token_bytes(16))
            self._add_loan(session, obj, response)

    def add_dedicated_loans(self, session: Session, first_generation: int, sizes: Sequence[int],
                            segments: Sequence[Segment], response: pb.LoanResponse) -> None:
        """Created dedicated segments as ``session``'s loans (generations from ``first_generation``)."""
        for i, (nbytes, seg) in enumerate(zip(sizes, segments)):
            gen = first_generation + i
            obj = Allocation(-gen, nbytes, gen, session.session_id, commit_token=secrets.token_bytes(16),
                             segment=seg)
            self.dedicated.add(seg.name, -gen)
            self._add_loan(session, obj, response)

    def _add_loan(self, session: Session, obj: Allocation, response: pb.LoanResponse) -> None:
        self._objects[obj.key] = obj
        session.producer_refs.add(obj.key)
        session.loaned_nbytes += obj.nbytes
        # Built in place in the response: a Handle built first would be copied into it again.
        name = obj.segment.name if obj.segment is not None else self.segment_name
        response.handles.add(name=name, offset=obj.offset, nbytes=obj.nbytes, owner_id=obj.owner,
                             generation=obj.generation, instance_id=self.instance_id)
        response.commit_tokens.append(obj.commit_token)

    def dedicated_segments(self) -> list[Segment]:
        """Every live dedicated segment."""
        return [seg for key in self.dedicated.keys() if (seg := self._objects[key].segment) is not None]

    # -- commit ----------------------------------------------------------------------------------
    def commit(self, session_id: str, handles: Sequence[pb.Handle], hold_ms: int, handoff_window_ms: int) -> None:
        """Seal the session's loans (all or none): each is handed off (``hold_ms`` 0: for the
        hand-off window, until the first acquire), or held for ``hold_ms``."""
        objs = [self.resolve(h) for h in handles]
        for obj in objs:
            if obj.owner != session_id or not obj.producer_ref:
                raise OwnershipError(f"commit of an object this session does not hold (offset {obj.offset})")
            if obj.state is not ObjState.LOANED:
                raise StateError(f"object at offset {obj.offset} is already committed")
        if len({obj.key for obj in objs}) != len(objs):
            raise InvalidArgument("the same handle appears twice in one commit")
        # Without a hold, the hand-off window: the object outlives its producer until the first
        # acquire (or the window passes), so "commit, send the handle, close" works.
        handoff = not hold_ms
        until = time.monotonic() + (handoff_window_ms if handoff else hold_ms) / 1000
        for obj in objs:
            self._mark_committed(obj)
            obj.hold_until, obj.handoff = until, handoff
            self._deadlines.add(until, Deadline.HOLD, obj.key)

    def _mark_committed(self, obj: Allocation) -> None:
        obj.state = ObjState.COMMITTED
        self._commit_waiters.wake(obj.key)
        # The producer's reference now counts as committed bytes (by Commit, or by handoff in a
        # consumer's Acquire: then the producer is another session than the caller).
        owner = self._sessions.get(obj.owner) if obj.producer_ref else None
        if owner is not None:
            owner.loaned_nbytes -= obj.nbytes
            owner.committed_nbytes += obj.nbytes

    # -- leases ----------------------------------------------------------------------------------
    def wait_committed(self, handles: list[pb.Handle], commit_tokens: Sequence[bytes], commit_wait_s: float,
                       lock: threading.Lock) -> list[Allocation]:
        """The allocations the handles name, once all are committed: by their token here, or by
        their producer's Commit within ``commit_wait_s`` (``lock`` held, released while waiting)."""
        deadline = None  # the clock is read only when a commit is still missing
        while True:
            objs = [self.resolve(h) for h in handles]
            for obj, token in zip(objs, commit_tokens):
                if token and obj.state is ObjState.LOANED:
                    if not hmac.compare_digest(token, obj.commit_token):
                        raise HandleError(f"commit token does not match the loan at offset {obj.offset}")
                    self._mark_committed(obj)
            pending = [obj for obj in objs if obj.state is not ObjState.COMMITTED]
            if not pending:
                return objs
            if deadline is None:
                deadline = time.monotonic() + commit_wait_s
            remaining = deadline - time.monotonic()
            if remaining <= 0:
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

    def lease(self, session: Session, obj: Allocation, expires_at: float) -> int:
        """A new lease of ``session`` on the committed ``obj``, until ``expires_at``; its id."""
        lease = LeaseRecord(self.new_lease_id(), obj.key, obj.generation, session.session_id, expires_at)
        self._leases[lease.lease_id] = lease
        obj.leases.add(lease.lease_id)
        if obj.handoff:  # the first acquire takes the hand-off over
            obj.hold_until, obj.handoff = 0.0, False
        session.leases.add(lease.lease_id)
        self._deadlines.add(expires_at, Deadline.LEASE, lease.lease_id)
        return lease.lease_id

    def lease_record(self, lease_id: int) -> LeaseRecord | None:
        """The booked lease ``lease_id``, if it lives."""
        return self._leases.get(lease_id)

    # -- release ---------------------------------------------------------------------------------
    def owned_for_release(self, session_id: str, handles: Sequence[pb.Handle]) -> list[Allocation]:
        """The allocations ``session_id`` releases its producer reference to; refused (typed) when
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
        if obj.handoff:
            obj.hold_until, obj.handoff = 0.0, False
        self.drop_producer_ref(obj, session)

    def still_held(self, session: Session, handles: list[pb.Handle]) -> list[pb.Handle]:
        """Those of ``handles`` whose allocation ``session`` still holds a reference to."""
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
        """Leases past their TTL are reclaimed (quarantined while a local holder lives), holds
        and hand-off windows past their deadline end."""
        for kind, key in self._deadlines.due(now):
            if kind is Deadline.LEASE:
                lease = self._leases.get(key)
                if lease is None or lease.quarantined or lease.expires_at > now:
                    continue
                session = self._sessions.get(lease.session_id)
                if session is not None and session.quarantine_expired:
                    self._quarantine(lease, session)
                else:
                    self._counters["reclaimed_ttl_leases"] += 1
                    self._counters["reclaimed_ttl_nbytes"] += self.drop_lease(lease, session)
            else:
                obj = self._objects.get(key)
                if obj is not None and obj.hold_until and obj.hold_until <= now:
                    obj.hold_until = 0.0
                    freed = self._maybe_free(obj)
                    if freed and obj.handoff:
                        self._counters["reclaimed_handoff_objects"] += 1
                        self._counters["reclaimed_handoff_nbytes"] += freed
        live_leases = ((lease.expires_at, Deadline.LEASE, lease.lease_id)
                       for lease in self._leases.values() if not lease.quarantined)
        live_holds = ((o.hold_until, Deadline.HOLD, key) for key, o in self._objects.items() if o.hold_until)
        self._deadlines.compact(len(self._leases) + len(self._objects), itertools.chain(live_leases, live_holds))

    def _quarantine(self, lease: LeaseRecord, session: Session) -> None:
        """A lease past its TTL whose holder lives: keep its bytes (a view may still read them)."""
        lease.quarantined = True
        nbytes = self._objects[lease.key].nbytes
        self._quarantined[lease.lease_id] = nbytes
        self._counters["quarantined_leases_total"] += 1
        _log.warning(
            "lease %d (%d bytes) of session %s (pid %d) outlived its TTL: its bytes stay quarantined "
            "until it is released or the process exits", lease.lease_id, nbytes, session.session_id, session.pid,
        )

    # -- introspection ---------------------------------------------------------------------------
    def infos(self, now: float) -> list[pb.ObjectInfo]:
        """``List``'s entry of every object (owner and holders by session id)."""
        infos = []
        for obj in self._objects.values():
            leases = [self._leases[i] for i in sorted(obj.leases) if i in self._leases]
            infos.append(pb.ObjectInfo(
                offset=obj.offset, nbytes=obj.nbytes,
                generation=obj.generation,
                state="held" if obj.hold_until and not obj.handoff else obj.state.value, handoff=obj.handoff,
                owner_session=obj.owner,
                holder_sessions=[lease.session_id for lease in leases],
                age_s=now - obj.created_at, segment_name=obj.segment.name if obj.segment is not None else "",
                producer_held=obj.producer_ref, quarantined_leases=sum(lease.quarantined for lease in leases)))
        return infos

    # -- handles ---------------------------------------------------------------------------------
    def key(self, h: pb.Handle) -> int | None:
        """The key a handle names: its arena offset, or a dedicated segment's key."""
        if h.name == self.segment_name:
            return h.offset
        return self.dedicated.key_of(h.name)

    def resolve(self, h: pb.Handle) -> Allocation:
        """The live allocation a handle names, or a typed refusal. Never trusts any field alone."""
        self._check_handle(h)
        if h.name != self.segment_name:
            return self._resolve_dedicated(h)
        obj = self._objects.get(h.offset)
        if obj is None or obj.generation != h.generation:
            if 0 < h.generation < self.next_generation:
                raise HandleError(
                    f"stale handle: the bytes at offset {h.offset} (generation {h.generation}) were freed or reused",
                    Reason.STALE_HANDLE,
                )
            raise HandleError(f"no allocation with generation {h.generation} at offset {h.offset}")
        if obj.nbytes != h.nbytes:
            raise HandleError(
                f"handle nbytes {h.nbytes} does not match the allocation ({obj.nbytes})", Reason.OUT_OF_BOUNDS
            )
        return obj

    def _resolve_dedicated(self, h: pb.Handle) -> Allocation:
        key = self.dedicated.key_of(h.name)
        if key is None:
            if self.dedicated.is_stale(h.name, self.next_generation):
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
    def drop_producer_ref(self, obj: Allocation, session: Session | None) -> int:
        """The producer's reference goes; the bytes freed (0 if still held)."""
        obj.producer_ref = False
        if session is not None:
            session.producer_refs.discard(obj.key)
            if obj.state is ObjState.LOANED:
                session.loaned_nbytes -= obj.nbytes
            else:
                session.committed_nbytes -= obj.nbytes
        return self._maybe_free(obj)

    def drop_lease(self, lease: LeaseRecord, session: Session | None) -> int:
        """The lease goes; the bytes freed (0 if still held)."""
        del self._leases[lease.lease_id]
        self._quarantined.pop(lease.lease_id, None)
        if session is not None:
            session.leases.discard(lease.lease_id)
        obj = self._objects[lease.key]
        obj.leases.discard(lease.lease_id)
        return self._maybe_free(obj)

    def _maybe_free(self, obj: Allocation) -> int:
        """Free the bytes if nothing holds them any more; the number of bytes freed (0 if kept)."""
        if obj.producer_ref or obj.leases or obj.hold_until:
            return 0
        del self._objects[obj.key]
        self._commit_waiters.wake(obj.key)  # an Acquire waiting for this loan's commit fails now, not at its deadline
        if obj.segment is not None:
            self.dedicated.freed(obj.segment, obj.nbytes)
            self._bytes_freed(None)
        else:
            self._bytes_freed(obj.offset)
        return obj.nbytes
