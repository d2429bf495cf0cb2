"""Creating, reserving, sweeping and unlinking the daemon's shared-memory segments.

Only the daemon creates and unlinks (DESIGN §3 rule 1). Segment names are
``{prefix}-{instance_id}-{kind}``. The daemon holds an exclusive ``flock`` on each of its segment
files for its whole life, so a later daemon can tell a dead instance's leftovers (lock free) from a
live one's (lock held) without guessing from ages or PIDs.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import secrets

from ..errors import Reason, ResourceExhausted, ShmTransportError

SHM_DIR = "/dev/shm"
_log = logging.getLogger("shmtransport.daemon")

_NAME_RE = re.compile(r"^[A-Za-z0-9_.]{1,32}$")


def validate_prefix(prefix: str) -> str:
    if not _NAME_RE.match(prefix):
        raise ValueError(f"name prefix must match {_NAME_RE.pattern}, got {prefix!r}")
    return prefix


def new_instance_id() -> str:
    return secrets.token_hex(6)


def shm_namespace_id() -> str:
    """``<boot_id>:<st_dev of /dev/shm>``: two parties with equal ids share the same /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = "unknown-boot"
    return f"{boot_id}:{os.stat(SHM_DIR).st_dev}"


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
    def create(cls, name: str, nbytes: int) -> "Segment":
        seg = cls(name, nbytes)
        fd = os.open(seg.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        seg._fd = fd
        try:
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

    def unlink(self) -> None:
        """Remove the name and drop the lock; idempotent. Mappings in other processes stay valid."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __repr__(self) -> str:
        state = "closed" if self.closed else "live"
        return f"Segment({self.name!r}, nbytes={self.nbytes}, {state})"


def sweep_dead_instances(prefix: str) -> list[str]:
    """Unlink segments of our prefix whose owning daemon is gone (their flock is free)."""
    removed = []
    pattern = re.compile(rf"^{re.escape(prefix)}-[0-9a-f]{{12}}-")
    for name in sorted(os.listdir(SHM_DIR)):
        if not pattern.match(name):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)
            removed.append(name)
        except BlockingIOError:
            pass  # a live daemon holds it
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)
    if removed:
        _log.info("swept %d leftover segment(s) of dead instances: %s", len(removed), ", ".join(removed))
    return removed
