"""Client library: ``Producer`` (put, loan → commit) and ``Consumer`` (acquire → release).

The frontend writes tensors straight into shared memory (``loan``) or copies once with the content
digest fused into the copy (``put(..., digest=True)``); the worker gets zero-copy read-only numpy
views and torch tensors on private copy-on-write pages of the same bytes (an in-place op changes
only this lease's pages, never the shared bytes). Batch forms make one RPC per request, not per
tensor.

Views never read freed memory silently: once a loan or lease is released, ``.array`` raises; and
if the caller still holds a view from before, the client keeps the daemon's reference until that
view is gone (checked on every later call and at close), so the bytes cannot be reused under it.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import resource
import socket
import stat
import struct
import threading
import time
import warnings
import weakref
from typing import Any, Iterable, Sequence

import grpc
import numpy as np

from . import _call_sites, arena, objtable, shm_names
from ._backend import kernels
from ._delayed import DelayedCall
from .errors import (
    ClosedError,
    HandleError,
    IdentityMismatch,
    InvalidArgument,
    OwnershipError,
    PermissionDenied,
    Reason,
    ResourceExhausted,
    ShmTransportError,
    StateError,
    Unavailable,
    error_from_rpc,
)
from .handle import Handle
from .table_client import Placed, TableClient
from .tensors import as_byte_array, dtype_from_name, dtype_name, tensor_nbytes, to_torch
from .v1 import daemon_pb2 as pb
from .v1 import daemon_pb2_grpc as pb_grpc
from .wire import GRPC_OPTIONS, MAX_BATCH, SESSION_METADATA_KEY, default_socket_path

_log = logging.getLogger("shmtransport.client")


class _Connection:
    """Session handshake + gRPC channel to one daemon instance; reconnects after a restart.

    The daemon is authenticated before anything is sent to it: the process at the session socket
    must run as the expected uid (``daemon_uid``, default this process's own; root is always
    accepted), the gRPC socket must be a socket owned by that uid, and the arena comes as an fd
    passed over the session socket, checked (a regular 0600 file of the daemon's) before mapping.
    """

    def __init__(self, socket_path: str, timeout_s: float, writable: bool, daemon_uid: int | None = None):
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self.writable = writable
        self.expected_daemon_uid = os.geteuid() if daemon_uid is None else daemon_uid
        self.daemon_uid = self.expected_daemon_uid  # the authenticated peer's, once connected
        self._lock = threading.Lock()
        self._session_sock: socket.socket | None = None
        self._channel: grpc.Channel | None = None
        self.stub: pb_grpc.DaemonStub | None = None
        self.mapping: arena.ArenaMapping | None = None
        # The tenant's object table, when the daemon keeps one and this process can change it
        # (the C kernels); ``holder_bit`` is this session's bit in it.
        self.table: objtable.ObjectTable | None = None
        self.holder_bit: int | None = None
        self._table_mapping: arena.ArenaMapping | None = None
        self.hello: dict[str, Any] = {}
        self._metadata: tuple = ()
        self._checked_at = 0.0

    def ensure(self) -> None:
        with self._lock:
            if self.stub is not None and not self._session_alive():
                self._drop()  # the daemon died: its session socket hit EOF
            if self.stub is None:
                self._connect()
            self._checked_at = time.monotonic()

    # How long calls in shared memory alone (the object table) trust the last liveness check: a
    # daemon that died since is noticed this much later, and at the next RPC in any case.
    LIVENESS_CHECK_S = 0.05

    def ensure_recent(self) -> None:
        """``ensure`` for calls without a round trip: the liveness check (a syscall) at most
        every LIVENESS_CHECK_S."""
        if self.stub is None or time.monotonic() - self._checked_at > self.LIVENESS_CHECK_S:
            self.ensure()

    def _session_alive(self) -> bool:
        """The daemon never writes after the handshake, so readable means EOF: it is gone."""
        try:
            return self._session_sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except BlockingIOError:
            return True
        except OSError:
            return False

    def _connect(self) -> None:
        _check_fd_headroom()
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError as exc:
            raise ResourceExhausted(f"cannot open a socket to shmtransportd: {exc}", Reason.FD_LIMIT) from exc
        sock.settimeout(self.timeout_s)
        fds: list[int] = []
        try:
            sock.connect(self.socket_path + ".session")
            daemon_uid = self._authenticate(sock)
            try:
                sock.sendall(json.dumps({"access": "rw" if self.writable else "ro"}).encode() + b"\n")
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused at accept: the reason is waiting to be read
            line, fds = _read_hello(sock)
        except OSError as exc:
            sock.close()
            raise Unavailable(f"cannot reach shmtransportd at {self.socket_path}: {exc}") from exc
        except ShmTransportError:
            sock.close()
            raise
        try:
            hello = json.loads(line)
        except ValueError:
            hello = {}
        if "token" not in hello or len(fds) not in (1, 2):
            sock.close()
            for fd in fds:
                os.close(fd)
            if hello.get("error") == "permission_denied":
                raise PermissionDenied(f"daemon refused this client: {hello.get('message')}")
            if hello.get("error") in ("resource_exhausted", "quota_exceeded"):
                raise ResourceExhausted(f"daemon refused this client: {hello.get('message')}", Reason.QUOTA_EXCEEDED)
            raise Unavailable(f"bad session handshake from {self.socket_path}: {hello.get('message', line[:200])!r}")
        try:
            name = arena.validate_segment_name(str(hello["segment_name"]))
        except BaseException:
            os.close(fds[0])
            sock.close()
            raise
        try:
            mapping = arena.attach_fd(fds[0], name, int(hello["arena_nbytes"]), self.writable, daemon_uid)
        except BaseException:  # attach_fd closed the fd
            for fd in fds[1:]:
                os.close(fd)
            sock.close()
            raise
        try:
            self._attach_table(hello, fds[1] if len(fds) == 2 else None, daemon_uid)
        except BaseException:
            arena.detach(mapping)
            sock.close()
            raise
        sock.setblocking(False)  # only ever peeked at by _session_alive from now on
        self.daemon_uid = daemon_uid
        self.hello = hello
        self._session_sock = sock
        self._metadata = ((SESSION_METADATA_KEY, hello["token"]),)
        self._channel = grpc.insecure_channel(f"unix:{self.socket_path}", options=GRPC_OPTIONS)
        self.stub = pb_grpc.DaemonStub(self._channel)
        self.mapping = mapping

    def _attach_table(self, hello: dict, fd: int | None, daemon_uid: int) -> None:
        """Map the object table the daemon passed, when this session got a holder bit and this
        process has the C kernels; otherwise the fd is closed and objects go through the daemon."""
        info = hello.get("object_table")
        if fd is None:
            return
        if not info or hello.get("holder_bit") is None or not objtable.available():
            os.close(fd)
            return
        try:
            name = arena.validate_segment_name(str(info["segment_name"]))
            nslots = int(info["nslots"])
        except BaseException:
            os.close(fd)
            raise
        mapping = arena.attach_fd(fd, name, objtable.table_nbytes(nslots), True, daemon_uid)
        try:
            self.table = objtable.ObjectTable(mapping.view(0, objtable.table_nbytes(nslots)), nslots)
        except BaseException:
            arena.detach(mapping)
            raise
        self._table_mapping = mapping
        self.holder_bit = int(hello["holder_bit"])

    def _authenticate(self, sock: socket.socket) -> int:
        """The uid of the process serving the session socket, if it is the daemon we expect, and
        its gRPC socket is that uid's socket; else PermissionDenied (nothing was sent yet)."""
        _pid, uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        if uid not in (self.expected_daemon_uid, 0):
            raise PermissionDenied(
                f"the process serving {self.socket_path}.session runs as uid {uid}, not as the daemon's uid "
                f"{self.expected_daemon_uid}: refusing to talk to it (is another user squatting the socket?)"
            )
        try:
            st = os.lstat(self.socket_path)
        except OSError as exc:
            raise Unavailable(f"cannot reach shmtransportd at {self.socket_path}: {exc}") from exc
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != uid:
            raise PermissionDenied(
                f"{self.socket_path} is not a socket of the daemon's uid {uid} (owner {st.st_uid}, "
                f"mode {stat.filemode(st.st_mode)}): refusing to send it anything"
            )
        return uid

    def alive(self) -> bool:
        """Connected, and the daemon of this session still there (never reconnects)."""
        with self._lock:
            return self.stub is not None and self._session_alive()

    def call(self, method: str, request, reconnect: bool = True):
        """One unary RPC with the session token and timeout; typed errors; reconnect next time.
        ``reconnect=False``: on this session only (Unavailable when it is gone), for calls that
        name things of this session (a newer daemon would misread them)."""
        if reconnect:
            self.ensure()
        elif not self.alive():
            raise Unavailable("the daemon of this session is gone")
        try:
            return getattr(self.stub, method)(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as err:
            exc = self.typed(err)
        try:
            raise exc
        finally:
            # The traceback holds this frame and its callers': a local naming the exception would
            # make a cycle that keeps their locals (arena views among them) alive until a GC.
            del exc

    def call_future(self, method: str, request) -> grpc.Future:
        """Send an RPC without waiting for its reply; ``typed`` turns its failure into our error."""
        self.ensure()
        return getattr(self.stub, method).future(request, timeout=self.timeout_s, metadata=self._metadata)

    def typed(self, err: grpc.RpcError):
        exc = error_from_rpc(err)
        # The daemon is gone or restarted (not: it refused a foreign handle): new session next call.
        if exc.reason is Reason.DAEMON_UNAVAILABLE or (
            exc.reason is Reason.PERMISSION_DENIED and "session" in exc.message
        ):
            self.disconnect()
        return exc

    @property
    def instance_id(self) -> str:
        return self.hello.get("instance_id", "")

    def disconnect(self) -> None:
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        if self._channel is not None:
            self._channel.close()
        if self._session_sock is not None:
            self._session_sock.close()
        if self.mapping is not None:
            arena.detach(self.mapping)
        if self.table is not None:
            self.table.close()
            arena.detach(self._table_mapping)
        self._channel = self.stub = self._session_sock = self.mapping = None
        self.table = self._table_mapping = self.holder_bit = None


class _View:
    """Shared machinery of a Loan and a Lease: a typed view over the bytes a handle names."""

    def __init__(self, client: "_Client", handle: Handle, memory: memoryview):
        self._client = client
        self.handle = handle
        self._memory = memory
        self._array: np.ndarray | None = None
        self._roots: list[weakref.ref] = []  # of every buffer this view cut typed arrays from
        self._released = False
        self._sealed = False  # a committed loan hands out no more (writable) views

    @property
    def closed(self) -> bool:
        """Whether ``release`` was called (the views are gone)."""
        return self._released

    @property
    def array(self) -> np.ndarray:
        """Zero-copy numpy view with the tensor's dtype and shape."""
        if self._array is None:
            self._check_viewable()
            self._array = self._typed(self._memory)
        return self._array

    def tensor(self):
        """Zero-copy torch tensor over the same bytes (bfloat16 included)."""
        return to_torch(self.array, self.handle.dtype)

    def _check_viewable(self) -> None:
        if self._released:
            raise ClosedError(f"{type(self).__name__} already released: its view is gone", Reason.VIEW_RELEASED)
        if self._sealed:
            raise ClosedError(f"{self!r} is committed: its bytes are immutable now", Reason.VIEW_RELEASED)

    def _typed(self, memory: memoryview) -> np.ndarray:
        """The handle's dtype and shape over ``memory``, tracked by ``_views_alive``."""
        root = np.frombuffer(memory, dtype=np.uint8)
        # numpy points every view derived from ``root`` (slices, reshapes, torch.from_numpy)
        # at ``root`` itself, so its weakref says whether any view of these bytes is alive.
        self._roots.append(weakref.ref(root))
        return root.view(dtype_from_name(self.handle.dtype)).reshape(self.handle.shape)

    def _views_alive(self) -> bool:
        return any(ref() is not None for ref in self._roots)

    def _detach_views(self) -> None:
        self._released = True
        self._array = None

    def _forget_memory(self) -> None:
        """Once released and unviewed: drop our slice so the process mapping can be unmapped."""
        self._memory = None

    def _seal(self) -> None:
        """Committed: no new views; our slice goes as soon as no caller view needs it."""
        self._sealed = True
        self._array = None
        if not self._views_alive():
            self._forget_memory()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):
        if not getattr(self, "_released", True):
            warnings.warn(f"{type(self).__name__} {self.handle!r} was never released", ResourceWarning, 2)


class Loan(_View):
    """Writable bytes loaned to a producer; ``commit`` seals them and returns the handle."""

    def __init__(self, client: "_Client", handle: Handle, memory: memoryview,
                 placed: tuple[TableClient, Placed] | None = None):
        """``placed``: the object-table entry of a loan placed in this producer's own grant."""
        super().__init__(client, handle, memory)
        self._placed = placed
        self.committed = False
        if _call_sites.enabled:  # a leak check is on: remember the caller for its report
            _call_sites.record(self)

    def commit(self, *, digest: bool = False, hold_ms: int = 0, wait: bool = False) -> Handle:
        """Seal the bytes and hand the object off; the handle names it to consumers. See
        ``Producer.commit_many`` for ``digest``, ``hold_ms`` and ``wait``.

        Raises ClosedError (released), StateError (already committed), Unavailable (the daemon
        restarted under the loan)."""
        return self._client.commit_many([self], digest=digest, hold_ms=hold_ms, wait=wait)[0]

    def release(self) -> None:
        """Give the loan back without committing (or drop the producer reference after commit)."""
        if not self._released:
            self._client._release_views([self])

    def __repr__(self) -> str:
        return f"Loan({self.handle!r}, {'released' if self._released else 'live'})"

    def __del__(self):
        # A committed loan's reference is its handle from then on (``Producer.release(handle)``,
        # or the producer's close); only a loan dropped uncommitted and unreleased is a leak.
        if not getattr(self, "committed", True):
            super().__del__()


class Lease(_View):
    """A consumer's read-only view of committed bytes, valid until ``release``."""

    def __init__(self, client: "_Client", handle: Handle, memory: memoryview, lease_id: int,
                 table: TableClient | None = None):
        """``table``: set for a lease held with this client's bit in the object table
        (``lease_id`` 0); otherwise the daemon's lease ``lease_id``."""
        super().__init__(client, handle, memory)
        self.lease_id = lease_id
        self._table = table
        self._private: np.ndarray | None = None
        if _call_sites.enabled:  # a leak check is on: remember the caller for its report
            _call_sites.record(self)

    def tensor(self):
        """Torch tensor of the leased bytes on private pages of this lease (``arena.private_view``).

        From 1 MiB on, reads copy nothing (the pages are the shared ones until written) and an
        in-place op (``div_``, ``add_``, ...) copies just the pages it writes; smaller tensors are
        copied once, which costs less than mapping. Either way this lease's tensors see the change;
        ``array``, other leases and other processes do not. Torch has no read-only tensors: over
        the read-only shared mapping an in-place op would die of SIGSEGV. Like ``array``, a live
        tensor keeps the lease after ``release`` (its pages must not meet a new object)."""
        if self._private is None:
            self._check_viewable()
            self._private = self._typed(arena.private_view(self._memory, self.handle.shm.offset))
        return to_torch(self._private, self.handle.dtype)

    def _detach_views(self) -> None:
        super()._detach_views()
        self._private = None

    def verify(self) -> None:
        """Recompute the content digest from shared memory; IdentityMismatch when it differs."""
        if self._released:
            raise ClosedError(f"{self!r} is released", Reason.VIEW_RELEASED)
        if not self.handle.digest:
            raise InvalidArgument("handle carries no digest: the producer did not hash")
        if kernels.tree_digest(self._memory) != self.handle.digest:
            raise IdentityMismatch(f"content digest mismatch for {self.handle!r}")

    def release(self) -> None:
        """Give the lease back (see ``Consumer.release``); ``array`` raises from then on."""
        if not self._released:
            self._client._release_views([self])

    def __repr__(self) -> str:
        return f"Lease(id={self.lease_id}, {self.handle!r}, {'released' if self._released else 'live'})"


class _Client:
    """Shared by Producer and Consumer: the connection, and releases that cost no round trip.

    A release is queued and sent with this client's next Loan/Commit/Acquire (piggybacked), or on
    its own after ``release_delay_s`` if no call comes first, or at once with ``flush()``. A release
    whose views are still held by the caller waits until they are dropped.
    """

    _writable = False
    MAX_QUEUED_RELEASES = 256
    GRANT_RETURN_DELAY_S = 0.1  # how often a producer with grants looks for ones to park or give back

    def __init__(self, socket_path: str | None = None, *, timeout_s: float = 10.0, release_delay_s: float = 0.02,
                 daemon_uid: int | None = None):
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
        self._deferred: list[_View] = []  # released by the caller, views still alive
        self._queued_handles: list[pb.Handle] = []
        self._queued_leases: list[int] = []
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
        return self._conn.hello.get("shm_namespace", "")

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
        return self._conn.hello["session_id"]

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

    def flush(self, *, strict: bool = True) -> None:
        """Send every queued release now (one RPC per batch). Returns once every release queued
        before the call has been applied, whichever thread sent it. ``strict``: daemon-side errors
        (e.g. a lease that already expired) raise here; otherwise such entries are skipped."""
        with self._flush_lock:
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
        table = self._conn.table
        if table is None:
            self._tables = None
            return None
        if self._tables is None or self._tables.table is not table:
            hello = self._conn.hello
            info = hello["object_table"]
            self._tables = TableClient(table, self._conn.holder_bit, int(hello["arena_nbytes"]),
                                       int(info["handoff_window_ms"]), int(info["max_hold_ms"]),
                                       self._grant)
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

    def _live_table(self, tables: TableClient | None) -> bool:
        """Whether a view's object-table client still speaks for this connection (after a daemon
        restart its objects are gone with the daemon: nothing is left to release)."""
        return tables is not None and tables is self._tables and tables.table is self._conn.table

    def _call(self, method: str, request):
        self._before_call(method)
        if method != "Release":
            self._piggyback(request)
        return self._conn.call(method, request)

    def _before_call(self, method: str) -> None:
        if self._closed:
            raise ClosedError(f"{type(self).__name__} is closed")
        if self._deferred:
            self._requeue_deferred(force=False)

    def _piggyback(self, request) -> None:
        if not hasattr(request, "release"):
            return
        with self._lock:
            queued = self._take_queued()
        if queued is not None:
            request.release.CopyFrom(queued)

    def _take_queued(self) -> pb.ReleaseRequest | None:
        """Up to one batch (the daemon's limit) of queued releases; the rest stays queued."""
        if not self._queued_handles and not self._queued_leases:
            return None
        handles = self._queued_handles[:MAX_BATCH]
        leases = self._queued_leases[: MAX_BATCH - len(handles)]
        del self._queued_handles[: len(handles)]
        del self._queued_leases[: len(leases)]
        if not self._queued_handles and not self._queued_leases:
            self._background.cancel()
        return pb.ReleaseRequest(handles=handles, lease_ids=leases)

    def _map_granted(self, shms: Sequence[pb.Handle], lease_ids: Sequence[int]) -> list[memoryview]:
        """The memory of every loan (no ``lease_ids``) or lease the daemon just granted; when one
        cannot be mapped, all of them are given back (queued) before the error propagates."""
        try:
            return [self._memory(shm) for shm in shms]
        except BaseException:
            with self._lock:
                if lease_ids:
                    self._queued_leases.extend(lease_ids)
                else:
                    self._queued_handles.extend(shms)
                self._schedule_flush()
            raise

    def _memory(self, shm: pb.Handle) -> memoryview:
        arena.validate_segment_name(shm.name)  # a handle names a file in /dev/shm, never a path
        mapping = self._conn.mapping
        if mapping is not None and shm.name != mapping.name and shm.offset == 0 \
                and shm_names.is_dedicated_of_arena(mapping.name, shm.name):
            # A dedicated segment of this daemon (LoanRequest.dedicated): mapped on its own; the
            # returned view keeps the mapping alive and it is unmapped once no view remains.
            owners = frozenset((self._conn.daemon_uid, os.geteuid()))  # the daemon or our tenant
            return arena.map_dedicated(shm.name, shm.nbytes, self._writable, owners)
        if mapping is None or shm.name != mapping.name:
            raise Unavailable(f"handle of segment {shm.name!r} is not this daemon's arena", Reason.INSTANCE_MISMATCH)
        return mapping.view(shm.offset, shm.nbytes)

    def _release_views(self, views: Sequence[_View]) -> None:
        """Queue the release, or defer it while the caller still holds a view of the bytes."""
        with self._lock:
            for view in views:
                view._detach_views()
                if view._views_alive():
                    self._deferred.append(view)
                else:
                    self._queue(view)
            self._schedule_flush()

    def _queue(self, view: _View) -> None:
        """Release one view's hold (lock held): in the object table at once, else queued for the
        daemon."""
        view._forget_memory()
        if isinstance(view, Lease):
            if view._table is not None:
                if self._live_table(view._table):
                    shm = view.handle.shm
                    view._table.release_lease(shm.slot - 1, shm.generation)
            else:
                self._queued_leases.append(view.lease_id)
        elif view._placed is not None:
            tables, placed = view._placed
            if self._live_table(tables) and placed.held:
                tables.release_own(placed, cancel_handoff=True)
        else:
            self._queued_handles.append(view.handle.shm)

    def _queue_handles(self, handles: Iterable[pb.Handle]) -> None:
        with self._lock:
            self._queued_handles.extend(handles)
            self._schedule_flush()

    def _schedule_flush(self) -> None:
        """Ask the background thread for a flush: at once when many releases are queued, after
        ``release_delay_s`` for a few, now and then while grants may go back (lock held)."""
        if len(self._queued_handles) + len(self._queued_leases) >= self.MAX_QUEUED_RELEASES:
            self._background.within(0.0)
        elif self._queued_handles or self._queued_leases or self._deferred:
            self._background.within(self._release_delay_s)
        elif self._surplus_grants():
            self._background.within(0.0 if self._tables.give_back else self.GRANT_RETURN_DELAY_S)

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

    def _surplus_grants(self) -> bool:
        tables = self._tables
        return tables is not None and self._live_table(tables) and tables.has_surplus

    def _return_grants(self) -> None:
        """Collect dead objects, park idle grants, give back the grants queued for return
        (background)."""
        with self._lock:
            tables = self._tables
            if not self._surplus_grants():
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

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
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
    ):
        """The frontend's side (see ``_Client`` for the connection options). ``alloc_wait_s``:
        how long, in seconds, a loan waits for space when the arena or the quota is full
        (back-pressure) before ResourceExhausted; 0 fails at once. ``copy_threads``: threads that
        ``put`` copies (and hashes) large tensors with; None = all cores, 1 = the calling thread."""
        self._pending_commits: list[grpc.Future] = []
        self.alloc_wait_s = alloc_wait_s
        self.copy_threads = copy_threads
        super().__init__(socket_path, timeout_s=timeout_s, release_delay_s=release_delay_s, daemon_uid=daemon_uid)

    def loan(self, nbytes: int | None = None, *, shape: Sequence[int] | None = None, dtype: Any = None,
             dedicated: bool = False) -> Loan:
        """Writable shared memory for one tensor: ``loan(nbytes)`` (uint8) or ``loan(shape=, dtype=)``."""
        return self.loan_many([(nbytes, shape, dtype)], dedicated=dedicated)[0]

    def loan_many(self, specs: Iterable[tuple[int | None, Sequence[int] | None, Any]],
                  *, dedicated: bool = False) -> list[Loan]:
        """Loans for every ``(nbytes, shape, dtype)`` in one RPC (all or nothing).

        ``dedicated``: each loan gets its own daemon-owned segment (handle offset 0) that a stock
        reader may unlink after reading (SMG / vLLM ShmHandle readers); reclaimed like any loan."""
        typed = [_loan_spec(*spec) for spec in specs]
        if not typed:
            raise InvalidArgument("nbytes must not be empty")
        if not dedicated:
            loans = self._place(typed)
            if loans is not None:
                return loans
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
        self._before_call("Loan")
        self._conn.ensure_recent()
        with self._lock:
            tables = self._table_client()
            if tables is None:
                return None
            try:
                placed = tables.place([max(nbytes, 1) for _, _, nbytes in typed], self.alloc_wait_s)
            except ResourceExhausted as exc:
                if exc.reason is not Reason.TABLE_FULL:
                    raise
                return None  # no slot left in the tenant's table: these objects are the daemon's to keep
            mapping, hello = self._conn.mapping, self._conn.hello
            loans = []
            for obj, (dt, shape, nbytes) in zip(placed, typed):
                shm = pb.Handle(name=mapping.name, offset=obj.offset, nbytes=obj.nbytes, owner_id=hello["session_id"],
                                generation=obj.generation, instance_id=hello["instance_id"], slot=obj.slot + 1)
                loans.append(Loan(self, Handle(shm, dt, shape), mapping.view(obj.offset, obj.nbytes)[:nbytes],
                                  (tables, obj)))
            self._schedule_flush()  # idle grants go back in the background
            return loans

    def commit_many(
        self, loans: Sequence[Loan], *, digest: bool = False, hold_ms: int = 0, wait: bool = False
    ) -> list[Handle]:
        """Seal loans and return their handles; ``digest`` computes each content digest (XXH3-128
        tree digest, checked by ``Lease.verify``) from shared memory first.

        A committed object is handed off: if this producer closes (or dies) before any consumer
        acquired it, it lives on until a first consumer does, or until the daemon's hand-off
        window passes with nobody acquiring it. An explicit ``release`` ends the hand-off: the
        object then lives only as long as consumers that already hold it. ``hold_ms``: keep it
        alive that long whoever acquires or releases it (fan-out to consumers that come later).

        Loans in the object table commit in shared memory (no round trip). Other loans send a
        Commit RPC, pipelined unless ``wait`` (a failure raises from this producer's next
        blocking call); a consumer's Acquire waits for a commit still in flight.
        """
        if not loans:
            raise InvalidArgument("loans must not be empty")
        if len({id(loan) for loan in loans}) != len(loans):
            raise InvalidArgument("the same loan appears twice in one commit")
        for loan in loans:
            if loan._client is not self:
                raise OwnershipError(f"{loan!r} belongs to another Producer")
            if loan._released:
                raise ClosedError(f"{loan!r} was released; it cannot be committed")
            if loan.committed:
                raise StateError(f"{loan!r} is already committed")
        for loan in loans:
            if digest:
                loan.handle.digest = kernels.tree_digest(loan._memory)
        in_table = [loan for loan in loans if loan._placed is not None]
        if in_table:
            with self._lock:
                for loan in in_table:
                    tables, placed = loan._placed
                    if not self._live_table(tables):
                        raise Unavailable("the daemon restarted: this loan's bytes are gone", Reason.INSTANCE_MISMATCH)
                    tables.commit(placed, hold_ms)
                    loan.committed = True
                    loan._seal()
        rest = [loan for loan in loans if loan._placed is None]
        if rest:
            self._commit_rpc(rest, hold_ms, wait)
        return [loan.handle for loan in loans]

    def _commit_rpc(self, loans: Sequence[Loan], hold_ms: int, wait: bool) -> None:
        self._before_call("Commit")
        request = pb.CommitRequest(handles=[loan.handle.shm for loan in loans], hold_ms=hold_ms)
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
        self._settle_commits(block=method in ("Release", "Stat"))

    def _piggyback(self, request) -> None:
        # A queued release must not overtake the commit of the same object.
        if self._queued_handles:
            self._settle_commits(block=True)
        super()._piggyback(request)

    def _settle_commits(self, block: bool) -> None:
        """Raise the first failure among sent commits; wait for all of them when ``block``."""
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

    def put(self, tensor: Any, *, digest: bool = False, hold_ms: int = 0, dedicated: bool = False) -> Handle:
        """Copy one numpy array or torch tensor (any dtype, C-contiguous or not) into shared memory
        and commit it: one copy, with the content digest fused into it when ``digest``. The
        options are ``commit_many``'s and ``loan_many``'s.

        Raises ResourceExhausted when no space frees within ``alloc_wait_s`` (its reason says
        whether the arena, the tenant's quota or ``/dev/shm`` is short), InvalidArgument for an
        unsupported dtype."""
        return self.put_many([tensor], digest=digest, hold_ms=hold_ms, dedicated=dedicated)[0]

    def put_many(self, tensors: Sequence[Any], *, digest: bool = False, hold_ms: int = 0,
                 dedicated: bool = False) -> list[Handle]:
        """``put`` for every tensor, all or nothing, with at most one Loan and one Commit RPC
        (none with the object table)."""
        sources = [as_byte_array(t) for t in tensors]
        loans = self.loan_many([(src.nbytes, shape, dt) for src, dt, shape in sources], dedicated=dedicated)
        try:
            for loan, (src, _, _) in zip(loans, sources):
                if digest:
                    loan.handle.digest = kernels.copy_tree_digest(loan._memory, src, self.copy_threads)
                else:
                    kernels.copy(loan._memory, src, self.copy_threads)
            handles = self.commit_many(loans, hold_ms=hold_ms)
        except BaseException:
            self._release_views(loans)
            raise
        for loan in loans:
            loan._detach_views()  # the producer keeps its reference through the handle, not the loan
        return handles

    def read_bytes(self, handle: Handle) -> bytes:
        """A copy of the bytes of an object of this daemon (e.g. to send it inline after all).
        Raises Unavailable for a handle of another daemon instance."""
        if handle.shm.instance_id != self.instance_id:
            raise Unavailable(f"handle of daemon instance {handle.shm.instance_id!r}, connected to "
                              f"{self.instance_id!r}", Reason.INSTANCE_MISMATCH)
        return bytes(self._memory(handle.shm)[:handle.nbytes])

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
        """Release this producer's object-table handles; the other handles."""
        if not any(h.shm.slot for h in handles):
            return handles
        rest = []
        self._conn.ensure_recent()
        with self._lock:
            tables = self._table_client()
            for h in handles:
                if not h.shm.slot:
                    rest.append(h)
                    continue
                if h.shm.instance_id != self.instance_id:
                    raise Unavailable(f"handle of daemon instance {h.shm.instance_id!r}, connected to "
                                      f"{self.instance_id!r}: its object is gone", Reason.INSTANCE_MISMATCH)
                placed = tables.owned(h.shm.slot - 1, h.shm.generation) if tables is not None else None
                if placed is None:
                    if tables is not None and h.shm.owner_id == self._conn.hello.get("session_id"):
                        raise HandleError(f"stale handle: {h!r} was already freed", Reason.STALE_HANDLE)
                    raise OwnershipError(f"{h!r} is not an object of this producer")
                if (placed.offset, placed.nbytes) != (h.shm.offset, h.shm.nbytes):
                    raise HandleError(f"{h!r} does not match the object in its slot "
                                      f"([{placed.offset}, +{placed.nbytes}))", Reason.OUT_OF_BOUNDS)
                tables.release_own(placed, cancel_handoff=True)
            self._schedule_flush()  # grants to give back once their objects die
        return rest


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
        for h in handles:
            if h.shm.instance_id != self.instance_id:
                # Checked by the daemon too; failing early avoids mapping a foreign segment.
                raise Unavailable(
                    f"handle of daemon instance {h.shm.instance_id!r}, connected to {self.instance_id!r}",
                    Reason.INSTANCE_MISMATCH,
                )
        sizes = [_check_manifest(h) for h in handles]
        leases: list[Lease | None] = [None] * len(handles)
        if self._deferred:
            self._requeue_deferred(force=False)  # releases whose views are gone by now
        with self._lock:
            tables = self._table_client()
            if tables is not None:
                self._acquire_in_table(tables, handles, sizes, leases)
        rest = [i for i, lease in enumerate(leases) if lease is None]
        if not rest:
            return leases
        try:
            request = pb.AcquireRequest(handles=[handles[i].shm for i in rest], ttl_ms=ttl_ms)
            if any(handles[i].commit_token for i in rest):
                request.commit_tokens.extend(handles[i].commit_token for i in rest)
            response = self._call("Acquire", request)
            memories = self._map_granted([handles[i].shm for i in rest], response.lease_ids)
        except BaseException:
            self._release_views([lease for lease in leases if lease is not None])
            raise
        for i, memory, lease_id in zip(rest, memories, response.lease_ids):
            leases[i] = Lease(self, handles[i], memory[:sizes[i]], lease_id)
        return leases

    def _acquire_in_table(self, tables: TableClient, handles: list[Handle], sizes: list[int],
                          leases: list[Lease | None]) -> None:
        """Leases with this client's bit on every object-table handle (lock held); all or
        nothing: a refusal gives back the ones taken and raises."""
        mapping = self._conn.mapping
        taken: list[Lease] = []
        try:
            for i, h in enumerate(handles):
                shm = h.shm
                if not shm.slot or shm.name != mapping.name:
                    continue  # not this tenant's table: the daemon answers (e.g. another tenant's)
                if shm.offset + shm.nbytes > mapping.nbytes:
                    raise HandleError(f"offset {shm.offset} + nbytes {shm.nbytes} outside the arena",
                                      Reason.OUT_OF_BOUNDS)
                tables.acquire(shm.slot - 1, shm.generation, shm.offset, shm.nbytes)
                lease = Lease(self, h, mapping.view(shm.offset, shm.nbytes)[:sizes[i]], 0, tables)
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
        live = [lease for lease in leases if not lease._released]
        if live:
            self._release_views(live)
        if wait:
            self.flush()


_UCRED = struct.Struct("3i")  # pid, uid, gid


def _read_hello(sock: socket.socket, limit: int = 65536) -> tuple[bytes, list[int]]:
    """The daemon's one-line answer and the fds passed with it (the arena's, on success)."""
    data, fds = b"", []
    while b"\n" not in data:
        chunk, new_fds, _flags, _addr = socket.recv_fds(sock, 4096, 2)
        fds.extend(new_fds)
        if not chunk or len(data) + len(chunk) > limit:
            break
        data += chunk
    return data.split(b"\n", 1)[0], fds


def _check_fd_headroom(needed: int = 16) -> None:
    """gRPC core aborts the whole process when it cannot create its eventfds: refuse with a typed
    error first when this process is that close to its fd limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError as exc:
        if exc.errno not in (errno.EMFILE, errno.ENFILE):
            return  # no /proc to count with: gRPC will say so itself if it runs out
        raise ResourceExhausted(f"no file descriptor left: {exc}", Reason.FD_LIMIT) from exc
    if soft - in_use < needed:
        raise ResourceExhausted(
            f"{in_use} of {soft} file descriptors in use; a connection to shmtransportd needs {needed} more "
            "(raise ulimit -n)",
            Reason.FD_LIMIT,
        )


def _loan_spec(nbytes: int | None, shape: Sequence[int] | None, dtype: Any) -> tuple[str, tuple[int, ...], int]:
    if shape is None:
        if nbytes is None or dtype is not None:
            raise InvalidArgument("loan needs nbytes, or shape and dtype")
        return "uint8", (int(nbytes),), tensor_nbytes((int(nbytes),), "uint8")
    name = dtype_name(dtype if dtype is not None else np.uint8)
    shape = tuple(int(d) for d in shape)
    size = tensor_nbytes(shape, name)
    if nbytes is not None and nbytes != size:
        raise InvalidArgument(f"nbytes={nbytes} does not match shape {shape} of {name} ({size} bytes)")
    return name, shape, size


def _check_manifest(h: Handle) -> int:
    """The tensor's byte size; the handle must match it (a zero-size tensor occupies 1 byte).
    Checked before the Acquire, so a forged handle costs the daemon no lease."""
    arena.validate_segment_name(h.shm.name)
    expected = tensor_nbytes(h.shape, h.dtype)
    if expected != h.nbytes and not (expected == 0 and h.nbytes == 1):
        raise InvalidArgument(f"handle nbytes {h.nbytes} != {h.dtype}{list(h.shape)} ({expected} bytes)")
    return expected
