"""Claiming the daemon's socket paths before it binds them.

The sockets live in a directory only the daemon's owner can create entries in, so no other uid can
bind the name first, plant a symlink there or swap the directory. An exclusive ``flock`` on
``<socket>.lock``, held for the daemon's life, tells a live daemon on the same socket (refuse to
start) from a dead one's leftovers (removed: safe because the directory is ours); the lock itself
is ``socket_lock``'s, shared with the workers' sockets.
"""
from __future__ import annotations

import errno
import logging
import os
import stat

from ..errors import InvalidArgument, PermissionDenied, ShmTransportError
from ..socket_lock import LOCK_SUFFIX, SocketInUse, lock_socket

SESSION_SUFFIX = ".session"
_log = logging.getLogger("shmtransport.daemon")


class UnsafeSocketDir(PermissionDenied):
    """The socket directory is not one only the daemon's owner (or root) controls."""


class DaemonAlreadyRunning(SocketInUse):
    """A live daemon holds the socket's lock."""


def dir_mode(other_uids: bool, group_gid: int | None) -> int:
    """0700; group r-x when a socket group is set (0750); everyone x when other uids may connect
    (0711: they reach the sockets by name but cannot list the directory)."""
    return 0o700 | (0o050 if group_gid is not None else 0) | (0o011 if other_uids else 0)


class SocketClaim:
    """The claimed paths, held for the daemon's life; ``release()`` removes them (idempotent)."""

    def __init__(self, socket_path: str, dir_fd: int, lock_fd: int):
        self.socket_path = socket_path
        self.paths = (socket_path, socket_path + SESSION_SUFFIX)
        self.lock_path = socket_path + LOCK_SUFFIX
        self._names = [os.path.basename(p) for p in (*self.paths, self.lock_path)]
        self._dir_fd = dir_fd
        self._lock_fd = lock_fd

    @property
    def closed(self) -> bool:
        """Whether ``release()`` has run."""
        return self._lock_fd < 0

    def release(self) -> None:
        """Unlink both sockets and the lock file, then drop the lock (a later daemon creates a
        fresh lock file; ``_lock`` re-checks the name after flock for exactly this)."""
        if self.closed:
            return
        for name in self._names:
            try:
                os.unlink(name, dir_fd=self._dir_fd)
            except FileNotFoundError:
                pass
        os.close(self._lock_fd)
        os.close(self._dir_fd)
        self._lock_fd = self._dir_fd = -1

    def _remove_leftovers(self) -> None:
        for path, name in zip(self.paths, self._names):
            try:
                os.unlink(name, dir_fd=self._dir_fd)  # a link itself, never its target
            except FileNotFoundError:
                continue
            _log.info("removed leftover %s (no live daemon holds %s)", path, self.lock_path)

    def __repr__(self) -> str:
        return f"SocketClaim({self.socket_path!r}, {'released' if self.closed else 'held'})"


def claim(socket_path: str, *, other_uids: bool = False, group_gid: int | None = None) -> SocketClaim:
    """Make ``socket_path`` and ``socket_path + ".session"`` ours to bind.

    Creates the parent directory (mode ``dir_mode(other_uids, group_gid)``, chgrp ``group_gid``)
    or checks the existing one; takes ``<socket_path>.lock``; removes whatever is left at both
    socket paths. Raises ``UnsafeSocketDir``, ``DaemonAlreadyRunning`` or another typed error;
    on failure it leaves nothing it created but the directory.
    """
    directory = os.path.dirname(os.path.abspath(socket_path))
    try:
        dir_fd = _open_private_dir(directory, other_uids, group_gid)
        try:
            lock_fd = _lock(dir_fd, socket_path)
        except BaseException:
            os.close(dir_fd)
            raise
        claimed = SocketClaim(socket_path, dir_fd, lock_fd)
        try:
            claimed._remove_leftovers()
        except BaseException:
            claimed.release()
            raise
        return claimed
    except OSError as exc:
        cls = PermissionDenied if exc.errno in (errno.EACCES, errno.EPERM) else ShmTransportError
        raise cls(f"cannot claim socket {socket_path}: {exc}") from exc


def _open_private_dir(directory: str, other_uids: bool, group_gid: int | None) -> int:
    try:
        os.mkdir(directory, 0o700)
        created = True
    except FileExistsError:
        created = False
    except FileNotFoundError:
        raise InvalidArgument(f"cannot create the socket directory {directory}: its parent does not exist") from None
    st = os.lstat(directory)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeSocketDir(f"socket directory {directory} is a symlink: its owner could redirect the socket")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeSocketDir(f"socket directory {directory} is not a directory")
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if created:
            if group_gid is not None:
                os.fchown(fd, -1, group_gid)
            os.fchmod(fd, dir_mode(other_uids, group_gid))
        st2 = os.fstat(fd)
        if (st2.st_dev, st2.st_ino) != (st.st_dev, st.st_ino):
            raise UnsafeSocketDir(f"socket directory {directory} was replaced while it was checked")
        _check_dir(directory, st2, other_uids, group_gid)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_dir(directory: str, st: os.stat_result, other_uids: bool, group_gid: int | None) -> None:
    euid = os.geteuid()
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid not in (euid, 0):
        raise UnsafeSocketDir(
            f"socket directory {directory} is owned by uid {st.st_uid}, not by the daemon's uid {euid} "
            "or root: its owner could squat or replace the socket"
        )
    if mode & 0o022:
        raise UnsafeSocketDir(
            f"socket directory {directory} (mode {mode:04o}) is writable by other users: anyone could squat "
            f"the socket; use a directory only uid {euid} can write to"
        )
    # Safe but maybe unreachable: an existing directory's mode is the operator's, so only warn.
    others_ok = not other_uids or mode & 0o001
    group_ok = group_gid is None or mode & 0o001 or (st.st_gid == group_gid and mode & 0o010)
    if not (others_ok and group_ok):
        _log.warning(
            "socket directory %s (mode %04o, gid %d) does not let the other users this daemon allows "
            "traverse it: they cannot reach its sockets",
            directory, mode, st.st_gid,
        )


def _lock(dir_fd: int, socket_path: str) -> int:
    """The fd holding an exclusive flock on ``<socket_path>.lock``, with our pid written in it
    (``socket_lock.lock_socket``, which the workers' sockets use too)."""
    return lock_socket(dir_fd, socket_path, what="shmtransportd", error=DaemonAlreadyRunning)
