"""Creating, reserving, sweeping and unlinking the daemon's shared-memory segments.

Only the daemon creates and unlinks (``docs/design.md``, lifetime rule 1). Two kinds:

- **Sealed** (each tenant's arena and object table): an anonymous memfd whose size is sealed, so
  no fd a client is handed can truncate or grow what the daemon and the other clients map (a
  truncation would SIGBUS them; growth would take memory nobody accounted). It has no name in
  /dev/shm, so nothing of it outlives the daemon and its clients' mappings. Its pages are the
  daemon's memory (its cgroup's), checked against what is available before they are reserved.
- **Named** (dedicated segments, opened by name by stock readers): files in /dev/shm built by
  ``shm_names``. The daemon holds an exclusive ``flock`` on each for its whole life, so a later
  daemon can tell a dead instance's leftovers (lock free) from a live one's (lock held) without
  guessing from ages or PIDs.
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


# Sealed segments can neither shrink nor grow, and their seals cannot change. Writes stay allowed:
# the arena is written by producers, the table by every session.
SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# What a sealed segment leaves of the memory available to the daemon, for the daemon and the node.
MEMORY_HEADROOM_NBYTES = 64 << 20
_CGROUP_ROOTS = {"v1": "/sys/fs/cgroup/memory", "v2": "/sys/fs/cgroup"}
_UNLIMITED = 1 << 62


def shm_free_nbytes() -> int:
    """Bytes still free in ``/dev/shm`` for an unprivileged process (``f_bavail``)."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def memory_available_nbytes() -> int:
    """What this process may still allocate: the node's MemAvailable, or less where a memory
    cgroup (v1 or v2, this process's or an ancestor's) has a limit closer to its usage."""
    available = _UNLIMITED
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    return min(available, _cgroup_headroom_nbytes())


def _cgroup_headroom_nbytes() -> int:
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return _UNLIMITED
    headroom = _UNLIMITED
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            version, limit_file, usage_file = "v2", "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            version, limit_file, usage_file = "v1", "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):  # a limit anywhere above this cgroup applies too
            directory = os.path.join(_CGROUP_ROOTS[version], *parts[:depth])
            try:
                with open(os.path.join(directory, limit_file)) as f:
                    limit = f.read().strip()
                with open(os.path.join(directory, usage_file)) as f:
                    usage = int(f.read())
            except (OSError, ValueError):
                continue  # not mounted here, or not visible from this namespace
            if limit.isdigit() and int(limit) < _UNLIMITED:
                headroom = min(headroom, max(0, int(limit) - usage))
    return headroom


def memory_advice(nbytes: int) -> str:
    """A hint for an operator whose daemon lacks memory for an arena of ``nbytes``."""
    mib = -(-(nbytes + MEMORY_HEADROOM_NBYTES) // (1 << 20))
    return (
        f"the arena and object table are the daemon's own memory: give it at least {mib} MiB "
        "(a container's memory limit, a systemd MemoryMax=), or ask for a smaller --arena-size"
    )


def shm_size_advice(nbytes: int) -> str:
    """A hint for an operator whose ``/dev/shm`` is too small to hold ``nbytes``."""
    mib = -(-nbytes // (1 << 20))
    return (
        f"/dev/shm must hold at least {mib} MiB: run the container with --shm-size={mib}m "
        f"(or --ipc=host), or in Kubernetes mount an emptyDir {{medium: Memory, sizeLimit: {mib}Mi}} "
        "at /dev/shm"
    )


class Segment:
    """One daemon-owned segment, its pages reserved up front: named (created exclusively in
    /dev/shm, locked, later unlinked) or sealed (an anonymous memfd of a fixed size)."""

    def __init__(self, name: str, nbytes: int, path: str | None):
        self.name = name
        self.nbytes = nbytes
        self.path = path  # None: sealed, no name in /dev/shm
        self._fd = -1

    @classmethod
    def create_sealed(cls, name: str, nbytes: int) -> "Segment":
        """A memfd of ``nbytes`` (``name`` shows only in /proc/*/fd), mode 0600, every page
        reserved, its size sealed before any fd of it leaves the daemon."""
        available = memory_available_nbytes()
        if nbytes + MEMORY_HEADROOM_NBYTES > available:
            raise ResourceExhausted(
                f"cannot reserve {nbytes} bytes of memory ({available} available): " + memory_advice(nbytes),
                Reason.SHM_TOO_SMALL,
            )
        seg = cls(name, nbytes, None)
        seg._fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.fchmod(seg._fd, 0o600)  # a memfd starts as 0777: reopening it through /proc must stay ours
            os.ftruncate(seg._fd, nbytes)
            os.posix_fallocate(seg._fd, 0, nbytes)
            fcntl.fcntl(seg._fd, fcntl.F_ADD_SEALS, SIZE_SEALS)
        except OSError as exc:
            seg.unlink()
            if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                raise ResourceExhausted(f"cannot reserve {nbytes} bytes of memory: {exc}; " + memory_advice(nbytes),
                                        Reason.SHM_TOO_SMALL) from exc
            raise ShmTransportError(f"cannot create segment {name}: {exc}") from exc
        return seg

    @classmethod
    def create(cls, name: str, nbytes: int, owner_uid: int = -1, owner_gid: int = -1) -> "Segment":
        """``owner_uid``/``owner_gid``: hand the file to a tenant (-1: keep the daemon's); a group
        owner gets 0660 so its members can map it, everything else stays 0600."""
        path = os.path.join(SHM_DIR, name)
        seg = cls(name, nbytes, path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
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
        """Whether ``unlink()`` has closed the segment (or it was never opened)."""
        return self._fd < 0

    @property
    def open_path(self) -> str:
        """Where this process opens the segment: its /dev/shm path, or (sealed) its fd in /proc,
        which other processes may open only with the daemon's uid and ptrace rights over it."""
        return self.path if self.path is not None else f"/proc/{os.getpid()}/fd/{self._fd}"

    def map(self, writable: bool = True) -> mmap.mmap:
        """A shared mapping of the whole segment in this process."""
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return mmap.mmap(self._fd, self.nbytes, mmap.MAP_SHARED, prot)

    def open_fd(self, writable: bool) -> int:
        """A new fd of this segment (for passing to a client), opened from the daemon's own."""
        return os.open(f"/proc/self/fd/{self._fd}", (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)

    def unlink(self) -> None:
        """Remove the name (if any) and close; idempotent. Mappings in other processes stay valid,
        and a sealed segment's pages go once the last of them does.

        Only our own file is removed: a stock reader may have unlinked the name already and
        someone else created a file under it since, which is not ours to delete."""
        if self._fd < 0:
            return
        try:
            if self.path is not None and _same_file(os.fstat(self._fd), os.lstat(self.path)):
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __repr__(self) -> str:
        state = "closed" if self.closed else "sealed" if self.path is None else "live"
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
        """A new dedicated segment; ResourceExhausted (SHM_TOO_SMALL) if it would eat into the reserve."""
        with self._lock:
            free = shm_free_nbytes()
            if free - nbytes < self.reserve_nbytes:
                raise ResourceExhausted(
                    f"a dedicated segment of {nbytes} bytes would leave {free - nbytes} bytes free in {SHM_DIR}, "
                    f"below the {self.reserve_nbytes} bytes the daemon keeps for the rest of the node",
                    Reason.SHM_TOO_SMALL,
                )
            return Segment.create(name, nbytes, owner_uid, owner_gid)
