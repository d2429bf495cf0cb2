"""One tenant's book of who holds which bytes: allocations, leases, sessions, TTLs and quotas.

Lifetime (``docs/design.md``, lifetime rules): a producer ``loan``s (the allocation is owned by its
session, writable, not visible), ``commit``s (sealed; consumers may ``acquire`` leases), and
``release``s its reference.
Bytes go back to the allocator when no producer reference, no lease and no hold remain. A session
that dies loses every reference and lease it held. Holds expire by TTL. A lease that outlives its
TTL while its session is alive is *quarantined*, not freed: the client may still hold a view of the
bytes, so they are never reused under it; it is reported (log, Stat) and its bytes are freed when it
is released or its session dies.

Each tenant (an allowed uid or group) has its own Registry, arena and quotas; a handle of another
tenant's segment is refused, so tenants can neither read nor pin each other's bytes.

Handles are checked against the allocation that currently lives at their offset: same instance,
segment, offset, size and generation, or the call is refused. Generations are never reused, so a
handle to freed or re-allocated bytes is always detected (no ABA).

All methods take the one registry lock; none blocks or does I/O under it, except freeing a
dedicated segment (one unlink + close; creating them happens outside the lock). A call waiting for
a commit waits on the objects it names only: a commit wakes its own waiters, never rescans others.

Its parts, each used under that lock: ``objects.ObjectBook`` (the object table),
``dedicated.DedicatedSegments``, ``deadlines.Deadlines`` (TTLs and holds), ``waiting``
(waiting calls and commit waiters), ``records`` (what is booked).
"""
from __future__ import annotations

import collections
import hmac
import itertools
import logging
import secrets
import threading
import time
from typing import Any, Sequence

from .. import shm_names
from ..allocator import PAGE, Allocator
from ..errors import (
    HandleError,
    InvalidArgument,
    OwnershipError,
    PermissionDenied,
    Reason,
    ResourceExhausted,
    StateError,
    Unavailable,
)
from ..v1 import daemon_pb2 as pb
from .deadlines import Deadline, Deadlines
from .dedicated import DedicatedSegments
from .objects import ObjectBook
from .records import Allocation, LeaseRecord, ObjState, Session, TenantLimits
from .segments import ShmReserve
from .waiting import CommitWaiters, WaitingCalls

_log = logging.getLogger("shmtransport.daemon")
_RATE_WINDOW_S = 5.0
# How often a waiting Grant looks for room that died in shared memory (orphaned grants): first
# after ROOM_POLL_S, then at intervals doubling up to ROOM_POLL_MAX_S, the longest delay between a
# consumer's last release there and a long-waiting producer's grant. Each look wakes a thread.
ROOM_POLL_S = 0.005
ROOM_POLL_MAX_S = 0.05


_U64_MAX = (1 << 64) - 1


def _saturated_stat(**fields: Any) -> pb.StatResponse:
    """A StatResponse whose counters stop at the largest uint64 instead of failing to serialise
    (a counter of bytes may add up sizes a client wrote, even bounded ones, for as long as the
    daemon runs)."""
    clamped: dict[str, Any] = {name: min(value, _U64_MAX) if type(value) is int else value
                               for name, value in fields.items()}
    return pb.StatResponse(**clamped)


LIST_LIMIT = 10_000  # objects in one List answer (a 4 MiB message holds ~40k; the largest come first)


class Registry:
    """One tenant's books: its sessions, loans, leases and grants, quotas, hand-off windows and
    counters, behind one lock; objects in the object table are kept by its ``ObjectBook``."""

    def __init__(self, instance_id: str, segment_name: str, allocator: Allocator, limits: TenantLimits,
                 shm_reserve: ShmReserve | None = None, segment_owner: tuple[int, int] | None = (-1, -1),
                 tenant: str = "", objects: ObjectBook | None = None):
        """``segment_name``: this tenant's arena (its dedicated segments are named after it, see
        ``shm_names``). ``shm_reserve``: the
        daemon-wide /dev/shm budget dedicated segments are created under; ``segment_owner``: the
        (uid, gid) they are handed to (-1: keep the daemon's), so the tenant can open them by name;
        None: this tenant cannot be given any (a daemon that is not root cannot hand files over).
        ``objects``: the tenant's object table, when it has one (see ``daemon.objects``)."""
        self.instance_id = instance_id
        self.tenant = tenant
        self.segment_name = segment_name
        self.allocator = allocator
        self.limits = limits
        self.quota_nbytes = limits.quota_nbytes or allocator.nbytes
        self._tenant_base = shm_names.base_of_arena(segment_name)
        self._dedicated = DedicatedSegments(self._tenant_base, shm_reserve or ShmReserve(0), segment_owner)
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)  # notified whenever bytes are freed
        self._room_poller = False  # whether a waiting Grant polls the table for room (see grant)
        self._commit_waiters = CommitWaiters()
        self._quarantined: dict[int, int] = {}  # lease id -> bytes, leases past their TTL
        self._objects: dict[int, Allocation] = {}  # Allocation.key -> allocation
        self._leases: dict[int, LeaseRecord] = {}
        self._sessions: dict[str, Session] = {}
        self._deadlines = Deadlines()
        self._next_generation = 1
        self._next_lease_id = 1
        # Times of the allocations of the last _RATE_WINDOW_S only (pruned on every append), so
        # memory and the cost of Stat stay proportional to the recent rate, not to uptime.
        self._alloc_times: collections.deque[float] = collections.deque()
        self.counters: collections.Counter[str] = collections.Counter()
        self._waiting = WaitingCalls()
        self.objects = objects

    # -- sessions --------------------------------------------------------------------------------
    def open_session(self, session_id: str, pid: int, uid: int, quarantine_expired: bool = True,
                     holder_bit: bool = True) -> int | None:
        """Register a session; its object-table holder bit, if it gets one (``holder_bit=False``:
        not, for sessions that reach the table through the daemon only)."""
        with self._lock:
            session = Session(session_id, pid, uid, quarantine_expired)
            self._sessions[session_id] = session
            self.counters["sessions_total"] += 1
            return self.objects.open_session(session_id) if self.objects is not None and holder_bit else None

    @property
    def live_sessions(self) -> int:
        """Sessions of this tenant open now (read without the lock: a snapshot)."""
        return len(self._sessions)

    def note_looked(self, session_id: str) -> None:
        """The session asked for Stat or List (see ``Session.looked``)."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is not None:
                session.looked = True

    def close_session(self, session_id: str, closed_by_client: bool = False) -> None:
        """The session ended: drop everything it held (committed objects keep their hand-off).
        ``closed_by_client``: the client said so (Close), and what it held counts as released at
        close; otherwise its socket closed without a word, and it counts as reclaimed from a death.
        Consumer leases and loans never committed are counted apart; a closed session that only
        looked (``Session.looked``, nothing held) counts as an observer's, not in sessions_closed."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
            if session is None:
                return
            held = len(session.producer_refs)  # what it still held: references, leases, table holds
            leases = loans = nbytes = 0
            for lease_id in list(session.leases):
                lease = self._leases.get(lease_id)
                if lease is not None:
                    leases += 1
                    nbytes += self._drop_lease(lease, session)
            for key in list(session.producer_refs):
                obj = self._objects[key]
                loans += obj.state is ObjState.LOANED  # a reference to a committed object is neither
                nbytes += self._drop_producer_ref(obj, session)
            held += leases
            if self.objects is not None:
                in_table = self.objects.close_session(session_id, self._free_granted)
                held += in_table.held
                leases, loans, nbytes = leases + in_table.leases, loans + in_table.loans, nbytes + in_table.freed_nbytes
            kind = "released_at_close" if closed_by_client else "reclaimed_death"
            self.counters[f"{kind}_leases"] += leases
            self.counters[f"{kind}_loans"] += loans
            self.counters[f"{kind}_nbytes"] += nbytes
            if closed_by_client:
                observer = session.looked and not session.used and not held
                self.counters["observer_sessions_closed" if observer else "sessions_closed"] += 1

    # -- grants: space producers place objects in themselves (the object table) ------------------
    def grant(self, session_id: str, nbytes: int, nslots: int, wait_s: float = 0.0,
              give_back: Sequence[int] = (), retry: bool = False) -> pb.GrantResponse:
        """Arena bytes plus object slots for a producer with a holder bit (all or nothing); waits
        up to ``wait_s`` for space like ``loan``. ``give_back``: grants returned first; ``retry``:
        the caller asks again if refused (not counted as an allocation failure)."""
        if self.objects is None:
            raise StateError("this daemon has no object table: loan with Loan")
        if nbytes < 0 or nslots < 0 or nslots > self.objects.nslots:
            raise InvalidArgument(f"grant of {nbytes} bytes and {nslots} slots: out of range")
        if len(give_back) > self.limits.max_batch:
            raise InvalidArgument(f"give_back: {len(give_back)} entries exceed the batch limit {self.limits.max_batch}")
        with self._lock:
            self._live_session(session_id)
            if give_back:
                self.objects.give_back(session_id, list(give_back), self._free_granted)
            if nbytes == 0:
                return pb.GrantResponse()
            nbytes = (nbytes + PAGE - 1) // PAGE * PAGE
            nslots = min(self.objects.nslots, max(64, (nslots + 63) // 64 * 64))
            deadline = time.monotonic() + wait_s
            polling = False
            poll_s = ROOM_POLL_S
            try:
                while True:
                    offset = None
                    try:
                        if self.limits.quota_nbytes is not None:
                            self._check_quota(nbytes)
                        offset = self.allocator.allocate(nbytes)
                        return self.objects.grant(session_id, offset, nbytes, nslots)
                    except BaseException as exc:
                        if offset is not None:
                            self.allocator.free(offset)
                        if not isinstance(exc, ResourceExhausted):
                            raise
                        if self._make_room():  # orphaned and parked grants hold slots as well as bytes
                            continue
                        remaining = deadline - time.monotonic()
                        # A full table is not waited for: the producer loans through the daemon instead.
                        if remaining <= 0 or exc.reason is Reason.TABLE_FULL or \
                                nbytes > min(self.allocator.nbytes, self.quota_nbytes):
                            if not retry and exc.reason is not Reason.TABLE_FULL:
                                self.counters["allocation_failures"] += 1
                            raise
                        # Orphans die without telling anyone (their consumers release in shared
                        # memory), so the table is polled for them: by one waiter of the tenant at a
                        # time, the others wait to be woken. Waiting costs the same for 1 or 100.
                        with self._waiting.waiting():
                            if polling or not self._room_poller:
                                self._room_poller = polling = True
                                self._freed.wait(min(remaining, poll_s))
                                poll_s = min(2 * poll_s, ROOM_POLL_MAX_S)
                            else:
                                self._freed.wait(remaining)
            finally:
                if polling:  # hand the polling over to a waiter that still waits
                    self._room_poller = False
                    self._freed.notify()

    def _make_room(self) -> bool:
        """Free what the table lets go of without waiting (lock held): orphaned grants whose
        objects died, and grants their producers parked. Whether any bytes came back."""
        if self.objects is None:
            return False
        return bool(self.objects.reclaim_orphans(self._free_granted) or self.objects.take_parked(self._free_granted))

    def _free_granted(self, offset: int) -> None:
        """An orphaned grant whose objects all died goes back to the arena (lock held)."""
        self.allocator.free(offset)
        self._freed.notify_all()

    # -- producer side ---------------------------------------------------------------------------
    def loan(self, session_id: str, sizes: Sequence[int], wait_s: float = 0.0) -> pb.LoanResponse:
        """Allocate every size (all or nothing). When the arena is full, wait up to ``wait_s`` for
        other clients to free space (back-pressure) before refusing with ARENA_FULL."""
        sizes = self._sizes(sizes)
        with self._lock:
            session = self._live_session(session_id)
            total = sum(sizes)
            deadline = time.monotonic() + wait_s
            while True:
                offsets: list[int] = []
                try:
                    if self.limits.quota_nbytes is not None:  # else the arena itself is the bound
                        self._check_quota(total)
                    for nbytes in sizes:
                        offsets.append(self.allocator.allocate(nbytes))
                    break
                except ResourceExhausted:
                    for offset in offsets:
                        self.allocator.free(offset)
                    if self._make_room():
                        continue
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or total > min(self.allocator.nbytes, self.quota_nbytes):
                        self.counters["allocation_failures"] += 1
                        raise
                    with self._waiting.waiting():
                        self._freed.wait(remaining)
            response = pb.LoanResponse()
            for offset, nbytes in zip(offsets, sizes):
                obj = Allocation(offset, nbytes, self._next_generation, session_id,
                                 commit_token=secrets.token_bytes(16))
                self._next_generation += 1
                self._add_loan(session, obj, response)
            self._note_allocations(len(sizes))
            return response

    def loan_dedicated(self, session_id: str, sizes: Sequence[int]) -> pb.LoanResponse:
        """One new segment per size (all or nothing), named with a random suffix so nobody can
        plant a file under a future name. The bytes are reserved up front in the tenant's quota
        (so concurrent loans cannot overshoot it) and the segments created outside the lock,
        under the daemon-wide /dev/shm reserve."""
        self._dedicated.check_allowed()
        sizes = self._sizes(sizes)
        total = sum(sizes)
        with self._lock:
            self._live_session(session_id)
            try:
                try:
                    self._check_quota(total)
                except ResourceExhausted:
                    if not self._make_room():
                        raise
                    self._check_quota(total)
            except ResourceExhausted:
                self.counters["allocation_failures"] += 1
                raise
            self._dedicated.nbytes += total
            first = self._next_generation
            self._next_generation += len(sizes)
        segments = []
        try:
            segments = self._dedicated.create(first, sizes)
            with self._lock:
                session = self._live_session(session_id)
                response = pb.LoanResponse()
                for i, (nbytes, seg) in enumerate(zip(sizes, segments)):
                    gen = first + i
                    obj = Allocation(-gen, nbytes, gen, session_id, commit_token=secrets.token_bytes(16), segment=seg)
                    self._dedicated.add(seg.name, -gen)
                    self._add_loan(session, obj, response)
                self._note_allocations(len(sizes))
                self.counters["dedicated_total"] += len(sizes)
                return response
        except BaseException:
            for seg in segments:
                seg.unlink()
            with self._lock:
                self._dedicated.nbytes -= total
                self._freed.notify_all()
            raise

    @property
    def used_nbytes(self) -> int:
        """Bytes counted against the tenant's quota: its arena allocations and dedicated segments."""
        return self.allocator.used_nbytes + self._dedicated.nbytes

    def _check_quota(self, total: int) -> None:
        if self.used_nbytes + total <= self.quota_nbytes:
            return
        held = f"the tenant holds {self.used_nbytes} bytes (arena and dedicated segments) and asks {total} more"
        if self.limits.quota_nbytes is None:
            raise ResourceExhausted(
                f"{held}: more than the {self.quota_nbytes} bytes of its arena, which bound a tenant's bytes when "
                "no quota is set (shmtransport daemon --arena-size, or --quota-bytes)", Reason.QUOTA_EXCEEDED,
                field="nbytes", limit=self.quota_nbytes)
        raise ResourceExhausted(f"tenant quota exceeded: {held}, quota {self.quota_nbytes} (--quota-bytes)",
                                Reason.QUOTA_EXCEEDED, field="nbytes", limit=self.quota_nbytes)

    def _sizes(self, sizes: Sequence[int]) -> list[int]:
        """Loan sizes, their count checked before anything is expanded."""
        self._check_batch(sizes, "nbytes")
        sizes = list(sizes)
        for nbytes in sizes:
            if nbytes < 1:
                raise InvalidArgument(f"nbytes must be >= 1, got {nbytes}")
        return sizes

    def dedicated_names(self) -> list[str]:
        """The names in /dev/shm of this tenant's live dedicated segments, sorted."""
        with self._lock:
            return self._dedicated.names()

    def unlink_dedicated(self) -> None:
        """Daemon shutdown: unlink every dedicated segment still registered."""
        with self._lock:
            segments = [self._objects[key].segment for key in self._dedicated.keys()]
        for seg in filter(None, segments):
            seg.unlink()

    def commit(self, session_id: str, handles: Sequence[pb.Handle], hold_ms: int) -> None:
        """Seal the session's loans ``handles`` (all or none): each is handed off, or held for
        ``hold_ms`` (0: the tenant's default, at most ``max_hold_ms``)."""
        self._check_batch(handles, "handles")
        handles = list(handles)
        hold_ms = hold_ms or self.limits.default_hold_ms
        if hold_ms > self.limits.max_hold_ms:
            raise InvalidArgument(f"hold_ms={hold_ms} exceeds the maximum {self.limits.max_hold_ms}")
        with self._lock:
            self._live_session(session_id)
            objs = [self._resolve(h) for h in handles]
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
            until = time.monotonic() + (self.limits.handoff_window_ms if handoff else hold_ms) / 1000
            for obj in objs:
                self._mark_committed(obj)
                obj.hold_until, obj.handoff = until, handoff
                self._deadlines.add(until, Deadline.HOLD, obj.key)

    # -- consumer side ---------------------------------------------------------------------------
    def acquire(
        self,
        session_id: str,
        handles: Sequence[pb.Handle],
        ttl_ms: int,
        commit_wait_s: float = 0.0,
        commit_tokens: Sequence[bytes] = (),
    ) -> list[int]:
        """Leases on committed objects. A loan whose matching commit token is presented is committed
        here (commit by handoff); one whose commit has not arrived yet (producers commit without
        waiting for the reply) is waited for up to ``commit_wait_s``."""
        self._check_batch(handles, "handles")
        if commit_tokens and len(commit_tokens) != len(handles):
            raise InvalidArgument(f"{len(commit_tokens)} commit tokens for {len(handles)} handles")
        handles = list(handles)
        ttl_ms = ttl_ms or self.limits.default_lease_ttl_ms
        if ttl_ms > self.limits.max_lease_ttl_ms:
            raise InvalidArgument(f"ttl_ms={ttl_ms} exceeds the maximum {self.limits.max_lease_ttl_ms}")
        # Objects of the object table are held with the daemon's proxy bit (the caller has no bit
        # of its own); the rest are the registry's.
        in_table = [i for i, h in enumerate(handles) if h.slot]
        mine = [i for i, h in enumerate(handles) if not h.slot]
        with self._lock:
            session = self._live_session(session_id)
            for i in in_table:
                self._check_table_handle(handles[i])
            tokens = [commit_tokens[i] for i in mine] if commit_tokens else []
            objs = self._wait_committed([handles[i] for i in mine], tokens, commit_wait_s) if mine else []
            held = len(self._leases) + (self.objects.proxy_leases if self.objects is not None else 0)
            if held + len(handles) > self.limits.quota_leases:
                raise ResourceExhausted(
                    f"tenant lease quota exceeded: the tenant holds {held} leases, asks "
                    f"{len(handles)} more, quota {self.limits.quota_leases}",
                    Reason.QUOTA_EXCEEDED, field="handles", limit=self.limits.quota_leases,
                )
            lease_ids = [0] * len(handles)
            try:
                for i in in_table:
                    self._table().proxy_acquire(session_id, handles[i], self._next_lease_id)
                    lease_ids[i] = self._next_lease_id
                    session.leases.add(self._next_lease_id)
                    self._next_lease_id += 1
            except BaseException:
                for i in in_table:
                    if lease_ids[i]:
                        self._table().proxy_release(lease_ids[i])
                        session.leases.discard(lease_ids[i])
                raise
            expires_at = time.monotonic() + ttl_ms / 1000
            for i, obj in zip(mine, objs):
                lease = LeaseRecord(self._next_lease_id, obj.key, obj.generation, session_id, expires_at)
                self._next_lease_id += 1
                self._leases[lease.lease_id] = lease
                obj.leases.add(lease.lease_id)
                if obj.handoff:  # the first acquire takes the hand-off over
                    obj.hold_until, obj.handoff = 0.0, False
                session.leases.add(lease.lease_id)
                self._deadlines.add(expires_at, Deadline.LEASE, lease.lease_id)
                lease_ids[i] = lease.lease_id
            return lease_ids

    def _check_table_handle(self, h: pb.Handle) -> None:
        """A handle naming an object-table slot: of this instance, tenant and arena."""
        self._check_instance_and_tenant(h)
        if h.name != self.segment_name:
            raise HandleError(f"an object-table handle names segment {h.name!r}, not this tenant's arena")
        table = self._table()
        if h.nbytes < 1 or h.offset + h.nbytes > self.allocator.nbytes:
            raise HandleError(
                f"offset {h.offset} + nbytes {h.nbytes} outside the arena of {self.allocator.nbytes} bytes",
                Reason.OUT_OF_BOUNDS,
            )
        table.proxy_check(h)

    def _wait_committed(
        self, handles: list[pb.Handle], commit_tokens: Sequence[bytes], commit_wait_s: float
    ) -> list[Allocation]:
        """The allocations the handles name, once all are committed: by their token here, or by
        their producer's Commit within ``commit_wait_s`` (lock held, released while waiting)."""
        deadline = None  # the clock is read only when a commit is still missing
        while True:
            objs = [self._resolve(h) for h in handles]
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
            self._lock.release()
            try:
                with self._waiting.waiting():
                    woken.wait(remaining)
            finally:
                self._lock.acquire()
                self._commit_waiters.forget(woken, keys)

    # -- both ------------------------------------------------------------------------------------
    def release(
        self, session_id: str, handles: Sequence[pb.Handle], lease_ids: Sequence[int], piggybacked: bool = False
    ) -> None:
        """Drop producer references and leases, all or nothing. ``piggybacked`` releases (sent
        lazily with another call) skip entries that are already gone instead of failing."""
        count = len(handles) + len(lease_ids)
        if count > self.limits.max_batch:
            raise InvalidArgument(f"release: {count} entries exceed the batch limit {self.limits.max_batch}")
        if count == 0:
            if piggybacked:
                return
            raise InvalidArgument("handles + lease_ids must not be empty")
        handles, lease_ids = list(handles), list(lease_ids)
        with self._lock:
            session = self._live_session(session_id)
            if piggybacked:
                handles, lease_ids = self._still_held(session, handles, lease_ids)
            if any(h.slot for h in handles):
                raise InvalidArgument("objects of the object table are released in shared memory, not by RPC")
            objs = [self._resolve(h) for h in handles]
            for obj in objs:
                if obj.owner != session_id:
                    raise OwnershipError(f"release of another client's object (offset {obj.offset})")
                if not obj.producer_ref:
                    raise StateError(f"object at offset {obj.offset} already released", Reason.DOUBLE_RELEASE)
            leases, proxied = [], []
            for lease_id in lease_ids:
                lease = self._leases.get(lease_id)
                proxy = self.objects.proxy_lease(lease_id) if lease is None and self.objects is not None else None
                if proxy is not None:
                    if proxy.session_id != session_id:
                        raise OwnershipError(f"lease {lease_id} belongs to another client")
                    proxied.append(lease_id)
                    continue
                if lease is None:
                    if 0 < lease_id < self._next_lease_id:
                        raise StateError(f"lease {lease_id} already released or expired", Reason.DOUBLE_RELEASE)
                    raise HandleError(f"unknown lease {lease_id}")
                if lease.session_id != session_id:
                    raise OwnershipError(f"lease {lease_id} belongs to another client")
                leases.append(lease)
            if len({obj.key for obj in objs}) != len(objs) or len(set(lease_ids)) != len(lease_ids):
                raise InvalidArgument("the same handle or lease appears twice in one release")
            for obj in objs:
                if obj.handoff:  # an explicit release ends the hand-off (a session's end keeps it)
                    obj.hold_until, obj.handoff = 0.0, False
                self._drop_producer_ref(obj, session)
            for lease in leases:
                self._drop_lease(lease, session)
            for lease_id in proxied:
                self._table().proxy_release(lease_id)
                session.leases.discard(lease_id)

    def _still_held(
        self, session: Session, handles: list[pb.Handle], lease_ids: list[int]
    ) -> tuple[list[pb.Handle], list[int]]:
        held = []
        for h in handles:
            key = self._key(h) if h.instance_id == self.instance_id else None
            if key in session.producer_refs and self._objects[key].generation == h.generation:
                held.append(h)
        return held, [lease_id for lease_id in lease_ids if lease_id in session.leases]

    def expire(self, now: float | None = None) -> None:
        """Drop leases and holds whose deadline passed (the sweeper thread calls this)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            for kind, key in self._deadlines.due(now):
                if kind is Deadline.LEASE:
                    lease = self._leases.get(key)
                    if lease is None or lease.quarantined or lease.expires_at > now:
                        continue
                    session = self._sessions.get(lease.session_id)
                    if session is not None and session.quarantine_expired:
                        self._quarantine(lease, session)
                    else:
                        self.counters["reclaimed_ttl_leases"] += 1
                        self.counters["reclaimed_ttl_nbytes"] += self._drop_lease(lease, session)
                else:
                    obj = self._objects.get(key)
                    if obj is not None and obj.hold_until and obj.hold_until <= now:
                        obj.hold_until = 0.0
                        freed = self._maybe_free(obj)
                        if freed and obj.handoff:
                            self.counters["reclaimed_handoff_objects"] += 1
                            self.counters["reclaimed_handoff_nbytes"] += freed
            if self.objects is not None:
                self.objects.sweep(now, self._free_granted, _RATE_WINDOW_S)
            live_leases = ((lease.expires_at, Deadline.LEASE, lease.lease_id)
                           for lease in self._leases.values() if not lease.quarantined)
            live_holds = ((o.hold_until, Deadline.HOLD, key) for key, o in self._objects.items() if o.hold_until)
            self._deadlines.compact(len(self._leases) + len(self._objects), itertools.chain(live_leases, live_holds))

    def _quarantine(self, lease: LeaseRecord, session: Session) -> None:
        """A lease past its TTL whose holder lives: keep its bytes (a view may still read them)."""
        lease.quarantined = True
        nbytes = self._objects[lease.key].nbytes
        self._quarantined[lease.lease_id] = nbytes
        self.counters["quarantined_leases_total"] += 1
        _log.warning(
            "lease %d (%d bytes) of session %s (pid %d) outlived its TTL: its bytes stay quarantined "
            "until it is released or the process exits", lease.lease_id, nbytes, session.session_id, session.pid,
        )

    # -- introspection ---------------------------------------------------------------------------
    def _client_stats(self) -> list[pb.ClientStat]:
        """Each session's holdings: what the daemon books for it, and what it holds with its own
        bit in the object table."""
        in_table = self.objects.session_holdings() if self.objects is not None else {}
        clients = []
        for s in self._sessions.values():
            t = in_table.get(s.session_id)
            clients.append(pb.ClientStat(
                session_id=s.session_id, pid=s.pid, uid=s.uid, loaned_nbytes=s.loaned_nbytes,
                committed_nbytes=s.committed_nbytes, leases=len(s.leases),
                table_leases=t.leases if t else 0, table_loaned_nbytes=t.loaned_nbytes if t else 0,
                table_committed_nbytes=t.committed_nbytes if t else 0))
        return clients

    def list_objects(self, limit: int = 0) -> pb.ListResponse:
        """Every live object of the tenant, largest first (at most ``limit``, capped at
        LIST_LIMIT): where it is, its state, its producer and its holders, with their pids."""
        limit = min(limit or LIST_LIMIT, LIST_LIMIT)
        with self._lock:
            now = time.monotonic()
            pid_of = {session_id: s.pid for session_id, s in self._sessions.items()}
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
            if self.objects is not None:
                infos.extend(self.objects.list_objects())
            total = len(infos)
            infos.sort(key=lambda info: -info.nbytes)
            del infos[limit:]
            for info in infos:
                if info.owner_session not in pid_of:
                    info.owner_session = ""  # its producer is gone (a handed-off object)
                info.owner_pid = pid_of.get(info.owner_session, 0)
                info.holder_pids.extend(pid_of.get(s, 0) for s in info.holder_sessions)
            return pb.ListResponse(tenant=self.tenant, objects=infos, total_objects=total,
                                   clients=self._client_stats())

    def stat(self) -> pb.StatResponse:
        """This tenant's state now: arena use, objects, leases, sessions, counters (saturated)."""
        with self._lock:
            self._prune_rate_window(time.monotonic())
            recent = len(self._alloc_times)
            granted = self.objects.granted_nbytes if self.objects is not None else 0
            table = dict.fromkeys(("objects", "nbytes", "leases", "handoff", "reclaimed_handoff_objects",
                                   "reclaimed_handoff_nbytes", "allocations_total", "parked_nbytes",
                                   "parked_grants_taken"), 0)
            table_rate = 0.0
            if self.objects is not None:
                table.update(self.objects.snapshot(), **self.objects.counters,
                             allocations_total=self.objects.allocations_total,
                             parked_nbytes=self.objects.parked_nbytes)
                table_rate = self.objects.allocation_rate(_RATE_WINDOW_S)
            clients = self._client_stats()
            a = self.allocator
            c = self.counters
            return _saturated_stat(
                # Bytes of live objects; space granted to producers but not used by an object yet
                # is in granted_nbytes only (neither used nor free).
                used_nbytes=a.used_nbytes - granted + table["nbytes"],
                free_nbytes=a.free_nbytes,
                largest_free_nbytes=a.largest_free_nbytes,
                free_extents=a.free_extents,
                live_objects=len(self._objects) + table["objects"],
                live_leases=len(self._leases) + table["leases"],
                granted_nbytes=granted,
                parked_nbytes=table["parked_nbytes"],
                parked_grants_taken=table["parked_grants_taken"],
                table_objects=table["objects"],
                handoff_objects=table["handoff"],
                reclaimed_handoff_objects=c["reclaimed_handoff_objects"] + table["reclaimed_handoff_objects"],
                reclaimed_handoff_nbytes=c["reclaimed_handoff_nbytes"] + table["reclaimed_handoff_nbytes"],
                tenant=self.tenant,
                quarantined_leases=len(self._quarantined),
                quarantined_nbytes=sum(self._quarantined.values()),
                quarantined_leases_total=c["quarantined_leases_total"],
                dedicated_nbytes=self._dedicated.nbytes,
                quota_nbytes=self.quota_nbytes,
                quota_leases=self.limits.quota_leases,
                clients=clients,
                allocations_total=c["allocations_total"] + table["allocations_total"],
                allocations_per_s=recent / _RATE_WINDOW_S + table_rate,
                reclaimed_ttl_nbytes=c["reclaimed_ttl_nbytes"],
                reclaimed_ttl_leases=c["reclaimed_ttl_leases"],
                reclaimed_death_nbytes=c["reclaimed_death_nbytes"],
                reclaimed_death_leases=c["reclaimed_death_leases"],
                reclaimed_death_loans=c["reclaimed_death_loans"],
                allocation_failures=c["allocation_failures"],
                sessions_total=c["sessions_total"],
                sessions_closed=c["sessions_closed"],
                observer_sessions_closed=c["observer_sessions_closed"],
                released_at_close_leases=c["released_at_close_leases"],
                released_at_close_loans=c["released_at_close_loans"],
                released_at_close_nbytes=c["released_at_close_nbytes"],
                waiting_calls=self._waiting.count,
            )

    # -- internals (lock held) -------------------------------------------------------------------
    def _note_allocations(self, count: int) -> None:
        """Count ``count`` allocations made now: in the total, and in the window of allocations_per_s."""
        now = time.monotonic()
        self._alloc_times.extend(itertools.repeat(now, count))
        self._prune_rate_window(now)
        self.counters["allocations_total"] += count

    def _prune_rate_window(self, now: float) -> None:
        times = self._alloc_times
        while times and now - times[0] > _RATE_WINDOW_S:
            times.popleft()

    def _check_batch(self, items: Sequence[object], what: str) -> None:
        if not items:
            raise InvalidArgument(f"{what} must not be empty")
        if len(items) > self.limits.max_batch:
            raise InvalidArgument(f"{what}: {len(items)} entries exceed the batch limit {self.limits.max_batch}")

    def _table(self) -> ObjectBook:
        """The object table, for a handle already checked to name one of its slots."""
        if self.objects is None:
            raise HandleError("the handle names an object-table slot; this daemon has no object table")
        return self.objects

    def _live_session(self, session_id: str) -> Session:
        """The session of a call that loans, grants, commits, acquires or releases (marked
        ``used``); PermissionDenied (UNKNOWN_SESSION) when it is not live."""
        session = self._sessions.get(session_id)
        if session is None:
            raise PermissionDenied("unknown or closed session: connect through the daemon's handshake",
                                   Reason.UNKNOWN_SESSION)
        session.used = True
        return session

    def _key(self, h: pb.Handle) -> int | None:
        """The registry key a handle names: its arena offset, or a dedicated segment's key."""
        if h.name == self.segment_name:
            return h.offset
        return self._dedicated.key_of(h.name)

    def _add_loan(self, session: Session, obj: Allocation, response: pb.LoanResponse) -> None:
        """Register a new allocation as ``session``'s loan and name it in ``response``."""
        self._objects[obj.key] = obj
        session.producer_refs.add(obj.key)
        session.loaned_nbytes += obj.nbytes
        # Built in place in the response: a Handle built first would be copied into it again.
        name = obj.segment.name if obj.segment is not None else self.segment_name
        response.handles.add(name=name, offset=obj.offset, nbytes=obj.nbytes, owner_id=obj.owner,
                             generation=obj.generation, instance_id=self.instance_id)
        response.commit_tokens.append(obj.commit_token)

    def _mark_committed(self, obj: Allocation) -> None:
        obj.state = ObjState.COMMITTED
        self._commit_waiters.wake(obj.key)
        # The producer's reference now counts as committed bytes (by Commit, or by handoff in a
        # consumer's Acquire: then the producer is another session than the caller).
        owner = self._sessions.get(obj.owner) if obj.producer_ref else None
        if owner is not None:
            owner.loaned_nbytes -= obj.nbytes
            owner.committed_nbytes += obj.nbytes

    def _check_instance_and_tenant(self, h: pb.Handle) -> None:
        """Refuse a handle of another daemon instance, or of another tenant of this one."""
        if h.instance_id != self.instance_id:
            raise Unavailable(
                f"handle of daemon instance {h.instance_id!r}, this is {self.instance_id!r} "
                "(the daemon restarted; its bytes are gone)",
                Reason.INSTANCE_MISMATCH,
            )
        if shm_names.names_another_tenant(self._tenant_base, h.name):
            raise PermissionDenied(f"segment {h.name!r} belongs to another tenant of this daemon")

    def _resolve(self, h: pb.Handle) -> Allocation:
        """The live allocation a handle names, or a typed refusal. Never trusts any field alone."""
        self._check_instance_and_tenant(h)
        if h.name != self.segment_name:
            return self._resolve_dedicated(h)
        if h.nbytes < 1 or h.offset + h.nbytes > self.allocator.nbytes:
            raise HandleError(
                f"offset {h.offset} + nbytes {h.nbytes} outside the arena of {self.allocator.nbytes} bytes",
                Reason.OUT_OF_BOUNDS,
            )
        obj = self._objects.get(h.offset)
        if obj is None or obj.generation != h.generation:
            if 0 < h.generation < self._next_generation:
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
        key = self._dedicated.key_of(h.name)
        if key is None:
            if self._dedicated.is_stale(h.name, self._next_generation):
                raise HandleError(f"stale handle: dedicated segment {h.name!r} was freed", Reason.STALE_HANDLE)
            raise HandleError(f"unknown segment {h.name!r}")
        obj = self._objects[key]
        if h.offset != 0 or h.nbytes != obj.nbytes:
            raise HandleError(f"handle [{h.offset}, +{h.nbytes}) does not match dedicated segment {h.name!r} "
                              f"({obj.nbytes} bytes at offset 0)", Reason.OUT_OF_BOUNDS)
        if obj.generation != h.generation:
            raise HandleError(f"stale handle: generation {h.generation} != {obj.generation}", Reason.STALE_HANDLE)
        return obj

    def _drop_producer_ref(self, obj: Allocation, session: Session | None) -> int:
        obj.producer_ref = False
        if session is not None:
            session.producer_refs.discard(obj.key)
            if obj.state is ObjState.LOANED:
                session.loaned_nbytes -= obj.nbytes
            else:
                session.committed_nbytes -= obj.nbytes
        return self._maybe_free(obj)

    def _drop_lease(self, lease: LeaseRecord, session: Session | None) -> int:
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
            self._dedicated.freed(obj.segment, obj.nbytes)
        else:
            self.allocator.free(obj.offset)
        self._freed.notify_all()
        return obj.nbytes
