"""One server per Unix socket path: an exclusive ``flock`` on ``<socket>.lock``, held for the
server's life.

Binding a Unix socket takes its path over from whoever served there: gRPC unlinks a socket file it
finds at the path before it binds, so a second server would say it is ready while the first one
serves on, unreachable, and the first one's exit would then unlink the second's socket. The lock
tells a live server (refuse to start) from a dead one's leftovers (its socket file is replaced),
and a server unlinks its socket at exit only while it holds the lock, so never another's.

The daemon (``daemon.socket_dir``, which also keeps its socket directory private) and the workers
(``worker.server``, ``engine.worker``: ``claim_socket``) share it.
"""
from __future__ import annotations

import errno
import fcntl
import os
import stat

from .errors import PermissionDenied, ShmTransportError, StateError

LOCK_SUFFIX = ".lock"
_LOCK_ATTEMPTS = 5


class SocketInUse(StateError):
    """A live server holds the socket's lock: another process is serving that path."""


def lock_socket(dir_fd: int, socket_path: str, *, what: str = "server",
                error: type[SocketInUse] = SocketInUse) -> int:
    """The fd holding an exclusive flock on ``<socket_path>.lock`` (opened in ``dir_fd``, the
    socket's directory), with our pid and ``what`` we are written in it. Raises ``error`` naming
    the live holder (what it is and its pid, as it wrote them) when another process holds it."""
    name = os.path.basename(socket_path) + LOCK_SUFFIX
    for _ in range(_LOCK_ATTEMPTS):
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600,
                         dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENXIO):
                raise
            os.unlink(name, dir_fd=dir_fd)  # a symlink or a socket: never a server's lock file
            continue
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # e.g. a FIFO: never a server's lock file either
            os.close(fd)
            os.unlink(name, dir_fd=dir_fd)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid, _, holder = os.pread(fd, 256, 0).decode(errors="replace").strip().partition(" ")
            os.close(fd)
            raise error(f"another {holder or what} (pid {pid or 'unknown'}) is serving {socket_path}") from None
        # A server stopping between our open and our flock unlinked this file: ours only if still named.
        try:
            now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            now = None
        if now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {what}\n".encode(), 0)
            return fd
        os.close(fd)
    raise ShmTransportError(f"cannot take {socket_path}{LOCK_SUFFIX}: it was replaced {_LOCK_ATTEMPTS} times")


def unix_socket_path(address: str) -> str | None:
    """The file path of a gRPC ``unix:PATH`` or ``unix:///PATH`` address; None for any other
    (``HOST:PORT``, ``unix-abstract:``: no file to guard)."""
    if address.startswith("unix://"):
        return address[len("unix://"):] or None
    if address.startswith("unix:"):
        return address[len("unix:"):] or None
    return None


def _unlink_socket(dir_fd: int, name: str) -> bool:
    """Unlink ``name`` in ``dir_fd`` if it is a socket (anything else is left for the bind to fail
    on, with its own error); whether one was removed."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(st.st_mode):
        return False
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True


class SocketClaim:
    """A Unix socket path held for a server's life (``claim_socket``); ``release()`` unlinks the
    socket and the lock file, then drops the lock (idempotent)."""

    def __init__(self, socket_path: str, dir_fd: int, lock_fd: int) -> None:
        self.socket_path = socket_path
        self.lock_path = socket_path + LOCK_SUFFIX
        self._name = os.path.basename(socket_path)
        self._dir_fd = dir_fd
        self._lock_fd = lock_fd

    @property
    def closed(self) -> bool:
        """Whether ``release()`` has run."""
        return self._lock_fd < 0

    def remove_leftover(self) -> bool:
        """Unlink a dead server's socket file at the path (we hold the lock: nobody live serves
        there); whether there was one."""
        return _unlink_socket(self._dir_fd, self._name)

    def release(self) -> None:
        """Unlink the socket and its lock file while still holding the lock, then close; idempotent."""
        if self.closed:
            return
        _unlink_socket(self._dir_fd, self._name)  # still ours: we hold the lock
        try:
            os.unlink(self._name + LOCK_SUFFIX, dir_fd=self._dir_fd)
        except FileNotFoundError:
            pass
        os.close(self._lock_fd)
        os.close(self._dir_fd)
        self._lock_fd = self._dir_fd = -1

    def __enter__(self) -> "SocketClaim":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"SocketClaim({self.socket_path!r}, {'released' if self.closed else 'held'})"


def claim_socket(socket_path: str, what: str) -> SocketClaim:
    """Make ``socket_path`` ours to bind: take ``<socket_path>.lock`` and remove a dead server's
    socket file left there. Raises ``SocketInUse`` ("another WHAT (pid N) is serving PATH") while a
    live process holds the lock, ``PermissionDenied`` or ``ShmTransportError`` when the directory
    cannot be used. The caller binds the socket next, and ``release()``s the claim when it stops."""
    directory = os.path.dirname(os.path.abspath(socket_path))
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            lock_fd = lock_socket(dir_fd, socket_path, what=what)
        except BaseException:
            os.close(dir_fd)
            raise
    except OSError as exc:
        cls = PermissionDenied if exc.errno in (errno.EACCES, errno.EPERM) else ShmTransportError
        raise cls(f"cannot claim socket {socket_path}: {exc.strerror or exc}") from exc
    claimed = SocketClaim(socket_path, dir_fd, lock_fd)
    try:
        claimed.remove_leftover()
    except OSError as exc:
        claimed.release()
        raise ShmTransportError(f"cannot remove the leftover socket {socket_path}: {exc.strerror or exc}") from exc
    return claimed
