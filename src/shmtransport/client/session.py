"""What a producer and a consumer share: one session, its release queue and the background
thread that sends it, deferred releases (views still alive), grants going back, and close."""
from __future__ import annotations

import collections
import logging
import sys
import threading
import warnings
from types import TracebackType
from typing import Iterable, Literal, Sequence, TypeGuard, TypeVar, overload

from google.protobuf.message import Message

from .._delayed import DelayedCall
from ..errors import ClosedError, InvalidArgument, ShmTransportError, Unavailable
from ..handle import Handle
from ..v1 import daemon_pb2 as pb
from ..wire import default_socket_path
from .connection import _Connection
from .releases import PendingReleases
from .table import TableClient
from .views import Lease, Loan, View

_log = logging.getLogger("shmtransport.client")
_C = TypeVar("_C", bound="_Client")


class _Client:
    """Shared by Producer and Consumer: the connection, and releases that cost no round trip.

    A release is queued and sent with this client's next Loan/Commit/Acquire (piggybacked), or on
    its own after ``release_delay_s`` if no call comes first, or at once with ``flush()``. A release
    whose views are still held by the caller waits until they are dropped.
    """

    _writable = False
    MAX_QUEUED_RELEASES = 256
    GRANT_RETURN_DELAY_S = 0.1  # how often a producer with grants looks for ones to give back

    def __init__(self, socket_path: str | None = None, *, timeout_s: float = 10.0, release_delay_s: float = 0.02,
                 daemon_uid: int | None = None) -> None:
        """Connect to the daemon at ``socket_path`` (default: ``$SHMTRANSPORT_SOCKET``, else the
        per-user path ``shmtransport daemon`` listens on) and start a session.

        ``timeout_s``: the deadline of every RPC, in seconds. ``release_delay_s``: how long a
        queued release may wait for a call to piggyback on before it is sent on its own.
        ``daemon_uid``: the uid the daemon must run as (default: this process's own; root is
        always accepted); a process at the socket running as anyone else is refused.

        Raises Unavailable (no daemon, or not the expected uid), ResourceExhausted (too few file
        descriptors left for a connection)."""
        self._conn = _Connection(socket_path or default_socket_path(), timeout_s, self._writable, daemon_uid)
        self._release_delay_s = release_delay_s
        self._lock = threading.RLock()
        self._flush_lock = threading.Lock()  # one flush at a time: flush() returns when all landed
        self._deferred: list[View] = []  # released by the caller, views still alive
        self._collected: collections.deque[View] = collections.deque()  # dropped unreleased
        self._pending = PendingReleases()
        self._background = DelayedCall(self._flush_quietly, name=f"shmt-{type(self).__name__.lower()}-releases")
        self._closed = False
        self._tables: TableClient | None = None  # this session's side of the object table
        self._conn.ensure()

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called."""
        return self._closed

    @property
    def instance_id(self) -> str:
        """The daemon instance this client is connected to (a restarted daemon has a new one; its
        predecessor's handles are refused)."""
        return self._conn.instance_id

    @property
    def socket_path(self) -> str:
        """The daemon socket this client connects to."""
        return self._conn.socket_path

    @property
    def shm_namespace(self) -> str:
        """The id of the /dev/shm the daemon's segments live in (as it advertised at the
        handshake): equal ids mean a handle's bytes can be mapped here."""
        self._conn.ensure()
        return self._conn.hello.shm_namespace

    def arena_view(self) -> memoryview | None:
        """The whole arena as this client maps it (read-only for a Consumer), e.g. to register it
        once with a GPU runtime for DMA; None until connected to a daemon with an arena. A handle's
        bytes are at ``[handle.shm.offset, + handle.nbytes)``."""
        self._conn.ensure()
        mapping = self._conn.mapping
        return None if mapping is None else mapping.view(0, mapping.nbytes)

    @property
    def session_id(self) -> str:
        """This client's session with the daemon (as Stat and List name it)."""
        self._conn.ensure()
        return self._conn.hello.session_id

    def stat(self) -> pb.StatResponse:
        """The daemon's counters (arena, quotas, sessions, reclaims) as ``shmtransport stat``
        shows them; queued releases are sent first so the numbers include them."""
        self.flush(strict=False)
        return self._call("Stat", pb.StatRequest())

    def list_objects(self, *, limit: int = 0) -> pb.ListResponse:
        """Every live object of this client's tenant, largest first (at most ``limit``; 0: the
        daemon's cap), with its state, producer and holders (``shmtransport ls``)."""
        self.flush(strict=False)
        return self._call("List", pb.ListRequest(limit=limit))

    def lookup(self, identities: Sequence[str | bytes], *, scope: str | bytes = b"") -> list[Handle | None]:
        """The object published under each identity in this tenant's index (``Producer.publish``),
        or None: one round trip for the batch. A hit is a hint, not a hold: acquire the handle to
        use the object. An entry nobody holds may be evicted meanwhile; that acquire then raises
        HandleError (STALE_HANDLE), which is a miss. ``scope``: the one it was published in."""
        if not identities:
            raise InvalidArgument("identities must not be empty")
        request = pb.LookupRequest(scope=_as_bytes(scope), identities=[_as_bytes(i) for i in identities])
        found = self._call("Lookup", request).tensors
        return [Handle.from_proto(t) if t.HasField("shm") else None for t in found]

    def flush(self, *, strict: bool = True) -> None:
        """Send every queued release now (one RPC per batch). Returns once every release queued
        before the call has been applied, whichever thread sent it. ``strict``: daemon-side errors
        (e.g. a lease that already expired) raise here; otherwise such entries are skipped."""
        with self._flush_lock:
            self._release_collected()
            if self._deferred:
                self._requeue_deferred(force=False)  # releases whose views are gone by now
            while True:
                with self._lock:
                    request = self._take_queued()
                if request is None:
                    return
                request.skip_gone = not strict
                self._call("Release", request)

    # -- internals -------------------------------------------------------------------------------
    def _table_client(self) -> TableClient | None:
        """This connection's object-table client (lock held), rebuilt after a reconnect; None when
        objects go through the daemon (no table, no bit, or no C kernels)."""
        table, bit = self._conn.table, self._conn.holder_bit
        if table is None or bit is None:  # set together
            self._tables = None
            return None
        if self._tables is None or self._tables.table is not table:
            hello, mapping = self._conn.hello, self._conn.mapping
            if mapping is None:  # (set with the table; gone together with it)
                return None
            info = hello.object_table
            self._tables = TableClient(table, bit, mapping, (mapping.name, hello.session_id, hello.instance_id),
                                       hello.arena_nbytes, info.handoff_window_ms, info.max_hold_ms, self._grant)
        return self._tables

    def _grant(self, nbytes: int, nslots: int, give_back: list[int], wait_ms: int, retry: bool) -> pb.GrantResponse:
        """The Grant RPC, from a placement (lock held once). One that may wait for space lets this
        producer's other threads in meanwhile: their releases may be the room it waits for."""
        request = pb.GrantRequest(nbytes=nbytes, nslots=nslots, wait_ms=wait_ms, give_back=give_back, retry=retry)
        if not wait_ms:
            return self._call("Grant", request)
        self._lock.release()
        try:
            return self._call("Grant", request)
        finally:
            self._lock.acquire()

    def _live_table(self, tables: TableClient | None) -> TypeGuard[TableClient]:
        """Whether a view's object-table client still speaks for this connection (after a daemon
        restart its objects are gone with the daemon: nothing is left to release)."""
        return tables is not None and tables is self._tables and tables.table is self._conn.table

    @overload
    def _call(self, method: Literal["Loan"], request: pb.LoanRequest) -> pb.LoanResponse: ...
    @overload
    def _call(self, method: Literal["Grant"], request: pb.GrantRequest) -> pb.GrantResponse: ...
    @overload
    def _call(self, method: Literal["Commit"], request: pb.CommitRequest) -> pb.CommitResponse: ...
    @overload
    def _call(self, method: Literal["Acquire"], request: pb.AcquireRequest) -> pb.AcquireResponse: ...
    @overload
    def _call(self, method: Literal["Release"], request: pb.ReleaseRequest) -> pb.ReleaseResponse: ...
    @overload
    def _call(self, method: Literal["Stat"], request: pb.StatRequest) -> pb.StatResponse: ...
    @overload
    def _call(self, method: Literal["List"], request: pb.ListRequest) -> pb.ListResponse: ...
    @overload
    def _call(self, method: Literal["Close"], request: pb.CloseRequest) -> pb.CloseResponse: ...
    @overload
    def _call(self, method: Literal["Publish"], request: pb.PublishRequest) -> pb.PublishResponse: ...
    @overload
    def _call(self, method: Literal["Lookup"], request: pb.LookupRequest) -> pb.LookupResponse: ...

    def _call(self, method: str, request: Message) -> Message:
        """The RPC ``method`` (its request message answers its response message)."""
        self._before_call(method)
        if method != "Release":
            self._piggyback(request)
        return self._conn.call(method, request)

    def _before_call(self, method: str) -> None:
        if self._closed:
            raise ClosedError(f"{type(self).__name__} is closed")
        if self._deferred:
            self._requeue_deferred(force=False)

    def _piggyback(self, request: Message) -> None:
        if not hasattr(request, "release"):
            return
        with self._lock:
            queued = self._take_queued()
        if queued is not None:
            request.release.CopyFrom(queued)

    def _take_queued(self) -> pb.ReleaseRequest | None:
        """Up to one batch of queued releases (lock held). The background send is called off
        when this took the last one; not when none was queued, since a run may be scheduled
        for deferred releases or grants."""
        request = self._pending.take()
        if request is not None and not self._pending:
            self._background.cancel()
        return request

    def _map_granted(self, shms: Sequence[pb.Handle], lease_ids: Sequence[int]) -> list[memoryview]:
        """The memory of every loan (no ``lease_ids``) or lease the daemon just granted; when one
        cannot be mapped, all of them are given back (queued) before the error propagates."""
        try:
            return [self._conn.memory(shm) for shm in shms]
        except BaseException:
            with self._lock:
                if lease_ids:
                    self._pending.add_lease_ids(lease_ids)
                else:
                    self._pending.add_handles(shms)
                self._schedule_flush()
            raise

    def _collected_unreleased(self, view: View) -> None:
        """A finalizer's hand-off (see ``View.__del__``): lock-free, released by the next flush.
        Not while the interpreter shuts down: no RPC then, and the daemon reclaims the session."""
        if not self._closed and not sys.is_finalizing():
            self._collected.append(view)  # keeps the view until then
            self._background.within(0.0)

    def _release_collected(self) -> None:
        while self._collected:
            view = self._collected.popleft()
            if not view._released:
                self._release_views([view])

    def _release_views(self, views: Sequence[View]) -> None:
        """Queue the release, or defer it while the caller still holds a view of the bytes."""
        with self._lock:
            for view in views:
                view._detach_views()
                if view._views_alive():
                    self._deferred.append(view)
                else:
                    self._queue(view)
            self._schedule_flush()

    def _queue(self, view: View) -> None:
        """Release one view's hold (lock held): in the object table at once, else queued for the
        daemon."""
        view._forget_memory()
        if isinstance(view, Lease):
            if view._table is not None:
                if self._live_table(view._table):
                    try:
                        view._table.release_lease(*view._slot_key)
                    except Unavailable:
                        pass  # the session ended meanwhile: its holds went with it
            else:
                self._pending.add_lease_ids((view.lease_id,))
        elif isinstance(view, Loan) and view._placed is not None:
            tables, placed = view._placed
            if self._live_table(tables) and placed.held:
                tables.release_own(placed, cancel_handoff=True)
        else:
            self._pending.add_handles((view.handle.shm,))

    def _queue_handles(self, handles: Iterable[pb.Handle]) -> None:
        with self._lock:
            self._pending.add_handles(handles)
            self._schedule_flush()

    def _schedule_flush(self) -> None:
        """Ask the background thread for a flush: at once when many releases are queued, after
        ``release_delay_s`` for a few, now and then while grants may go back (lock held)."""
        queued = len(self._pending)
        if queued >= self.MAX_QUEUED_RELEASES:
            self._background.within(0.0)
        elif queued or self._deferred:
            self._background.within(self._release_delay_s)
        elif (tables := self._tables) is not None and tables.give_back and self._live_table(tables):
            self._background.within(0.0)
        elif not self._background.pending and self._surplus_grants() is not None:
            # (a run already asked for reschedules itself while grants remain to look at)
            self._background.within(self.GRANT_RETURN_DELAY_S)

    def _flush_quietly(self) -> None:
        """Background path: nobody is there to catch an error, so log it."""
        with self._lock:
            if self._closed:
                return
            if self._deferred:
                self._requeue_deferred(force=False)
        try:
            self.flush(strict=False)
            self._return_grants()
        except Unavailable:
            pass  # the daemon is gone, and with it everything this client held
        except Exception:
            _log.exception("background release failed")
        with self._lock:
            if not self._closed:
                self._schedule_flush()  # grants whose last objects are still held: look again later

    def _surplus_grants(self) -> TableClient | None:
        """This session's object-table client, when it has grants to give back (or may soon)."""
        tables = self._tables
        return tables if self._live_table(tables) and tables.has_surplus else None

    def _return_grants(self) -> None:
        """Collect dead objects, give back the grants queued for return (idle ones included)
        (background). The return is sent under the lock: a placement's Grant must not reach the
        daemon before the returns it took out of the queue (it would find their space taken)."""
        with self._lock:
            tables = self._surplus_grants()
            if tables is None:
                return
            tables.collect()
            give_back, tables.give_back = tables.give_back, []
            if give_back:
                self._before_call("Grant")
                self._conn.call("Grant", pb.GrantRequest(give_back=give_back), reconnect=False)

    def _requeue_deferred(self, force: bool) -> None:
        with self._lock:
            still, self._deferred = self._deferred, []
            for view in still:
                if view._views_alive() and not force:
                    self._deferred.append(view)
                    continue
                if view._views_alive():
                    warnings.warn(f"releasing {view!r} while a view of it is still alive", ResourceWarning, 2)
                self._queue(view)
            self._schedule_flush()

    def close(self) -> None:
        """Send what is queued (deferred ones too) and end the session; the daemon releases the
        rest (counted as released at close, not as reclaimed from a death). Committed objects
        nobody acquired yet live on (hand-off). Idempotent."""
        if self._closed:
            return
        try:
            self._release_collected()
            self._requeue_deferred(force=True)
            self.flush(strict=False)
            give_back: list[int] = []
            with self._lock:
                # A session already gone (the daemon stopped or restarted) was reclaimed whole.
                if self._live_table(self._tables) and self._conn.alive():
                    # Leases and producer references; committed objects keep their hand-off bit.
                    self._tables.release_all()
                    give_back = self._tables.give_back_all()
            if give_back:  # at once, so the daemon's books are exact when close returns
                self._conn.call("Grant", pb.GrantRequest(give_back=give_back), reconnect=False)
            if self._conn.alive():
                self._conn.call("Close", pb.CloseRequest(), reconnect=False)
        except Unavailable:
            pass
        finally:
            with self._lock:
                self._closed = True
            self._background.stop()  # outside the lock: a background flush in progress needs it
            self._conn.disconnect()

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # an error is already propagating: closing must not replace it
            self.close()
        except ShmTransportError as close_error:
            _log.warning("closing %r after %s failed: %s", self, exc_type.__name__, close_error)

    def __repr__(self) -> str:
        if not hasattr(self, "_conn"):
            return f"{type(self).__name__}(not connected)"
        state = "closed" if self._closed else f"instance={self.instance_id}"
        return f"{type(self).__name__}({self._conn.socket_path!r}, {state})"


def _as_bytes(text: str | bytes) -> bytes:
    """An identity or scope as the daemon compares it: a str as its UTF-8 bytes."""
    return text.encode() if isinstance(text, str) else bytes(text)
