"""The connection to one daemon: the credential handshake (``SessionRequest`` / ``SessionReply``),
the mapped arena and object table, the gRPC channel, typed errors, and the reconnect policy
(a new session after the daemon restarted or forgot ours)."""
from __future__ import annotations

import errno
import os
import resource
import select
import socket
import stat
import struct
import threading
import time

import grpc
from google.protobuf.message import DecodeError, Message

from .. import arena, objtable, shm_names
from ..errors import (
    PermissionDenied,
    Reason,
    ResourceExhausted,
    ShmTransportError,
    Unavailable,
    error_for_reason,
    error_from_rpc,
)
from ..v1 import daemon_pb2 as pb
from ..v1 import daemon_pb2_grpc as pb_grpc
from ..wire import GRPC_OPTIONS, SESSION_METADATA_KEY, frame_payload, framed


class _Connection:
    """Session handshake + gRPC channel to one daemon instance; reconnects after a restart.

    The daemon is authenticated before anything is sent to it: the process at the session socket
    must run as the expected uid (``daemon_uid``, default this process's own; root is always
    accepted), the gRPC socket must be a socket owned by that uid, and the arena comes as an fd
    passed over the session socket, checked (a regular 0600 file of the daemon's) before mapping.
    """

    def __init__(self, socket_path: str, timeout_s: float, writable: bool, daemon_uid: int | None = None) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self.writable = writable
        self.expected_daemon_uid = os.geteuid() if daemon_uid is None else daemon_uid
        self.daemon_uid = self.expected_daemon_uid  # the authenticated peer's, once connected
        self._lock = threading.Lock()
        self._session_sock: socket.socket | None = None
        self._session_poll: select.poll | None = None  # readable: the session socket hit EOF
        self._channel: grpc.Channel | None = None
        self.stub: pb_grpc.DaemonStub | None = None
        self.mapping: arena.ArenaMapping | None = None
        # The tenant's object table, when the daemon keeps one and this process can change it
        # (the C kernels); ``holder_bit`` is this session's bit in it.
        self.table: objtable.ObjectTable | None = None
        self.holder_bit: int | None = None
        self._table_mappings: tuple[arena.ArenaMapping, ...] = ()
        self.hello = pb.SessionHello()
        self._metadata: tuple[tuple[str, str], ...] = ()
        self._checked_at = 0.0

    def memory(self, shm: pb.Handle) -> memoryview:
        """The bytes ``shm`` names, as this session maps them: in the arena, or in a dedicated
        segment of this daemon (mapped on its own; the view keeps that mapping alive, and it is
        unmapped once no view remains). Unavailable for a segment of another daemon."""
        arena.validate_segment_name(shm.name)  # a handle names a file in /dev/shm, never a path
        mapping = self.mapping
        if mapping is not None and shm.name != mapping.name and shm.offset == 0 \
                and shm_names.is_dedicated_of_arena(mapping.name, shm.name):
            owners = frozenset((self.daemon_uid, os.geteuid()))  # the daemon or our tenant
            return arena.map_dedicated(shm.name, shm.nbytes, self.writable, owners)
        if mapping is None or shm.name != mapping.name:
            raise Unavailable(f"handle of segment {shm.name!r} is not this daemon's arena", Reason.INSTANCE_MISMATCH)
        return mapping.view(shm.offset, shm.nbytes)

    def ensure(self) -> None:
        """Connected to a live daemon: reconnects when the last one is gone."""
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
        """The daemon never writes after the handshake, so readable means EOF: it is gone. (A
        poll, not a peeking recv: that raises BlockingIOError while all is well, and an exception
        costs more than the syscall on a handoff's hot path.)"""
        poller = self._session_poll
        if poller is None:
            return False  # not connected (set together with ``stub``)
        return not poller.poll(0)  # readable (EOF), hung up or failed: gone

    def _connect(self) -> None:
        _check_fd_headroom()
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError as exc:
            raise ResourceExhausted(f"cannot open a socket to shmtransportd: {exc}", Reason.FD_LIMIT) from exc
        sock.settimeout(self.timeout_s)
        fds: list[int] = []
        try:
            _connect_within(sock, self.socket_path + ".session", time.monotonic() + self.timeout_s)
            daemon_uid = self._authenticate(sock)
            access = pb.SESSION_ACCESS_READ_WRITE if self.writable else pb.SESSION_ACCESS_READ_ONLY
            try:
                sock.sendall(framed(pb.SessionRequest(access=access).SerializeToString()))
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused at accept: the reason is waiting to be read
            reply, fds = _read_session_reply(sock)
        except OSError as exc:
            sock.close()
            raise Unavailable(not_a_socket(self.socket_path)
                              or f"cannot reach shmtransportd at {self.socket_path}: {exc}") from exc
        except ShmTransportError:
            sock.close()
            raise
        hello = reply.hello
        if not reply.HasField("hello") or not hello.token or len(fds) not in (1, 3):
            sock.close()
            for fd in fds:
                os.close(fd)
            if reply.HasField("refusal"):
                raise error_for_reason(reply.refusal.reason, f"daemon refused this client: {reply.refusal.message}")
            raise Unavailable(f"bad session handshake from {self.socket_path}: {reply!r:.200}")
        try:
            name = arena.validate_segment_name(hello.segment_name)
        except BaseException:
            os.close(fds[0])
            sock.close()
            raise
        try:
            mapping = arena.attach_fd(fds[0], name, hello.arena_nbytes, self.writable, daemon_uid)
        except BaseException:  # attach_fd closed the fd
            for fd in fds[1:]:
                os.close(fd)
            sock.close()
            raise
        try:
            self._attach_table(hello, fds[1:], daemon_uid)
        except BaseException:
            arena.detach(mapping)
            sock.close()
            raise
        sock.setblocking(False)  # only ever peeked at by _session_alive from now on
        self.daemon_uid = daemon_uid
        self.hello = hello
        self._session_sock = sock
        self._session_poll = select.poll()
        self._session_poll.register(sock, select.POLLIN)
        self._metadata = ((SESSION_METADATA_KEY, hello.token),)
        self._channel = grpc.insecure_channel(f"unix:{self.socket_path}", options=GRPC_OPTIONS)
        self.stub = pb_grpc.DaemonStub(self._channel)
        self.mapping = mapping

    def _attach_table(self, hello: pb.SessionHello, fds: list[int], daemon_uid: int) -> None:
        """Map the object table the daemon passed (its slots, read-only for a consumer, and its
        holds), when this session got a holder bit and this process has the C kernels; otherwise
        the fds are closed and objects go through the daemon. Takes ownership of ``fds``."""
        info = hello.object_table
        if not fds or not hello.HasField("object_table") or not hello.HasField("holder_bit") \
                or not objtable.available():
            for fd in fds:
                os.close(fd)
            return
        nbytes = objtable.table_nbytes(info.nslots)
        mappings: list[arena.ArenaMapping] = []
        try:
            names = [arena.validate_segment_name(n) for n in (info.segment_name, info.holds_segment_name)]
            for i, (fd, name, writable) in enumerate(zip(fds, names, (self.writable, True))):
                fds[i] = -1  # attach_fd owns it in every outcome
                mappings.append(arena.attach_fd(fd, name, nbytes, writable, daemon_uid))
            self.table = objtable.ObjectTable(mappings[0].view(0, nbytes), mappings[1].view(0, nbytes), info.nslots)
        except BaseException:
            for fd in fds:
                if fd >= 0:
                    os.close(fd)
            for mapping in mappings:
                arena.detach(mapping)
            raise
        self._table_mappings = tuple(mappings)
        self.holder_bit = hello.holder_bit

    def _authenticate(self, sock: socket.socket) -> int:
        """The uid of the process serving the session socket, if it is the daemon we expect, and
        its gRPC socket is that uid's socket; else PermissionDenied (nothing was sent yet)."""
        uid: int
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

    def call(self, method: str, request: Message, reconnect: bool = True) -> Message:
        """One unary RPC with the session token and timeout; typed errors; reconnect next time.
        ``reconnect=False``: on this session only (Unavailable when it is gone), for calls that
        name things of this session (a newer daemon would misread them)."""
        if reconnect:
            self.ensure()
        elif not self.alive():
            raise Unavailable("the daemon of this session is gone")
        deadline = time.monotonic() + self.timeout_s
        pause = TENANT_BUSY_PAUSE_S
        while True:
            try:
                return self._rpc(method)(request, timeout=max(deadline - time.monotonic(), 0.001),
                                         metadata=self._metadata)
            except grpc.RpcError as err:
                exc = self.typed(err)
            # Refused before it ran because the tenant's share of threads was in use: again, later.
            if exc.reason is not Reason.TENANT_BUSY or time.monotonic() + pause >= deadline:
                break
            del exc
            time.sleep(pause)
            pause = min(pause * 2, TENANT_BUSY_PAUSE_MAX_S)
        try:
            raise exc
        finally:
            # The traceback holds this frame and its callers': a local naming the exception would
            # make a cycle that keeps their locals (arena views among them) alive until a GC.
            del exc

    def call_future(self, method: str, request: Message) -> grpc.Future[Message]:
        """Send an RPC without waiting for its reply; ``typed`` turns its failure into our error."""
        self.ensure()
        return self._rpc(method).future(request, timeout=self.timeout_s, metadata=self._metadata)

    def _rpc(self, method: str) -> grpc.UnaryUnaryMultiCallable[Message, Message]:
        """The stub's unary method ``method`` (the generated stub is untyped: every method takes a
        request message and answers a response message)."""
        rpc: grpc.UnaryUnaryMultiCallable[Message, Message] = getattr(self.stub, method)
        return rpc

    def typed(self, err: grpc.RpcError) -> ShmTransportError:
        exc = error_from_rpc(err)
        # The daemon is gone, or no longer knows our session (it restarted, or closed it): new
        # session next call. Any other refusal (a foreign handle, another tenant's) keeps this one.
        if exc.reason in (Reason.DAEMON_UNAVAILABLE, Reason.UNKNOWN_SESSION):
            self.disconnect()
        return exc

    @property
    def instance_id(self) -> str:
        return self.hello.instance_id

    def disconnect(self) -> None:
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        if self._channel is not None:
            self._channel.close()
        if self._session_sock is not None:
            self._session_sock.close()
        if self.table is not None:
            self.table.close()  # first: its lanes hold views of the arena
            for mapping in self._table_mappings:  # set together with ``table``
                arena.detach(mapping)
        if self.mapping is not None:
            arena.detach(self.mapping)
        self._channel = self.stub = self._session_sock = self._session_poll = self.mapping = None
        self.table = self.holder_bit = None
        self._table_mappings = ()


_UCRED = struct.Struct("3i")  # pid, uid, gid
TENANT_BUSY_PAUSE_S = 0.001  # first pause before retrying a call refused for the tenant's share
TENANT_BUSY_PAUSE_MAX_S = 0.05


def _read_session_reply(sock: socket.socket, limit: int = 65536) -> tuple[pb.SessionReply, list[int]]:
    """The daemon's framed ``SessionReply`` (empty when it sent none, or not one) and the fds passed
    with it (the arena's, on success)."""
    data, fds = b"", []
    try:
        while (payload := frame_payload(data, limit)) is None:
            chunk, new_fds, _flags, _addr = socket.recv_fds(sock, 4096, 3)
            fds.extend(new_fds)
            if not chunk:
                return pb.SessionReply(), fds
            data += chunk
        return pb.SessionReply.FromString(payload), fds
    except (ValueError, DecodeError):
        return pb.SessionReply(), fds


# A full accept queue (others connecting faster than the daemon accepts) is EAGAIN on a Unix
# socket: waited out, backing off, until the caller's timeout; a refused connection is not.
_CONNECT_RETRY_FIRST_S = 0.001
_CONNECT_RETRY_MAX_S = 0.05


def not_a_socket(path: str) -> str | None:
    """Why nothing answers at ``path`` when it exists but is no socket (a directory, say), else None:
    the connection's own error would name the session socket beside it, missing ("No such file")."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISSOCK(mode):
        return None
    kind = "a directory" if stat.S_ISDIR(mode) else "a regular file" if stat.S_ISREG(mode) else "another kind of file"
    return f"cannot reach shmtransportd at {path}: that path exists but is not a socket (it is {kind})"


def _connect_within(sock: socket.socket, path: str, deadline: float) -> None:
    delay = _CONNECT_RETRY_FIRST_S
    while True:
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() + delay >= deadline:
                raise
            time.sleep(delay)
            delay = min(2 * delay, _CONNECT_RETRY_MAX_S)


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
