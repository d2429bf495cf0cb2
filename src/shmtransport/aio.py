"""asyncio clients: ``AsyncProducer`` and ``AsyncConsumer``, the sync ``Producer`` and ``Consumer``
with every call awaited and run in a small per-client thread pool, so the event loop never waits
on the daemon, on a loan's back-pressure or on a copy.

Constructing a client does no I/O; the session handshake happens, in a worker thread, at
``connect()``, at ``async with`` or at the first call, whichever comes first. The objects calls
return are the sync client's own ``Loan``, ``Lease`` and ``Handle``.

A call whose awaiting task is cancelled before a worker took it is dropped (a release is not: it
still happens). One already running keeps running (a blocking call cannot be interrupted); once
it returns, what it returned is released in the worker: loans given back, handles released by
the producer, leases released. ``close`` waits for calls in flight and for those releases, so it
leaves nothing of theirs behind either.

The sync clients are thread-safe (one re-entrant lock each), so concurrent tasks may share one
client. A client belongs to one event loop.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, Generic, TypeVar

from . import _call_sites
from .client import Consumer, Handle, Lease, Loan, Producer
from .client.session import _Client
from .errors import ClosedError, InvalidArgument, ShmTransportError, Unavailable
from .v1 import daemon_pb2 as pb

__all__ = ["AsyncConsumer", "AsyncProducer"]

_log = logging.getLogger("shmtransport.aio")

DEFAULT_WORKER_THREADS = 4
_T = TypeVar("_T")
_C = TypeVar("_C", bound=_Client)  # the sync client
_A = TypeVar("_A", bound="_AsyncClient[Any]")


class _Handover:
    """Who disposes of a call's result: the task awaiting it, or, once that task is cancelled,
    an undo. Decided under a lock because the worker and the loop race for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._delivered = False
        self._abandoned = False

    def deliver(self) -> bool:
        """Worker, the call returned: whether the awaiting task still wants the result."""
        with self._lock:
            self._delivered = not self._abandoned
            return self._delivered

    def abandon(self) -> bool:
        """Loop, the task was cancelled: whether the result was delivered already, so the
        canceller must undo it (otherwise the worker does, or the call raised)."""
        with self._lock:
            self._abandoned = True
            return self._delivered


def _release_views(views: Iterable[Loan | Lease]) -> None:
    for view in views:
        view.release()


def _undo(undo: Callable[[Any], None], result: Any) -> None:
    """Run ``undo`` in a worker; nobody awaits it, so its failure is logged."""
    try:
        undo(result)
    except Unavailable:
        pass  # the daemon is gone, and with it what the call returned
    except Exception:  # noqa: BLE001 - nobody awaits an undo: log whatever it raises
        _log.exception("could not release what a cancelled call returned")


class _AsyncClient(Generic[_C]):
    """Shared by AsyncProducer and AsyncConsumer: the worker threads, the lazy connection,
    cancellation and close."""

    def __init__(self, socket_path: str | None, options: dict[str, Any], worker_threads: int) -> None:
        if worker_threads < 1:
            raise InvalidArgument(f"worker_threads must be at least 1, got {worker_threads}")
        self._socket_path = socket_path
        self._options = options
        self._executor = concurrent.futures.ThreadPoolExecutor(
            worker_threads, thread_name_prefix=f"shmtransport.{type(self).__name__}")
        self._connect_lock = threading.Lock()  # concurrent first calls make one session
        self._client: _C | None = None
        self._closed = False
        self._closing: asyncio.Future[None] | None = None
        self._running = 0  # calls not yet settled: returned, raised, or their result handed to an undo
        self._settled = asyncio.Event()
        self._settled.set()

    def _connect(self) -> _C:
        raise NotImplementedError

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called."""
        return self._closed

    @property
    def instance_id(self) -> str:
        """The daemon instance this client is connected to; empty before it connects."""
        return self._client.instance_id if self._client is not None else ""

    async def connect(self: _A) -> _A:
        """Connect now (the session handshake, in a worker thread) rather than at the first call;
        returns this client. Raises Unavailable (no daemon, or not the expected uid),
        ResourceExhausted (too few file descriptors), ClosedError."""
        await self._run(lambda client: None)
        return self

    async def stat(self) -> pb.StatResponse:
        """The daemon's counters, as ``Producer.stat`` (``shmtransport.v1.StatResponse``);
        queued releases are sent first. Raises Unavailable, ClosedError."""
        return await self._run(lambda client: client.stat())

    async def list_objects(self, *, limit: int = 0) -> pb.ListResponse:
        """Every live object of this client's tenant, largest first (at most ``limit``; 0: the
        daemon's cap), as ``Producer.list_objects``. Raises Unavailable, ClosedError."""
        return await self._run(lambda client: client.list_objects(limit=limit))

    async def flush(self, *, strict: bool = True) -> None:
        """Send every queued release now; returns once they have been applied. ``strict``:
        daemon-side errors (e.g. a lease that already expired) raise here (HandleError,
        StateError); otherwise such entries are skipped. Raises Unavailable, ClosedError."""
        await self._run(lambda client: client.flush(strict=strict))

    async def close(self) -> None:
        """Wait for the calls in flight (and the releases of cancelled ones), then close the
        session as the sync ``close`` does and stop the worker threads. Idempotent; cancelling
        the awaiting task does not stop the close. Raises what the sync ``close`` raises (to the
        first caller; later ones only wait for it)."""
        if self._closing is None:
            self._closed = True
            self._closing = asyncio.ensure_future(self._close())
            await asyncio.shield(self._closing)
        else:
            await asyncio.wait([self._closing])

    async def _close(self) -> None:
        await self._settled.wait()  # from now on no call or undo is submitted
        await asyncio.to_thread(self._shut_down)

    def _shut_down(self) -> None:
        self._executor.shutdown(wait=True)  # calls whose tasks were cancelled, and their undos
        if self._client is not None:
            self._client.close()

    async def _run(self, call: Callable[[_C], _T], undo: Callable[[_T], None] | None = None, *,
                   droppable: bool = True) -> _T:
        """``call(sync client)`` in a worker thread; its result or its exception. If the awaiting
        task is cancelled, a call no worker took yet is dropped (unless not ``droppable``: a
        release must happen), and a running one finishes: ``undo(result)`` then runs in a worker."""
        if self._closed:
            raise ClosedError(f"{type(self).__name__} is closed")
        handover = _Handover()
        self._running += 1
        self._settled.clear()
        try:
            site = _call_sites.caller() if _call_sites.enabled else None  # the awaiting coroutine's line
            job = self._executor.submit(self._call_in_worker, call, undo, handover, site)
            outcome = asyncio.wrap_future(job)  # cancelling it cancels a job not started yet
            try:
                return await (outcome if droppable else asyncio.shield(outcome))
            except asyncio.CancelledError:
                # A job that returned before this task could resume hands its result over here.
                if undo is not None and not job.cancel() and handover.abandon():
                    self._executor.submit(lambda: _undo(undo, job.result()))
                raise
        finally:
            self._running -= 1
            if not self._running:
                self._settled.set()

    def _call_in_worker(self, call: Callable[[_C], _T], undo: Callable[[_T], None] | None,
                        handover: _Handover, site: str | None) -> _T:
        with _call_sites.attributed_to(site):
            result = call(self._connected())
        if undo is not None and not handover.deliver():
            _undo(undo, result)  # the task was cancelled while the call ran
        return result

    def _connected(self) -> _C:
        """The sync client, connecting it on first use (worker thread)."""
        with self._connect_lock:
            if self._client is None:
                self._client = self._connect()
            return self._client

    async def __aenter__(self: _A) -> _A:
        try:
            return await self.connect()
        except BaseException:
            await self.close()
            raise

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if exc_type is None:
            await self.close()
            return
        try:  # an error is already propagating: closing must not replace it
            await self.close()
        except ShmTransportError as close_error:
            _log.warning("closing %r after %s failed: %s", self, exc_type.__name__, close_error)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"instance={self.instance_id or 'not connected'}"
        return f"{type(self).__name__}({self._socket_path!r}, {state})"


class AsyncProducer(_AsyncClient[Producer]):
    """The frontend's side for asyncio code: ``await`` the calls of ``Producer`` (``loan``,
    ``put``, ``commit``, ``release``...); an async context manager that closes the session.
    Returns the sync ``Loan`` and ``Handle`` objects."""

    def __init__(
        self,
        socket_path: str | None = None,
        *,
        timeout_s: float = 10.0,
        release_delay_s: float = 0.02,
        alloc_wait_s: float = 1.0,
        copy_threads: int | None = None,
        daemon_uid: int | None = None,
        worker_threads: int = DEFAULT_WORKER_THREADS,
    ) -> None:
        """No I/O: the session starts at ``connect()``, ``async with`` or the first call. The
        options are ``Producer``'s (``timeout_s``, ``release_delay_s``, ``alloc_wait_s`` in
        seconds); ``worker_threads``: how many calls of this client run at once (more wait
        their turn; a loan waiting for space holds one for up to ``alloc_wait_s``). Raises
        InvalidArgument for fewer than 1 worker thread."""
        options = {"timeout_s": timeout_s, "release_delay_s": release_delay_s, "alloc_wait_s": alloc_wait_s,
                   "copy_threads": copy_threads, "daemon_uid": daemon_uid}
        super().__init__(socket_path, options, worker_threads)

    def _connect(self) -> Producer:
        return Producer(self._socket_path, **self._options)

    async def loan(self, nbytes: int | None = None, *, shape: Sequence[int] | None = None, dtype: Any = None,
                   dedicated: bool = False) -> Loan:
        """Writable shared memory for one tensor: ``loan(nbytes)`` (uint8) or ``loan(shape=,
        dtype=)``; waits up to ``alloc_wait_s`` for space without blocking the loop. Raises
        ResourceExhausted (no space in time), InvalidArgument (a bad spec), Unavailable,
        ClosedError. Cancelled: the loan is given back once it is made."""
        return (await self.loan_many([(nbytes, shape, dtype)], dedicated=dedicated))[0]

    async def loan_many(self, specs: Iterable[tuple[int | None, Sequence[int] | None, Any]], *,
                        dedicated: bool = False) -> list[Loan]:
        """Loans for every ``(nbytes, shape, dtype)``, all or nothing, as ``Producer.loan_many``
        (``dedicated``: each in its own segment). Raises as ``loan``."""
        specs = list(specs)
        return await self._run(lambda client: client.loan_many(specs, dedicated=dedicated), _release_views)

    async def put(self, tensor: Any, *, digest: bool = False, hold_ms: int = 0, dedicated: bool = False,
                  keep: bool = True) -> Handle:
        """Copy one numpy array or torch tensor into shared memory (in a worker thread: leave it
        unmodified until this returns) and commit it, as ``Producer.put``; ``hold_ms`` in
        milliseconds, ``keep=False`` hands it off for good. Raises ResourceExhausted (no space
        within ``alloc_wait_s``), InvalidArgument (unsupported dtype), Unavailable, ClosedError.
        Cancelled: the object is released once it is committed (with ``keep``)."""
        return (await self.put_many([tensor], digest=digest, hold_ms=hold_ms, dedicated=dedicated, keep=keep))[0]

    async def put_many(self, tensors: Sequence[Any], *, digest: bool = False, hold_ms: int = 0,
                       dedicated: bool = False, keep: bool = True) -> list[Handle]:
        """``put`` for every tensor, all or nothing, as ``Producer.put_many``. Raises as ``put``."""
        tensors = list(tensors)
        return await self._run(
            lambda client: client.put_many(tensors, digest=digest, hold_ms=hold_ms, dedicated=dedicated, keep=keep),
            lambda handles: self._connected().release(handles) if keep else None)

    async def commit(self, loan: Loan, *, digest: bool = False, hold_ms: int = 0, wait: bool = False,
                     keep: bool = True) -> Handle:
        """``loan.commit(...)`` in a worker thread (a digest hashes the bytes; ``wait`` waits
        for the daemon): seal the loan and return its handle. Raises as ``commit_many``."""
        return (await self.commit_many([loan], digest=digest, hold_ms=hold_ms, wait=wait, keep=keep))[0]

    async def commit_many(self, loans: Sequence[Loan], *, digest: bool = False, hold_ms: int = 0,
                          wait: bool = False, keep: bool = True) -> list[Handle]:
        """Seal loans and return their handles, as ``Producer.commit_many`` (``hold_ms`` in
        milliseconds). Raises InvalidArgument (no loans, or one twice), OwnershipError (another
        producer's loan), ClosedError (a released loan, or this client closed), StateError
        (already committed), Unavailable. Cancelled: once committed, the loans are released
        (``loan.release()``, which is also right for a loan the cancellation left uncommitted)."""
        loans = list(loans)
        return await self._run(
            lambda client: client.commit_many(loans, digest=digest, hold_ms=hold_ms, wait=wait, keep=keep),
            lambda handles: _release_views(loans))

    async def release(self, handles: Handle | Iterable[Handle], *, wait: bool = False) -> None:
        """Drop this producer's reference(s), as ``Producer.release``; ``wait=True`` sends them
        now and raises the daemon's verdict (StateError for a double release, HandleError,
        OwnershipError). Raises ClosedError. Cancelled: the release still happens."""
        handles = [handles] if isinstance(handles, Handle) else list(handles)
        await self._run(lambda client: client.release(handles, wait=wait), droppable=False)


class AsyncConsumer(_AsyncClient[Consumer]):
    """The worker's side for asyncio code: ``await`` the calls of ``Consumer`` (``acquire``,
    ``release``...); an async context manager that closes the session. Returns the sync
    ``Lease`` objects."""

    def __init__(
        self,
        socket_path: str | None = None,
        *,
        timeout_s: float = 10.0,
        release_delay_s: float = 0.02,
        daemon_uid: int | None = None,
        worker_threads: int = DEFAULT_WORKER_THREADS,
    ) -> None:
        """No I/O: the session starts at ``connect()``, ``async with`` or the first call. The
        options are ``Consumer``'s (``timeout_s``, ``release_delay_s`` in seconds);
        ``worker_threads``: how many calls of this client run at once. Raises InvalidArgument
        for fewer than 1 worker thread."""
        options = {"timeout_s": timeout_s, "release_delay_s": release_delay_s, "daemon_uid": daemon_uid}
        super().__init__(socket_path, options, worker_threads)

    def _connect(self) -> Consumer:
        return Consumer(self._socket_path, **self._options)

    async def acquire(self, handle: Handle, *, ttl_ms: int = 0) -> Lease:
        """A read-only lease on the object ``handle`` names, as ``Consumer.acquire`` (``ttl_ms``
        in milliseconds; 0: the daemon's default). Raises HandleError (stale, forged or
        out-of-bounds handle), PermissionDenied (another tenant's object), Unavailable (another
        daemon instance's handle), InvalidArgument (not a Handle), ClosedError. Cancelled: the
        lease is released once it is taken."""
        return (await self.acquire_many([handle], ttl_ms=ttl_ms))[0]

    async def acquire_bytes(self, data: bytes, *, ttl_ms: int = 0) -> Lease:
        """``acquire(Handle.from_bytes(data))``, as ``Consumer.acquire_bytes`` (one native call for
        an object of this tenant's object table). Raises as ``acquire``."""
        return (await self._run(lambda client: [client.acquire_bytes(data, ttl_ms=ttl_ms)], _release_views))[0]

    async def acquire_many(self, handles: Sequence[Handle], *, ttl_ms: int = 0) -> list[Lease]:
        """``acquire`` for every handle, all or nothing, as ``Consumer.acquire_many``. Raises as
        ``acquire``."""
        handles = list(handles)
        return await self._run(lambda client: client.acquire_many(handles, ttl_ms=ttl_ms), _release_views)

    async def release(self, leases: Lease | Iterable[Lease], *, wait: bool = False) -> None:
        """Release one lease or many, as ``Consumer.release``; ``wait=True`` sends them now and
        raises the daemon's verdict. Raises OwnershipError (another consumer's lease),
        ClosedError. Cancelled: the release still happens."""
        leases = [leases] if isinstance(leases, Lease) else list(leases)
        await self._run(lambda client: client.release(leases, wait=wait), droppable=False)
