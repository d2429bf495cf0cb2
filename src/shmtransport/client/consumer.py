"""``Consumer``: acquire -> zero-copy read-only views -> release."""
from __future__ import annotations

from typing import Iterable, Sequence

from .. import arena
from ..errors import (
    HandleError,
    InvalidArgument,
    OwnershipError,
    Reason,
    Unavailable,
)
from ..handle import Handle
from ..objtable import slot_index
from ..tensors import tensor_nbytes
from ..v1 import daemon_pb2 as pb
from . import table
from .session import _Client
from .table import TableClient
from .views import Lease


class Consumer(_Client):
    """The worker's side: ``acquire`` a ``Handle`` for a zero-copy read-only ``Lease``, ``release``
    it when the model is done with the bytes. Thread-safe; a context manager that closes the
    session."""

    _writable = False

    def acquire(self, handle: Handle, *, ttl_ms: int = 0) -> Lease:
        """A read-only lease on the object ``handle`` names: ``lease.array`` (numpy) and
        ``lease.tensor()`` (torch) are zero-copy views, valid until ``release``. ``ttl_ms``: the
        daemon takes the lease back after that many milliseconds (0: the daemon's default).

        Raises HandleError (stale, forged or out-of-bounds handle), PermissionDenied (another
        tenant's object), Unavailable (a handle of another daemon instance), InvalidArgument
        (not a Handle, or its shape and dtype do not match its size)."""
        return self.acquire_many([handle], ttl_ms=ttl_ms)[0]

    def acquire_many(self, handles: Sequence[Handle], *, ttl_ms: int = 0) -> list[Lease]:
        """``acquire`` for every handle, all or nothing, in at most one RPC (none for objects
        in this tenant's object table)."""
        handles = list(handles)
        if not handles:
            raise InvalidArgument("handles must not be empty")
        for h in handles:
            if not isinstance(h, Handle):
                raise InvalidArgument(f"acquire takes Handle objects (Handle.from_bytes turns the wire form into "
                                      f"one), got {type(h).__name__}")
        self._conn.ensure_recent()  # a daemon restart is noticed before handles are compared with it
        if any(h.shm.instance_id != self.instance_id for h in handles):
            # A handle of another instance: maybe of a daemon that restarted since the last
            # liveness check. Check the connection now (it reconnects if so), then compare.
            self._conn.ensure()
        for h in handles:
            if h.shm.instance_id != self.instance_id:
                # Checked by the daemon too; failing early avoids mapping a foreign segment.
                raise Unavailable(
                    f"handle of daemon instance {h.shm.instance_id!r}, but the daemon is now instance "
                    f"{self.instance_id!r}: it restarted since the handle was made (or the handle is another "
                    "daemon's), and objects do not survive a restart",
                    Reason.INSTANCE_MISMATCH,
                )
        sizes = [_check_manifest(h) for h in handles]
        leases: dict[int, Lease] = {}  # by index in handles
        if self._deferred:
            self._requeue_deferred(force=False)  # releases whose views are gone by now
        with self._lock:
            tables = self._table_client()
            if tables is not None:
                self._acquire_in_table(tables, handles, sizes, leases)
        rest = [i for i in range(len(handles)) if i not in leases]
        if not rest:
            return [leases[i] for i in range(len(handles))]
        try:
            request = pb.AcquireRequest(handles=[handles[i].shm for i in rest], ttl_ms=ttl_ms)
            if any(handles[i].commit_token for i in rest):
                request.commit_tokens.extend(handles[i].commit_token for i in rest)
            response = self._call("Acquire", request)
            memories = self._map_granted([handles[i].shm for i in rest], response.lease_ids)
        except BaseException:
            self._release_views(list(leases.values()))
            raise
        for i, memory, lease_id in zip(rest, memories, response.lease_ids):
            leases[i] = Lease(self, handles[i], memory[:sizes[i]], lease_id)
        return [leases[i] for i in range(len(handles))]

    def acquire_bytes(self, data: bytes, *, ttl_ms: int = 0) -> Lease:
        """``acquire(Handle.from_bytes(data))``: the handle's wire form, as ``Handle.to_bytes``
        wrote it, straight to a lease. An object of this tenant's object table is read, checked
        and held in one native call; anything else takes ``acquire``'s path, and raises as it does."""
        data = bytes(data)
        if not data:  # (protobuf parses b"" as an empty handle, of no instance: it would be Unavailable)
            raise InvalidArgument("acquire_bytes got no bytes: not a handle's wire form")
        if self._deferred:
            self._requeue_deferred(force=False)  # releases whose views are gone by now
        # No liveness check here: the native call compares the handle's daemon instance with this
        # session's, and one of a restarted daemon takes the general path, which reconnects. A
        # handle of this session's instance names bytes still mapped here, whether or not that
        # daemon is alive: taking them is what an acquire just before its death would have done.
        # No lock either: the lane counts leases itself, and a table client once built is never
        # changed (a reconnect builds another).
        tables = self._tables
        if tables is None or tables.table is not self._conn.table:
            with self._lock:
                tables = self._table_client()
        got = None if tables is None else tables.lane.acquire_wire(data)  # (a refusal raises)
        if got is None:
            return self.acquire(Handle.from_bytes(data), ttl_ms=ttl_ms)
        memory, dtype, shape, digest, index, generation = got
        if table.fault_point is not None:  # (inline: a handoff's hot path)
            table.fault_point("t_after_acquire")
        return Lease(self, Handle._of(None, data, dtype, shape, digest), memory, 0, tables, (index, generation))

    def _release_held(self, lease: Lease) -> None:
        """``Lease.release`` of a lease held in the object table: its bit goes at once (no lock:
        the lane counts leases itself), or once the last view of its bytes does."""
        lease._detach_views()
        if lease._roots and lease._views_alive():
            with self._lock:
                self._deferred.append(lease)
                self._schedule_flush()
            return
        lease._memory = None  # (_forget_memory, inline: a handoff's hot path)
        tables = lease._table
        if tables is self._tables and tables is not None and tables.table is self._conn.table:  # (_live_table)
            try:
                tables.release_lease(*lease._slot_key)
            except Unavailable:
                pass  # the session ended meanwhile: its holds went with it

    def _acquire_in_table(self, tables: TableClient, handles: list[Handle], sizes: list[int],
                          leases: dict[int, Lease]) -> None:
        """Leases with this client's bit on every object-table handle (lock held), by index in
        ``handles``; all or nothing: a refusal gives back the ones taken and raises."""
        mapping = tables.mapping
        taken: list[Lease] = []
        try:
            for i, h in enumerate(handles):
                shm = h.shm
                if not shm.slot or shm.name != mapping.name or h.commit_token:
                    # not this tenant's table, or a loan the caller commits with its token: the
                    # daemon answers
                    continue
                if shm.offset + shm.nbytes > mapping.nbytes:
                    raise HandleError(f"offset {shm.offset} + nbytes {shm.nbytes} outside the arena",
                                      Reason.OUT_OF_BOUNDS)
                slot_key = (slot_index(shm.slot), shm.generation)
                if not tables.acquire(*slot_key, shm.offset, shm.nbytes):
                    continue
                lease = Lease(self, h, mapping.view(shm.offset, shm.nbytes)[:sizes[i]], 0, tables, slot_key)
                taken.append(lease)
                leases[i] = lease
        except BaseException:
            for lease in taken:
                lease._detach_views()
                self._queue(lease)
            raise

    def release(self, leases: Lease | Iterable[Lease], *, wait: bool = False) -> None:
        """Release one lease or many (the same as ``lease.release()``): at once in the object
        table, otherwise queued and piggybacked on the next call; ``wait=True`` sends them now and
        raises the daemon's verdict. A lease whose views the caller still holds is released when
        the last view goes. Raises OwnershipError for another Consumer's lease."""
        leases = [leases] if isinstance(leases, Lease) else list(leases)
        for lease in leases:
            if lease._client is not self:
                raise OwnershipError(f"{lease!r} belongs to another Consumer")
        rest = []
        for lease in leases:
            if lease._released:
                continue
            if lease._table is not None:
                self._release_held(lease)  # (no lock: the lane counts it)
            else:
                rest.append(lease)
        if rest:
            self._release_views(rest)
        if wait:
            self.flush()


def _check_manifest(h: Handle) -> int:
    """The tensor's byte size; the handle must match it (a zero-size tensor occupies 1 byte).
    Checked before the Acquire, so a forged handle costs the daemon no lease."""
    arena.validate_segment_name(h.shm.name)
    expected = tensor_nbytes(h.shape, h.dtype)
    if expected != h.nbytes and not (expected == 0 and h.nbytes == 1):
        raise InvalidArgument(f"handle nbytes {h.nbytes} != {h.dtype}{list(h.shape)} ({expected} bytes)")
    return expected
