"""One tenant's books: its sessions, quotas and counters, and the two books of its objects
behind one lock: ``objects.ObjectBook`` (the object table, where every object lives, and where
clients with a holder bit keep their objects themselves) and ``allocations.AllocationBook`` (the
references the daemon holds there for the others: it places and holds their objects with its
proxy bit). The registry checks each call (session, batch, quota, handle's instance and tenant)
and hands it to the books.

Each tenant (an allowed uid or group) has its own Registry, arena and quotas; a handle of another
tenant's segment is refused, so tenants can neither read nor pin each other's bytes.

All methods take the one registry lock; none blocks or does I/O under it, except freeing a
dedicated segment (one unlink + close; creating them happens outside the lock). Waiting calls (for
room, or for a commit) wait on a condition of the lock, woken by what they wait for.
"""
from __future__ import annotations

import collections
import logging
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
from .allocations import AllocationBook
from .dedicated import DedicatedSegments
from .index import IdentityIndex
from .objects import ObjectBook
from .records import LeaseRecord, OwnObjects, Session, TenantLimits
from .segments import ShmReserve
from .waiting import WaitingCalls

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
    """One tenant's sessions, quotas, grants and counters, and its two object books (``objects``:
    the table; ``allocations``: the daemon's references there), behind one lock."""

    def __init__(self, instance_id: str, segment_name: str, allocator: Allocator, limits: TenantLimits,
                 objects: ObjectBook, shm_reserve: ShmReserve | None = None,
                 segment_owner: tuple[int, int] | None = (-1, -1), tenant: str = ""):
        """``segment_name``: this tenant's arena (its dedicated segments are named after it, see
        ``shm_names``). ``shm_reserve``: the
        daemon-wide /dev/shm budget dedicated segments are created under; ``segment_owner``: the
        (uid, gid) they are handed to (-1: keep the daemon's), so the tenant can open them by name;
        None: this tenant cannot be given any (a daemon that is not root cannot hand files over).
        ``objects``: the tenant's object table (see ``daemon.objects``)."""
        self.instance_id = instance_id
        self.tenant = tenant
        self.segment_name = segment_name
        self.allocator = allocator
        self.limits = limits
        self.quota_nbytes = limits.quota_nbytes or allocator.nbytes
        self._tenant_base = shm_names.base_of_arena(segment_name)
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)  # notified whenever bytes are freed
        self._room_poller = False  # whether a waiting Grant polls the table for room (see grant)
        self._sessions: dict[str, Session] = {}
        self.counters: collections.Counter[str] = collections.Counter()
        self._waiting = WaitingCalls()
        self.objects = objects
        dedicated = DedicatedSegments(self._tenant_base, shm_reserve or ShmReserve(0), segment_owner)
        self.allocations = AllocationBook(instance_id, segment_name, self._sessions, objects, dedicated,
                                          self.counters, self._bytes_freed, self._waiting, self._check_handle)
        budget = self.quota_nbytes // 2 if limits.cache_nbytes is None else limits.cache_nbytes
        self.index = IdentityIndex(self.allocations, budget, self.counters)

    # -- sessions --------------------------------------------------------------------------------
    def open_session(self, session_id: str, pid: int, uid: int, quarantine_expired: bool = True,
                     holder_bit: bool = True) -> int | None:
        """Register a session; its object-table holder bit, if it gets one (``holder_bit=False``:
        not, for sessions that reach the table through the daemon only)."""
        with self._lock:
            session = Session(session_id, pid, uid, quarantine_expired)
            self._sessions[session_id] = session
            self.counters["sessions_total"] += 1
            return self.objects.open_session(session_id) if holder_bit else None

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
            leases, loans, nbytes = self.allocations.close_session(session)
            held += leases
            in_table = self.objects.close_session(session_id, self._bytes_freed)
            held += in_table.held
            leases, loans, nbytes = leases + in_table.leases, loans + in_table.loans, nbytes + in_table.freed_nbytes
            self.allocations.reclaim_dead()  # objects the daemon placed that only the session's bit held
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
        if nbytes < 0 or nslots < 0:  # more slots than the table has: it gets them all (clamped below)
            raise InvalidArgument(f"grant of {nbytes} bytes and {nslots} slots: out of range")
        if len(give_back) > self.limits.max_batch:
            raise InvalidArgument(f"give_back: {len(give_back)} entries exceed the batch limit {self.limits.max_batch}")
        with self._lock:
            session = self._live_session(session_id)
            if give_back:
                self.objects.give_back(session_id, list(give_back), self._bytes_freed)
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
                        if self._make_room():  # orphaned grants hold slots as well as bytes
                            continue
                        remaining = deadline - time.monotonic()
                        # A full table is not waited for here: the producer's Loan waits for a slot.
                        if remaining <= 0 or exc.reason is Reason.TABLE_FULL or \
                                nbytes > min(self.allocator.nbytes, self.quota_nbytes):
                            if not retry and exc.reason is not Reason.TABLE_FULL:
                                self.counters["allocation_failures"] += 1
                            raise self._refusal(exc, session) from None
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
        """Free what the table lets go of without waiting (lock held): objects the daemon placed
        that died there, and orphaned grants whose objects died; live producers are asked for their
        empty grants, which come back later (a waiting call sees them). Whether any bytes came back."""
        self.objects.recall_grants()
        return bool(self.allocations.reclaim_dead() or self.objects.reclaim_orphans(self._bytes_freed)
                    or self._evict_for_room())

    def _evict_for_room(self) -> bool:
        """Evict the least recently used index entry nobody holds and free what died of it
        (lock held): a full arena drops cache entries before it refuses a producer."""
        if not self.index.evict_one():
            return False
        self.allocations.reclaim_dead()
        self.objects.reclaim_orphans(self._bytes_freed)
        return True

    def _bytes_freed(self, offset: int | None) -> None:
        """Bytes came back (lock held): an arena ``offset`` (an object's, or an orphaned grant's
        whose objects all died), or None for a dedicated segment's. Calls waiting for room look again."""
        if offset is not None:
            self.allocator.free(offset)
        self._freed.notify_all()

    # -- producer side ---------------------------------------------------------------------------
    def loan(self, session_id: str, sizes: Sequence[int], wait_s: float = 0.0) -> pb.LoanResponse:
        """Allocate every size and place each object in the table (all or nothing). When the arena
        or the table is full, wait up to ``wait_s`` for other clients to free space (back-pressure)
        before refusing with ARENA_FULL or TABLE_FULL."""
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
                    response = pb.LoanResponse()
                    self.allocations.add_arena_loans(session, offsets, sizes, response)
                    break
                except ResourceExhausted as exc:
                    for offset in offsets:
                        self.allocator.free(offset)
                    if self._make_room():
                        continue
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or len(sizes) > self.objects.nslots or (
                            exc.reason is not Reason.TABLE_FULL and total > min(self.allocator.nbytes,
                                                                                 self.quota_nbytes)):
                        self.counters["allocation_failures"] += 1
                        raise self._refusal(exc, session) from None
                    with self._waiting.waiting():
                        self._freed.wait(remaining)
            return response

    def _refusal(self, exc: ResourceExhausted, session: Session) -> ResourceExhausted:
        """``exc`` telling what the refused session itself holds: a producer that runs for days
        and never releases what it commits fills the arena on its own."""
        table, booked = self.objects.own_objects(session.session_id), self.allocations.own_objects(session)
        own = OwnObjects(*map(sum, zip(table, booked)))
        if exc.reason is Reason.TABLE_FULL or not (own.loans or own.committed):
            return exc
        return ResourceExhausted(
            f"{exc.message}. This session still holds {own.committed} committed objects "
            f"({_mib(own.committed_nbytes)}) and {own.loans} loans ({_mib(own.loaned_nbytes)}): a producer keeps each "
            "object it commits until producer.release(handle), which it calls once the consumer has acquired it; "
            "or it commits with keep=False (put(..., keep=False)), and the object is the consumer's",
            exc.reason, field=exc.field, limit=exc.limit)

    def loan_dedicated(self, session_id: str, sizes: Sequence[int]) -> pb.LoanResponse:
        """One new segment per size (all or nothing), named with a random suffix so nobody can
        plant a file under a future name. The bytes are reserved up front in the tenant's quota
        (so concurrent loans cannot overshoot it) and the segments created outside the lock,
        under the daemon-wide /dev/shm reserve."""
        dedicated = self.allocations.dedicated
        dedicated.check_allowed()
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
            dedicated.nbytes += total
            first = self.allocations.take_serials(len(sizes))
        segments = []
        try:
            segments = dedicated.create(first, sizes)
            with self._lock:
                session = self._live_session(session_id)
                response = pb.LoanResponse()
                self.allocations.add_dedicated_loans(session, first, sizes, segments, response)
                self.counters["dedicated_total"] += len(sizes)
                return response
        except BaseException:
            for seg in segments:
                seg.unlink()
            with self._lock:
                dedicated.nbytes -= total
                self._freed.notify_all()
            raise

    @property
    def used_nbytes(self) -> int:
        """Bytes counted against the tenant's quota: its arena allocations and dedicated segments."""
        return self.allocator.used_nbytes + self.allocations.dedicated.nbytes

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
            return self.allocations.dedicated.names()

    def unlink_dedicated(self) -> None:
        """Daemon shutdown: unlink every dedicated segment still registered."""
        with self._lock:
            segments = self.allocations.dedicated_segments()
        for seg in segments:
            seg.unlink()

    def commit(self, session_id: str, handles: Sequence[pb.Handle], hold_ms: int,
               release_reference: bool = False) -> None:
        """Seal the session's loans ``handles`` (all or none): each is handed off, or held for
        ``hold_ms`` (0: the tenant's default, at most ``max_hold_ms``); ``release_reference``: the
        session keeps no reference to them."""
        self._check_batch(handles, "handles")
        handles = list(handles)
        hold_ms = hold_ms or self.limits.default_hold_ms
        if hold_ms > self.limits.max_hold_ms:
            raise InvalidArgument(f"hold_ms={hold_ms} exceeds the maximum {self.limits.max_hold_ms}")
        with self._lock:
            session = self._live_session(session_id)
            self.allocations.commit(session, handles, hold_ms, self.limits.handoff_window_ms, release_reference)

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
        with self._lock:
            session = self._live_session(session_id)
            objs = self.allocations.wait_committed(handles, commit_tokens, commit_wait_s,
                                                   self.limits.handoff_window_ms, self._lock)
            held = self.allocations.live_leases
            if held + len(handles) > self.limits.quota_leases:
                raise ResourceExhausted(
                    f"tenant lease quota exceeded: the tenant holds {held} leases, asks "
                    f"{len(handles)} more, quota {self.limits.quota_leases}",
                    Reason.QUOTA_EXCEEDED, field="handles", limit=self.limits.quota_leases,
                )
            return self.allocations.lease_all(session, handles, objs, time.monotonic() + ttl_ms / 1000)

    # -- the identity index ----------------------------------------------------------------------
    def publish(self, session_id: str, scope: bytes, identity: bytes, tensor: pb.TensorHandle) -> pb.PublishResponse:
        """Publish the session's committed object under ``(scope, identity)`` unless an entry is
        there already (then the response names that one)."""
        with self._lock:
            return self.index.publish(self._live_session(session_id), scope, identity, tensor)

    def lookup(self, session_id: str, scope: bytes, identities: Sequence[bytes]) -> pb.LookupResponse:
        """The entry under each identity, or an empty handle."""
        self._check_batch(identities, "identities")
        with self._lock:
            self._live_session(session_id)
            return self.index.lookup(scope, identities)

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
            book = self.allocations
            if piggybacked:
                handles = book.still_held(session, handles)
                lease_ids = [lease_id for lease_id in lease_ids if lease_id in session.leases]
            objs = book.owned_for_release(session_id, handles)
            leases: list[LeaseRecord] = []
            for lease_id in lease_ids:
                lease = book.lease_record(lease_id)
                if lease is None:
                    if book.was_lease_id(lease_id):
                        raise StateError(f"lease {lease_id} already released or expired", Reason.DOUBLE_RELEASE)
                    raise HandleError(f"unknown lease {lease_id}")
                if lease.session_id != session_id:
                    raise OwnershipError(f"lease {lease_id} belongs to another client")
                leases.append(lease)
            if len({obj.key for obj in objs}) != len(objs) or len(set(lease_ids)) != len(lease_ids):
                raise InvalidArgument("the same handle or lease appears twice in one release")
            for obj in objs:
                book.release_producer_ref(obj, session)
            for lease in leases:
                book.drop_lease(lease, session)

    def expire(self, now: float | None = None) -> None:
        """Drop leases and holds whose deadline passed, and index entries past the budget that nobody
        holds any more (the sweeper thread calls this)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self.allocations.expire(now)
            # Entries published while held pass the budget until their holders let go.
            while self.index.nbytes > self.index.budget_nbytes and self.index.evict_one():
                pass
            self.objects.sweep(now, self._bytes_freed, _RATE_WINDOW_S, self.allocations.proxied_slots)
            self.allocations.reclaim_dead()

    # -- introspection ---------------------------------------------------------------------------
    def _client_stats(self) -> list[pb.ClientStat]:
        """Each session's holdings: what the daemon books for it, and what it holds with its own
        bit in the object table."""
        in_table = self.objects.session_holdings()
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
            infos = self.objects.list_objects(self.allocations.daemon_side(now))
            total = len(infos)
            infos.sort(key=lambda info: -info.nbytes)
            del infos[limit:]
            identities = self.index.identities_by_slot()
            for info in infos:
                if info.owner_session not in pid_of:
                    info.owner_session = ""  # its producer is gone (a handed-off object)
                info.owner_pid = pid_of.get(info.owner_session, 0)
                info.holder_pids.extend(pid_of.get(s, 0) for s in info.holder_sessions)
                info.identity = identities.get(info.slot - 1, "")
            return pb.ListResponse(tenant=self.tenant, objects=infos, total_objects=total,
                                   clients=self._client_stats())

    def stat(self) -> pb.StatResponse:
        """This tenant's state now: arena use, objects, leases, sessions, counters (saturated)."""
        with self._lock:
            self.allocations.reclaim_dead()  # so its bytes agree with the table's objects
            granted = self.objects.granted_nbytes
            table = dict(self.objects.snapshot(), **self.objects.counters)
            clients = self._client_stats()
            quarantined = self.allocations.quarantined
            a = self.allocator
            c = self.counters
            return _saturated_stat(
                # Bytes of live objects; space granted to producers but not used by an object yet
                # is in granted_nbytes only (neither used nor free).
                used_nbytes=a.used_nbytes - granted + table["nbytes"],
                free_nbytes=a.free_nbytes,
                largest_free_nbytes=a.largest_free_nbytes,
                free_extents=a.free_extents,
                live_objects=table["objects"],
                live_leases=self.allocations.live_leases + table["leases"],
                granted_nbytes=granted,
                table_objects=table["objects"],
                handoff_objects=table["handoff"],
                reclaimed_handoff_objects=table["reclaimed_handoff_objects"],
                reclaimed_handoff_nbytes=table["reclaimed_handoff_nbytes"],
                tenant=self.tenant,
                quarantined_leases=quarantined[0],
                quarantined_nbytes=quarantined[1],
                quarantined_leases_total=c["quarantined_leases_total"],
                dedicated_nbytes=self.allocations.dedicated.nbytes,
                quota_nbytes=self.quota_nbytes,
                quota_leases=self.limits.quota_leases,
                clients=clients,
                allocations_total=self.objects.allocations_total,
                allocations_per_s=self.objects.allocation_rate(_RATE_WINDOW_S),
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
                index_entries=len(self.index),
                index_nbytes=self.index.nbytes,
                index_budget_nbytes=self.index.budget_nbytes,
                index_hits=c["index_hits"],
                index_misses=c["index_misses"],
                index_published=c["index_published"],
                index_duplicates=c["index_duplicates"],
                index_evictions=c["index_evictions"],
            )

    # -- internals (lock held) -------------------------------------------------------------------
    def _check_batch(self, items: Sequence[object], what: str) -> None:
        if not items:
            raise InvalidArgument(f"{what} must not be empty")
        if len(items) > self.limits.max_batch:
            raise InvalidArgument(f"{what}: {len(items)} entries exceed the batch limit {self.limits.max_batch}")

    def _live_session(self, session_id: str) -> Session:
        """The session of a call that loans, grants, commits, acquires or releases (marked
        ``used``); PermissionDenied (UNKNOWN_SESSION) when it is not live."""
        session = self._sessions.get(session_id)
        if session is None:
            raise PermissionDenied("unknown or closed session: connect through the daemon's handshake",
                                   Reason.UNKNOWN_SESSION)
        session.used = True
        return session

    def _check_instance_and_tenant(self, h: pb.Handle) -> None:
        """Refuse a handle of another daemon instance, or of another tenant of this one."""
        if h.instance_id != self.instance_id:
            raise Unavailable(
                f"handle of daemon instance {h.instance_id!r}, but this daemon is instance {self.instance_id!r}: "
                "it restarted since the handle was made (or the handle is another daemon's), and objects do "
                "not survive a restart",
                Reason.INSTANCE_MISMATCH,
            )
        if h.name != self.segment_name and shm_names.names_another_tenant(self._tenant_base, h.name):
            raise PermissionDenied(f"segment {h.name!r} belongs to another tenant of this daemon")

    def _check_handle(self, h: pb.Handle) -> None:
        """What is checked of every handle before it is looked up: its instance and tenant, and
        for this tenant's arena, its bounds."""
        self._check_instance_and_tenant(h)
        if h.name == self.segment_name and (h.nbytes < 1 or h.offset + h.nbytes > self.allocator.nbytes):
            raise HandleError(
                f"offset {h.offset} + nbytes {h.nbytes} outside the arena of {self.allocator.nbytes} bytes",
                Reason.OUT_OF_BOUNDS,
            )


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"
