"""``Producer``: loan -> write in place -> commit (zero copies), or put (one copy, the digest
fused into it); batches pipeline their commits."""
from __future__ import annotations

from typing import Any, Iterable, NamedTuple, Sequence

import grpc
from google.protobuf.message import Message

from .._backend import kernels
from ..errors import (
    ClosedError,
    HandleError,
    InvalidArgument,
    OwnershipError,
    Reason,
    ResourceExhausted,
    ShmTransportError,
    StateError,
    Unavailable,
)
from ..handle import Handle, Where
from ..objtable import slot_index, wire_slot
from ..tensors import MAX_NBYTES, as_byte_array, dtype_name, tensor_nbytes
from ..v1 import daemon_pb2 as pb
from .session import _as_bytes, _Client
from .table import Placed, TableClient
from .views import Loan

# Below the C kernels' threshold for non-temporal stores (SHMT_NT_MIN_NBYTES) their copy is one
# memcpy in the calling thread, as a memoryview assignment is.
INLINE_COPY_NBYTES = 256 * 1024


class Published(NamedTuple):
    """What ``Producer.publish`` left in the index under an identity."""

    handle: Handle  # the entry's object: the one published, or the one another producer published first
    published: bool  # whether it is the caller's


class Producer(_Client):
    """The frontend's side: ``loan`` (write a tensor in place) or ``put`` (copy one in), ``commit``
    (seal it and hand it off as a ``Handle``), ``release`` (drop this producer's reference).
    Thread-safe; a context manager that closes the session."""

    _writable = True

    def __init__(
        self,
        socket_path: str | None = None,
        *,
        timeout_s: float = 10.0,
        release_delay_s: float = 0.02,
        alloc_wait_s: float = 1.0,
        copy_threads: int | None = None,
        daemon_uid: int | None = None,
    ) -> None:
        """The frontend's side (see ``_Client`` for the connection options). ``alloc_wait_s``:
        how long, in seconds, a loan waits for space when the arena or the quota is full
        (back-pressure) before ResourceExhausted; 0 fails at once. ``copy_threads``: threads that
        ``put`` copies (and hashes) large tensors with; None = all cores, 1 = the calling thread."""
        self._pending_commits: list[grpc.Future[Message]] = []
        self.alloc_wait_s = alloc_wait_s
        self.copy_threads = copy_threads
        super().__init__(socket_path, timeout_s=timeout_s, release_delay_s=release_delay_s, daemon_uid=daemon_uid)

    def loan(self, nbytes: int | None = None, *, shape: Sequence[int] | None = None, dtype: Any = None,
             dedicated: bool = False) -> Loan:
        """Writable shared memory for one tensor: ``loan(nbytes)`` (uint8) or ``loan(shape=, dtype=)``
        (both given, or InvalidArgument)."""
        spec: tuple[str, tuple[int, ...], int]
        if shape is None and dtype is None and type(nbytes) is int and 0 <= nbytes <= MAX_NBYTES:
            spec = ("uint8", (nbytes,), nbytes)  # (_loan_spec's answer, without its frame: a handoff's hot path)
        else:
            spec = _loan_spec(nbytes, shape, dtype)
        if not dedicated:
            loans = self._place([spec])
            if loans is not None:
                return loans[0]
        return self._loan_rpc([spec], dedicated)[0]

    def loan_many(self, specs: Iterable[tuple[int | None, Sequence[int] | None, Any]],
                  *, dedicated: bool = False) -> list[Loan]:
        """Loans for every ``(nbytes, shape, dtype)`` in one RPC (all or nothing).

        ``dedicated``: each loan gets its own daemon-owned segment (handle offset 0) that a stock
        reader may unlink after reading (SMG / vLLM ShmHandle readers); reclaimed like any loan."""
        typed = [_loan_spec(*spec) for spec in specs]
        if not typed:
            raise InvalidArgument("nbytes must not be empty")
        return self._loans(typed, dedicated)

    def _loans(self, typed: list[tuple[str, tuple[int, ...], int]], dedicated: bool) -> list[Loan]:
        if not dedicated:
            loans = self._place(typed)
            if loans is not None:
                return loans
        return self._loan_rpc(typed, dedicated)

    def _loan_rpc(self, typed: list[tuple[str, tuple[int, ...], int]], dedicated: bool) -> list[Loan]:
        """Loans the daemon places (dedicated ones, or with no table or no slot of it free)."""
        request = pb.LoanRequest(
            nbytes=[max(nbytes, 1) for _, _, nbytes in typed], wait_ms=int(self.alloc_wait_s * 1000),
            dedicated=dedicated,
        )
        response = self._call("Loan", request)
        memories = self._map_granted(response.handles, [])
        return [
            Loan(self, Handle(shm, dt, shape), memory[:nbytes])
            for shm, memory, (dt, shape, nbytes) in zip(response.handles, memories, typed)
        ]

    def _place(self, typed: list[tuple[str, tuple[int, ...], int]]) -> list[Loan] | None:
        """Loans placed in this producer's own grants (the object table): no daemon involved
        unless a new grant is needed. None when this session has no table."""
        if self._closed or self._deferred or self._pending_commits:  # what _before_call acts on; else a no-op
            self._before_call("Loan")
        self._conn.ensure_recent()
        with self._lock:
            tables = self._tables
            if tables is None or tables.table is not self._conn.table:  # (_table_client's check, inline)
                tables = self._table_client()
                if tables is None:
                    return None
            try:
                if len(typed) == 1:  # (a handoff's hot path)
                    dt, shape, nbytes = typed[0]
                    placed = [tables.place_one(max(nbytes, 1), dt.encode(), shape, wait_s=self.alloc_wait_s)]
                else:
                    placed = tables.place([(max(nbytes, 1), dt.encode(), shape) for dt, shape, nbytes in typed],
                                          self.alloc_wait_s)
            except ResourceExhausted as exc:
                if exc.reason is not Reason.TABLE_FULL:
                    raise
                return None  # no grant of slots left: the daemon's Loan waits for a slot (back-pressure)
            name, owner, instance = tables.ids
            loans = []
            for obj, (dt, shape, nbytes) in zip(placed, typed):
                # (tuple.__new__: a named tuple's own __new__ is a Python frame more)
                where = tuple.__new__(Where, (name, obj.offset, obj.nbytes, owner, obj.generation, instance,
                                              wire_slot(obj.slot)))
                memory, obj.memory = obj.memory, None
                assert memory is not None
                loans.append(Loan(self, Handle._of(where, obj.wire, dt, shape), memory if nbytes else memory[:0],
                                  (tables, obj)))
            if tables.give_back:
                self._schedule_flush()  # grants this placement let go of go back in the background
            # Nothing else to schedule: a grant can only turn idle once objects in it are released,
            # and a release schedules the background look. (Waking that thread here would put it
            # in the middle of the handoff this loan starts.)
            return loans

    def commit_many(
        self, loans: Sequence[Loan], *, digest: bool = False, hold_ms: int = 0, wait: bool = False, keep: bool = True
    ) -> list[Handle]:
        """Seal loans and return their handles; ``digest`` computes each content digest (XXH3-128
        tree digest, checked by ``Lease.verify``) from shared memory first.

        A committed object is handed off: if this producer closes (or dies) before any consumer
        acquired it, it lives on until a first consumer does, or until the daemon's hand-off
        window passes with nobody acquiring it. ``keep=False`` does the same without closing:
        this producer keeps no reference, and the object belongs to whoever acquires it (the
        way a producer that runs for days hands objects off: nothing of them is left to release).
        With ``keep`` (the default) the producer holds each object until ``release``, which also
        ends the hand-off: the object then lives only as long as consumers that already hold it.
        ``hold_ms``: keep it alive that long whoever acquires or releases it (fan-out to
        consumers that come later).

        Loans in the object table commit in shared memory (no round trip). Other loans send a
        Commit RPC, pipelined unless ``wait`` (a failure raises from this producer's next
        blocking call); a consumer's Acquire waits for a commit still in flight.
        """
        if not loans:
            raise InvalidArgument("loans must not be empty")
        if len(loans) == 1 and not digest and loans[0]._placed is not None and loans[0]._client is self:
            return [self._commit_placed(loans[0], hold_ms, keep)]
        if len({id(loan) for loan in loans}) != len(loans):
            raise InvalidArgument("the same loan appears twice in one commit")
        for loan in loans:
            self._check_committable(loan)
        for loan in loans:
            if digest:
                loan.handle = loan.handle.with_digest(kernels.tree_digest(loan._live_memory()))
        in_table = [(loan, loan._placed) for loan in loans if loan._placed is not None]
        if in_table:
            with self._lock:
                for loan, (tables, placed) in in_table:
                    if not self._live_table(tables):
                        raise Unavailable("the daemon restarted: this loan's bytes are gone", Reason.INSTANCE_MISMATCH)
                    tables.commit(placed, hold_ms)
                    loan.committed = True
                    loan._seal()
                    if not keep:
                        self._let_go(tables, placed)
        rest = [loan for loan in loans if loan._placed is None]
        if rest:
            self._commit_rpc(rest, hold_ms, wait, keep)
        return [loan.handle for loan in loans]

    def _check_committable(self, loan: Loan) -> None:
        if loan._client is not self:
            raise OwnershipError(f"{loan!r} belongs to another Producer")
        if loan._released:
            raise ClosedError(f"{loan!r} was released; it cannot be committed")
        if loan.committed:
            raise StateError(f"{loan!r} is already committed")

    def _commit_placed(self, loan: Loan, hold_ms: int, keep: bool) -> Handle:
        """``commit_many([loan])`` of one loan of the object table, without a digest: the same
        checks, errors and effect in fewer steps (a handoff's hot path). No lock: the commit is
        one atomic step in the table, and a reconnect replaces the table client (a closed one's
        lane refuses with Unavailable)."""
        if loan._client is not self or loan._released or loan.committed:
            self._check_committable(loan)  # (which raises)
        assert loan._placed is not None
        tables, placed = loan._placed
        if tables is not self._tables:
            raise Unavailable("the daemon restarted: this loan's bytes are gone", Reason.INSTANCE_MISMATCH)
        tables.commit(placed, hold_ms)
        loan.committed = True
        loan._seal()
        if not keep:
            with self._lock:
                self._let_go(tables, placed)
        return loan.handle

    def _let_go(self, tables: TableClient, placed: Placed) -> None:
        """Drop this producer's reference to an object it just committed, its hand-off going on
        (lock held); the background look takes its bytes back once it dies."""
        tables.release_own(placed, cancel_handoff=False)
        if tables.give_back or not self._background.pending:
            self._schedule_flush()

    def _commit_rpc(self, loans: Sequence[Loan], hold_ms: int, wait: bool, keep: bool) -> None:
        self._before_call("Commit")
        request = pb.CommitRequest(handles=[loan.handle.shm for loan in loans], hold_ms=hold_ms,
                                   release_reference=not keep)
        self._piggyback(request)
        future = self._conn.call_future("Commit", request)
        with self._lock:
            self._pending_commits.append(future)
        for loan in loans:
            loan.committed = True
        if wait:
            try:
                self._settle_commits(block=True)
            except ShmTransportError:
                for loan in loans:
                    loan.committed = False
                raise
        for loan in loans:
            loan._seal()

    def _before_call(self, method: str) -> None:
        super()._before_call(method)
        # A release must not overtake the commit of the same object; Stat reports settled state.
        self._settle_commits(block=method in ("Release", "Stat", "Publish"))

    def _piggyback(self, request: Message) -> None:
        # A queued release must not overtake the commit of the same object.
        if self._pending.has_handles:
            self._settle_commits(block=True)
        super()._piggyback(request)

    def _settle_commits(self, block: bool) -> None:
        """Raise the first failure among sent commits; wait for all of them when ``block``."""
        if not self._pending_commits:  # (only this producer's own calls add to it)
            return
        with self._lock:
            pending, self._pending_commits = self._pending_commits, []
            failure = None
            for future in pending:
                if not block and not future.done():
                    self._pending_commits.append(future)
                    continue
                try:
                    future.result()
                except grpc.RpcError as err:
                    failure = failure or self._conn.typed(err)
        if failure is not None:
            try:
                raise failure
            finally:
                del failure  # no cycle through this frame (see _Connection.call)

    def close(self) -> None:
        """Wait for commits in flight, then close as ``Consumer.close`` does; committed objects
        nobody acquired yet live on (hand-off), everything else of this session is reclaimed."""
        if not self._closed:
            try:
                self._settle_commits(block=True)
            except Unavailable:
                pass  # the daemon is gone: nothing of ours is left to commit
            finally:
                super().close()

    def put(self, tensor: Any, *, digest: bool = False, hold_ms: int = 0, dedicated: bool = False,
            keep: bool = True) -> Handle:
        """Copy one numpy array or torch tensor (any dtype, C-contiguous or not) into shared memory
        and commit it: one copy, with the content digest fused into it when ``digest``. The
        options are ``commit_many``'s and ``loan_many``'s (``keep=False``: hand the object off
        for good, nothing left to release).

        Raises ResourceExhausted when no space frees within ``alloc_wait_s`` (its reason says
        whether the arena, the tenant's quota or ``/dev/shm`` is short), InvalidArgument for an
        unsupported dtype."""
        return self.put_many([tensor], digest=digest, hold_ms=hold_ms, dedicated=dedicated, keep=keep)[0]

    def put_many(self, tensors: Sequence[Any], *, digest: bool = False, hold_ms: int = 0,
                 dedicated: bool = False, keep: bool = True) -> list[Handle]:
        """``put`` for every tensor, all or nothing, with at most one Loan and one Commit RPC
        (none with the object table)."""
        sources = [as_byte_array(t) for t in tensors]
        if not sources:
            raise InvalidArgument("tensors must not be empty")
        # (as_byte_array checked each dtype and rank; shapes and sizes are numpy's or torch's own)
        loans = self._loans([(dt, shape, src.nbytes) for src, dt, shape in sources], dedicated)
        try:
            for loan, (src, _, _) in zip(loans, sources):
                if digest:
                    loan.handle = loan.handle.with_digest(
                        kernels.copy_tree_digest(loan._live_memory(), src, self.copy_threads))
                elif src.nbytes < INLINE_COPY_NBYTES:
                    loan._live_memory()[:] = src.data  # (one memcpy: the kernel's wrapper costs more than the copy)
                else:
                    kernels.copy(loan._live_memory(), src, self.copy_threads)
            handles = self.commit_many(loans, hold_ms=hold_ms, keep=keep)
        except BaseException:
            self._release_views(loans)
            raise
        for loan in loans:
            loan._detach_views()  # the producer keeps its reference through the handle, not the loan
        return handles

    def publish(self, handle: Handle, identity: str | bytes, *, scope: str | bytes = b"") -> Published:
        """Publish a committed object of this producer's under ``identity`` (1-256 bytes; a str
        counts as its UTF-8) in this tenant's index, where any session of the tenant finds it with
        ``lookup`` (in the same ``scope``: what the identity means, e.g. model and encoder).

        The index then holds the object: it outlives this producer (a restarted process finds it)
        until it is evicted, least recently looked up first, once nobody holds it and the tenant's
        published bytes pass the daemon's ``--cache-size`` (or a loan needs the room). If another
        object was published under the identity first, that one stays and is returned instead
        (``published`` False). Either way this producer's own reference is still its own:
        ``release(handle)`` when done with it, as always.

        Raises OwnershipError (not this producer's object), StateError (not committed, or already
        published), InvalidArgument (identity or scope too long, dtype or shape that do not match
        the handle's size)."""
        request = pb.PublishRequest(scope=_as_bytes(scope), identity=_as_bytes(identity), tensor=handle.to_proto())
        self.flush(strict=False)  # a release queued before must not land after the publish
        response = self._call("Publish", request)
        return Published(Handle.from_proto(response.tensor), response.published)

    def read_bytes(self, handle: Handle) -> bytes:
        """A copy of the bytes of an object of this daemon (e.g. to send it inline after all).
        Raises Unavailable for a handle of another daemon instance."""
        if handle.shm.instance_id != self.instance_id:
            raise Unavailable(f"handle of daemon instance {handle.shm.instance_id!r}, but the daemon is now instance "
                              f"{self.instance_id!r}: it restarted since the handle was made (or the handle is "
                              "another daemon's), and objects do not survive a restart", Reason.INSTANCE_MISMATCH)
        return bytes(self._conn.memory(handle.shm)[:handle.nbytes])

    def release(self, handles: Handle | Iterable[Handle], *, wait: bool = False) -> None:
        """Drop this producer's reference(s); bytes are freed once every consumer that holds
        them released too. Unlike closing, this ends the hand-off (see ``commit_many``).

        Objects of the object table are released at once, in shared memory (a handle released
        twice raises StateError). Others are queued and piggybacked like every release;
        ``wait=True`` sends them now and raises the daemon's verdict (e.g. a double release)."""
        handles = [handles] if isinstance(handles, Handle) else list(handles)
        if self._closed:
            raise ClosedError("Producer is closed")
        if wait and not handles:
            raise InvalidArgument("handles must not be empty")
        handles = self._release_in_table(handles)
        if not handles:
            return
        if wait:
            self.flush(strict=False)
            self._call("Release", pb.ReleaseRequest(handles=[h.shm for h in handles]))
        else:
            self._queue_handles(h.shm for h in handles)

    def _release_in_table(self, handles: list[Handle]) -> list[Handle]:
        """Release the handles of objects this producer placed in the table itself; the others
        (objects the daemon placed for it, or not its own: the daemon answers)."""
        if not any(h.where.slot for h in handles):
            return handles
        self._conn.ensure_recent()
        with self._lock:
            tables = self._tables
            if tables is None or tables.table is not self._conn.table:  # (_table_client's check, inline)
                tables = self._table_client()
            rest = [h for h in handles if not self._release_placed(tables, h)]
            if tables is None or tables.give_back or not self._background.pending:
                self._schedule_flush()  # grants to give back once their objects die (else asked for already)
        return rest

    def _release_placed(self, tables: TableClient | None, h: Handle) -> bool:
        """Drop this producer's reference to the object ``h`` names in its table (lock held);
        False when it is not one this producer placed there (the daemon answers for it)."""
        w = h.where
        if not w.slot:
            return False
        if w.instance_id != (self.instance_id if tables is None else tables.ids[2]):
            raise Unavailable(f"handle of daemon instance {w.instance_id!r}, but the daemon is now instance "
                              f"{self.instance_id!r}: it restarted since the handle was made (or the handle is "
                              "another daemon's), and objects do not survive a restart", Reason.INSTANCE_MISMATCH)
        slot = slot_index(w.slot)
        if tables is None or not 0 <= slot < tables.table.nslots:
            return False
        placed = tables.owned(slot, w.generation)
        if placed is None:
            if tables.placed_by_daemon(slot):
                return False  # (never one of ours: the daemon answers for it)
            if w.owner_id == self._conn.hello.session_id and tables.placed_by_me(slot):
                raise HandleError(f"stale handle: {h!r} was already freed", Reason.STALE_HANDLE)
            raise OwnershipError(f"{h!r} is not an object of this producer")
        if (placed.offset, placed.nbytes) != (w.offset, w.nbytes):
            raise HandleError(f"{h!r} does not match the object in its slot "
                              f"([{placed.offset}, +{placed.nbytes}))", Reason.OUT_OF_BOUNDS)
        tables.release_own(placed, cancel_handoff=True)
        return True


def _loan_spec(nbytes: int | None, shape: Sequence[int] | None, dtype: Any) -> tuple[str, tuple[int, ...], int]:
    if shape is None:
        if nbytes is None or dtype is not None:
            raise InvalidArgument("loan needs nbytes, or shape and dtype")
        n = int(nbytes)
        return "uint8", (n,), n if 0 <= n <= MAX_NBYTES else tensor_nbytes((n,), "uint8")  # (which raises)
    if dtype is None:  # as with numpy.empty, a shape alone would silently mean uint8 here
        raise InvalidArgument("loan(shape=...) needs a dtype too (or loan(nbytes) for raw bytes)")
    name = dtype_name(dtype)
    shape = tuple(int(d) for d in shape)
    size = tensor_nbytes(shape, name)
    if nbytes is not None and nbytes != size:
        raise InvalidArgument(f"nbytes={nbytes} does not match shape {shape} of {name} ({size} bytes)")
    return name, shape, size
