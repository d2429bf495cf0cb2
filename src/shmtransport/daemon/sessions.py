"""Client sessions: a credential handshake and a liveness signal on one plain Unix socket.

A client connects to ``<socket>.session`` and writes one framed ``SessionRequest`` (read-write or
read-only; ``daemon.proto`` and ``wire.framed``). The daemon reads the peer's credentials with
SO_PEERCRED (which gRPC does not expose), refuses uids outside the allowlist at once, finds the
peer's tenant, and answers one framed ``SessionReply``: a ``SessionRefusal`` with its reason, or a
``SessionHello`` with a fresh session — a public ``session_id`` (it appears in handles as the owner)
and a secret ``token`` that every gRPC call must carry as metadata — plus, passed with SCM_RIGHTS, an
fd of the tenant's arena (read-only for a read-only session). Clients never open the arena by
name, so nobody can plant or swap it, and its file stays 0600: only processes the daemon handed the fd to can map it.

The client keeps the connection open and never writes again; when its process dies the kernel
closes the socket and the daemon reclaims everything the session held, at once and whatever the
state of its gRPC calls.

Nothing here blocks on a client: handshakes are read without blocking, each has a deadline, and
their number is bounded per uid, so idle or slow connections cannot hold the accept loop or the
daemon's fds. Nothing here waits for a tenant either: opening and closing a session (which take
the tenant's books) run on that tenant's own worker thread, so one tenant whose books are busy
delays only its own sessions, never another tenant's handshake or the watch of every session.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from typing import Callable, Generic, TypeVar, cast

from google.protobuf.message import DecodeError

from ..errors import Reason, ShmTransportError
from ..v1 import daemon_pb2 as pb
from ..wire import frame_payload, framed

_log = logging.getLogger("shmtransport.daemon")

_UCRED = struct.Struct("3i")  # pid, uid, gid
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13; Python does not name it
_MAX_GROUPS = 1024
_ACCEPT_BACKOFF_S = 0.05
_ACCEPT_BATCH = 64


class _RateLimitedLog:
    """Warnings of one kind, at most ``burst`` at once and ``per_s`` a second after that; what was
    left out is counted in the next line that gets through. A client that floods the daemon with
    refused connections must not flood its log (and the disk under it) too."""

    def __init__(self, logger: logging.Logger, per_s: float = 1.0, burst: int = 10) -> None:
        self._logger = logger
        self._per_s = per_s
        self._burst = float(burst)
        self._tokens = float(burst)
        self._last = time.monotonic()
        self._suppressed = 0

    def warning(self, message: str, *args: object) -> None:
        now = time.monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._last) * self._per_s)
        self._last = now
        if self._tokens < 1.0:
            self._suppressed += 1
            return
        self._tokens -= 1.0
        if self._suppressed:
            message += f" ({self._suppressed} similar refusals not logged)"
            self._suppressed = 0
        self._logger.warning(message, *args)

HANDSHAKE_TIMEOUT_S = 2.0
MAX_HANDSHAKE_NBYTES = 1024
MAX_PENDING_PER_UID = 64
_READ_WRITE = pb.SESSION_ACCESS_READ_WRITE
_ACCESS = (pb.SESSION_ACCESS_READ_WRITE, pb.SESSION_ACCESS_READ_ONLY)
_Tenant = TypeVar("_Tenant")  # what the daemon admits a peer to (its ``Tenant``)


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket (``SO_PEERCRED``)."""
    return _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))


def peer_groups(conn: socket.socket, gid: int) -> tuple[int, ...]:
    """The peer's primary and supplementary groups as the kernel recorded them at connect (not
    read from /proc, where a recycled pid would name another process)."""
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 4 * _MAX_GROUPS)
    except OSError:
        return (gid,)
    return (gid, *struct.unpack(f"{len(raw) // 4}I", raw))


@dataclasses.dataclass(frozen=True)
class Admission(Generic[_Tenant]):
    """What ``admit`` grants a peer: its tenant, the hello's tenant-wide fields, and the fds to pass
    (the arena's, then the object table's when the tenant has one)."""

    tenant: _Tenant
    hello: pb.SessionHello
    fds: tuple[int, ...]  # passed to the client and closed here afterwards


@dataclasses.dataclass
class _Pending:
    pid: int
    uid: int
    groups: tuple[int, ...]
    deadline: float
    data: bytes = b""


@dataclasses.dataclass(frozen=True)
class _Open(Generic[_Tenant]):
    session_id: str
    token: str
    tenant: _Tenant


def _conn(key: selectors.SelectorKey) -> socket.socket:
    """The connection of a selector key whose data is a ``_Pending`` or an ``_Open``: only
    accepted connections are registered with those."""
    return cast(socket.socket, key.fileobj)


class SessionServer(Generic[_Tenant]):
    """Accepts handshakes and watches open sessions on a selector thread."""

    def __init__(
        self,
        path: str,
        allowed: Callable[[int, tuple[int, ...]], bool],
        admit: Callable[[int, int, tuple[int, ...], bool], Admission[_Tenant]],
        on_open: Callable[[str, int, int, _Tenant], int | None],
        on_close: Callable[[str, _Tenant], None],
        socket_mode: int,
    ) -> None:
        """``allowed(uid, groups)``: whether a peer may handshake at all (checked at accept);
        ``admit(pid, uid, groups, writable)``: the peer's tenant and arena fd, or a
        ShmTransportError (e.g. its tenant's session limit) that the peer gets as its answer."""
        self.path = path
        self._allowed = allowed
        self._admit = admit
        self._on_open = on_open
        self._on_close = on_close
        self._tokens: dict[str, _Open[_Tenant]] = {}
        self._tokens_lock = threading.Lock()
        # One worker per tenant (keyed by identity) for on_open / on_close, in order; sessions a
        # worker opened come back to the selector thread through _opened (the selector is not
        # thread-safe).
        self._workers: dict[int, concurrent.futures.ThreadPoolExecutor] = {}
        self._opened: collections.deque[tuple[socket.socket, _Open[_Tenant]]] = collections.deque()
        self._pending: dict[socket.socket, _Pending] = {}
        self._pending_per_uid: dict[int, int] = {}
        self._refusals = _RateLimitedLog(_log)  # logged by the session loop's thread only
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        os.chmod(path, socket_mode)
        self._listener.listen(256)
        self._listener.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._loop, name="shmt-sessions", daemon=True)
        self._stopping = False

    def start(self) -> None:
        """Start the selector thread."""
        self._thread.start()

    def session_for_token(self, token: str) -> tuple[str, _Tenant] | None:
        """(session id, tenant) of a live session's token, else None."""
        with self._tokens_lock:
            opened = self._tokens.get(token)
        return None if opened is None else (opened.session_id, opened.tenant)

    def stop(self) -> None:
        """Stop the thread, drop every open and pending connection and remove the socket; once."""
        self._stopping = True
        os.write(self._wake_w, b"x")
        if self._thread.ident is not None:  # a failed daemon start may never have started it
            self._thread.join(timeout=5)
        for worker in self._workers.values():  # every open and close handed to them is done
            worker.shutdown(wait=True)
        self._register_opened()
        for key in list(self._selector.get_map().values()):
            if isinstance(key.data, _Open):
                self._drop(_conn(key), key.data, now=True)
        for conn in list(self._pending):
            self._drop_pending(conn)
        self._selector.close()
        self._listener.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _loop(self) -> None:
        while not self._stopping:
            timeout = 1.0
            if self._pending:
                timeout = max(0.0, min(p.deadline for p in self._pending.values()) - time.monotonic())
            for key, _ in self._selector.select(timeout=min(timeout, 1.0)):
                if self._stopping:
                    break
                try:
                    if key.fileobj is self._wake_r:
                        os.read(self._wake_r, 4096)
                        self._register_opened()
                    elif key.fileobj is self._listener:
                        self._accept()
                    elif isinstance(key.data, _Pending):
                        self._read_handshake(_conn(key), key.data)
                    elif isinstance(key.data, _Open):
                        self._drop(_conn(key), key.data)  # a session socket is readable: EOF or junk
                except Exception:  # a bug of ours on one connection must not end every session's watch
                    _log.exception("session event failed")
            self._expire_pending()
        # leaving the loop: stop() drops the remaining sessions

    def _accept(self) -> None:
        """Accept what waits in the queue (up to ``_ACCEPT_BATCH`` per wake-up, so handshakes in
        progress are not starved): one connection per wake-up lets a flood fill the queue."""
        for _ in range(_ACCEPT_BATCH):
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. EMFILE: keep serving the sessions we have, retry shortly
                _log.warning("cannot accept a session (%s); retrying", exc)
                time.sleep(_ACCEPT_BACKOFF_S)
                return
            self._admit_connection(conn)

    def _admit_connection(self, conn: socket.socket) -> None:
        try:
            pid, uid, gid = peer_credentials(conn)
            groups = peer_groups(conn, gid)
        except OSError as exc:
            _log.info("session handshake failed: %s", exc)
            conn.close()
            return
        if not self._allowed(uid, groups):
            self._refusals.warning("refused session from pid %d uid %d (not in the allowlist)", pid, uid)
            self._refuse(conn, Reason.PERMISSION_DENIED, f"uid {uid} is not allowed")
            return
        if self._pending_per_uid.get(uid, 0) >= MAX_PENDING_PER_UID:
            self._refusals.warning("refused session from pid %d uid %d: %d handshakes of this uid pending",
                                   pid, uid, MAX_PENDING_PER_UID)
            self._refuse(conn, Reason.QUOTA_EXCEEDED, f"too many handshakes of uid {uid} in progress")
            return
        conn.setblocking(False)
        pending = _Pending(pid, uid, groups, time.monotonic() + HANDSHAKE_TIMEOUT_S)
        self._pending[conn] = pending
        self._pending_per_uid[uid] = self._pending_per_uid.get(uid, 0) + 1
        self._selector.register(conn, selectors.EVENT_READ, pending)

    def _read_handshake(self, conn: socket.socket, pending: _Pending) -> None:
        try:
            chunk = conn.recv(MAX_HANDSHAKE_NBYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        pending.data += chunk
        if not chunk or len(pending.data) > MAX_HANDSHAKE_NBYTES:
            self._drop_pending(conn)
            return
        try:
            payload = frame_payload(pending.data, MAX_HANDSHAKE_NBYTES)
            if payload is None:
                return
            request = pb.SessionRequest.FromString(payload)
            if request.access not in _ACCESS:
                raise ValueError(f"access must be read-write or read-only, got {request.access}")
        except (ValueError, DecodeError) as exc:  # DecodeError is a ValueError's sibling, not a subclass
            self._forget_pending(conn, pending)
            self._refuse(conn, Reason.INVALID_ARGUMENT, f"bad handshake: {exc}")
            return
        self._forget_pending(conn, pending)
        try:
            admission = self._admit(pending.pid, pending.uid, pending.groups, request.access == _READ_WRITE)
        except ShmTransportError as exc:
            self._refusals.warning("refused session from pid %d uid %d: %s", pending.pid, pending.uid, exc)
            self._refuse(conn, exc.reason, exc.message)
            return
        except OSError as exc:  # e.g. EMFILE opening the arena fd: refuse this one, keep serving
            _log.warning("refused session from pid %d uid %d: %s", pending.pid, pending.uid, exc)
            self._refuse(conn, Reason.FD_LIMIT, f"the daemon cannot open a session now: {exc}")
            return
        self._open(conn, pending, admission)

    def _worker_of(self, tenant: _Tenant) -> concurrent.futures.ThreadPoolExecutor:
        worker = self._workers.get(id(tenant))
        if worker is None:
            worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shmt-sessions-tenant")
            self._workers[id(tenant)] = worker
        return worker

    def _open(self, conn: socket.socket, pending: _Pending, admission: Admission[_Tenant]) -> None:
        opened = _Open(secrets.token_hex(8), secrets.token_hex(16), admission.tenant)
        try:
            self._worker_of(opened.tenant).submit(self._open_in_tenant, conn, pending, admission, opened)
        except RuntimeError:  # stopping: the workers take nothing more
            for fd in admission.fds:
                os.close(fd)
            self._refuse(conn, Reason.DAEMON_UNAVAILABLE, "the daemon is stopping")

    def _open_in_tenant(self, conn: socket.socket, pending: _Pending, admission: Admission[_Tenant],
                        opened: _Open[_Tenant]) -> None:
        """On the tenant's worker. Registered before the reply, so the client's first RPC finds its
        token; undone if the client is already gone."""
        try:
            extra = self._on_open(opened.session_id, pending.pid, pending.uid, opened.tenant)
        except Exception as exc:  # a bug of ours: this client is refused, every other goes on
            _log.exception("opening a session of pid %d failed", pending.pid)
            for fd in admission.fds:
                os.close(fd)
            self._refuse(conn, Reason.INTERNAL, f"the daemon could not open a session: {exc}")
            return
        with self._tokens_lock:
            self._tokens[opened.token] = opened
        hello = pb.SessionHello(session_id=opened.session_id, token=opened.token, pid=pending.pid)
        hello.MergeFrom(admission.hello)
        if extra is not None:
            hello.holder_bit = extra
        reply = framed(pb.SessionReply(hello=hello).SerializeToString())
        try:
            # A fresh socket's send buffer holds far more than a hello: this never blocks.
            socket.send_fds(conn, [reply], list(admission.fds))
        except OSError as exc:
            _log.info("session handshake with pid %d failed: %s", pending.pid, exc)
            conn.close()
            self._close_session(opened)
            return
        finally:
            for fd in admission.fds:
                os.close(fd)
        self._opened.append((conn, opened))
        os.write(self._wake_w, b"o")

    def _register_opened(self) -> None:
        """Watch the sessions the tenants' workers opened (selector thread, or stop())."""
        while self._opened:
            conn, opened = self._opened.popleft()
            self._selector.register(conn, selectors.EVENT_READ, opened)

    def _refuse(self, conn: socket.socket, reason: Reason, message: str) -> None:
        reply = pb.SessionReply(refusal=pb.SessionRefusal(reason=reason.value, message=message))
        try:
            conn.setblocking(False)
            conn.send(framed(reply.SerializeToString()))
        except OSError:
            pass
        conn.close()

    def _forget_pending(self, conn: socket.socket, pending: _Pending) -> None:
        self._selector.unregister(conn)
        del self._pending[conn]
        left = self._pending_per_uid[pending.uid] - 1
        if left:
            self._pending_per_uid[pending.uid] = left
        else:
            del self._pending_per_uid[pending.uid]

    def _drop_pending(self, conn: socket.socket) -> None:
        self._forget_pending(conn, self._pending[conn])
        conn.close()

    def _expire_pending(self) -> None:
        now = time.monotonic()
        for conn, pending in list(self._pending.items()):
            if pending.deadline <= now:
                _log.info("dropped a session handshake of pid %d: nothing sent within %.0f s",
                          pending.pid, HANDSHAKE_TIMEOUT_S)
                self._drop_pending(conn)

    def _drop(self, conn: socket.socket, opened: _Open[_Tenant], now: bool = False) -> None:
        """The session ended: unwatched and closed here, its books closed on its tenant's worker
        (``now``: on this thread, once the workers are shut down)."""
        try:
            self._selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()
        if now:
            self._close_session(opened)
            return
        try:
            self._worker_of(opened.tenant).submit(self._close_session, opened)
        except RuntimeError:  # the workers are shut down: stop() closes it
            self._close_session(opened)

    def _close_session(self, opened: _Open[_Tenant]) -> None:
        with self._tokens_lock:
            self._tokens.pop(opened.token, None)
        try:
            self._on_close(opened.session_id, opened.tenant)
        except Exception:  # logged; the other sessions' closes go on
            _log.exception("closing session %s failed", opened.session_id)
