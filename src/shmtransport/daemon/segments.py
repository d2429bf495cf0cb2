"""Creating, reserving, sweeping and unlinking the daemon's shared-memory segments.

Only the daemon creates and unlinks (``docs/design.md``, lifetime rule 1). Segment names are
built by ``shm_names``. The daemon holds an exclusive ``flock`` on each of its segment
files for its whole life, so a later daemon can tell a dead instance's leftovers (lock free) from a
live one's (lock held) without guessing from ages or PIDs.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import stat
import threading

from .. import shm_names
from ..errors import Reason, ResourceExhausted, ShmTransportError
from ..shm_names import SHM_DIR

_log = logging.getLogger("shmtransport.daemon")


def shm_free_nbytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def shm_size_advice(nbytes: int) -> str:
    mib = -(-nbytes // (1 << 20))
    return (
        f"/dev/shm must hold at least {mib} MiB: run the container with --shm-size={mib}m "
        f"(or --ipc=host), or in Kubernetes mount an emptyDir {{medium: Memory, sizeLimit: {mib}Mi}} "
        "at /dev/shm"
    )


class Segment:
    """One daemon-owned segment: created exclusively, reserved up front, locked, later unlinked."""

    def __init__(self, name: str, nbytes: int):
        self.name = name
        self.nbytes = nbytes
        self.path = os.path.join(SHM_DIR, name)
        self._fd = -1

    @classmethod
    def create(cls, name: str, nbytes: int, owner_uid: int = -1, owner_gid: int = -1) -> "Segment":
        """``owner_uid``/``owner_gid``: hand the file to a tenant (-1: keep the daemon's); a group
        owner gets 0660 so its members can map it, everything else stays 0600."""
        seg = cls(name, nbytes)
        fd = os.open(seg.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        seg._fd = fd
        try:
            if owner_uid != -1 or owner_gid != -1:
                os.fchown(fd, owner_uid, owner_gid)
                if owner_gid != -1:
                    os.fchmod(fd, 0o660)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, nbytes)
            # Reserve every page now: a full /dev/shm fails here with ENOSPC, never later as SIGBUS.
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            seg.unlink()
            if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                raise ResourceExhausted(
                    f"cannot reserve {nbytes} bytes in {SHM_DIR} ({shm_free_nbytes()} free): "
                    + shm_size_advice(nbytes),
                    Reason.SHM_TOO_SMALL,
                ) from exc
            raise ShmTransportError(f"cannot create segment {name}: {exc}") from exc
        return seg

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def map(self) -> mmap.mmap:
        """A shared read-write mapping of the whole segment in this process."""
        return mmap.mmap(self._fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def open_fd(self, writable: bool) -> int:
        """A new fd of this segment (for passing to a client), opened from the daemon's own."""
        return os.open(f"/proc/self/fd/{self._fd}", (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)

    def unlink(self) -> None:
        """Remove the name and drop the lock; idempotent. Mappings in other processes stay valid.

        Only our own file is removed: a stock reader may have unlinked the name already and
        someone else created a file under it since, which is not ours to delete."""
        if self._fd < 0:
            return
        try:
            if _same_file(os.fstat(self._fd), os.lstat(self.path)):
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __repr__(self) -> str:
        state = "closed" if self.closed else "live"
        return f"Segment({self.name!r}, nbytes={self.nbytes}, {state})"


def sweep_dead_instances(prefix: str, tenant_uids: frozenset[int] = frozenset()) -> list[str]:
    """Unlink segments of our prefix whose owning daemon is gone (their flock is free).

    /dev/shm is world-writable: anyone can plant an entry named like ours. Only regular files owned
    by our euid are candidates — or, named as a dedicated segment, by one of ``tenant_uids`` (a
    root daemon hands those to their tenant) — opened without following links or blocking (a FIFO
    would hang the start) and re-checked on the fd; an entry that fails any of it is skipped,
    never fatal.
    """
    removed = []
    for name in sorted(os.listdir(SHM_DIR)):
        if not shm_names.of_some_instance(prefix, name):
            continue
        path = os.path.join(SHM_DIR, name)
        owners = frozenset((os.geteuid(), *tenant_uids)) if shm_names.is_dedicated_of_some_instance(prefix, name) \
            else frozenset((os.geteuid(),))
        try:
            if _sweep_one(path, owners):
                removed.append(name)
        except FileNotFoundError:
            pass  # gone meanwhile (e.g. another daemon's sweep)
        except OSError as exc:
            _log.warning("startup sweep skipped %s: %s", path, exc)
    if removed:
        _log.info("swept %d leftover segment(s) of dead instances: %s", len(removed), ", ".join(removed))
    return removed


def _is_ours(st: os.stat_result, owners: frozenset[int]) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_uid in owners


def _sweep_one(path: str, owners: frozenset[int]) -> bool:
    """Unlink ``path`` if it is a dead instance's segment of ours; whether it did."""
    st = os.lstat(path)
    if not _is_ours(st, owners):  # another uid's file is routine on a shared node; anything else is odd
        _log.log(logging.INFO if stat.S_ISREG(st.st_mode) else logging.WARNING,
                 "startup sweep left %s alone: not a regular file owned by uid %s", path, sorted(owners))
        return False
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        fst = os.fstat(fd)
        if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino) or not _is_ours(fst, owners):
            _log.warning("startup sweep left %s alone: replaced while it was checked", path)
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a live daemon holds it
        os.unlink(path)
        return True
    finally:
        os.close(fd)


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def default_shm_reserve_nbytes() -> int:
    """5 % of /dev/shm, at least 64 MiB: what the daemon leaves to the rest of the node."""
    st = os.statvfs(SHM_DIR)
    return max(64 << 20, st.f_blocks * st.f_frsize // 20)


class ShmReserve:
    """Creates dedicated segments for every tenant, never taking /dev/shm below ``reserve_nbytes``.

    Creation is serialised so that two concurrent loans cannot both pass the free-space check; the
    pages are reserved (fallocate) before the check is released, so a neighbour never meets a full
    /dev/shm because of us (it would die of SIGBUS writing to its own segment)."""

    def __init__(self, reserve_nbytes: int):
        self.reserve_nbytes = reserve_nbytes
        self._lock = threading.Lock()

    def create(self, name: str, nbytes: int, owner_uid: int = -1, owner_gid: int = -1) -> Segment:
        with self._lock:
            free = shm_free_nbytes()
            if free - nbytes < self.reserve_nbytes:
                raise ResourceExhausted(
                    f"a dedicated segment of {nbytes} bytes would leave {free - nbytes} bytes free in {SHM_DIR}, "
                    f"below the {self.reserve_nbytes} bytes the daemon keeps for the rest of the node",
                    Reason.SHM_TOO_SMALL,
                )
            return Segment.create(name, nbytes, owner_uid, owner_gid)
