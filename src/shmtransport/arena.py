"""Mapping a daemon-owned segment into this process, once, and cutting views out of it.

Clients map, read, write and close — never unlink (DESIGN §3 rule 1). A process maps each segment
at most once per access mode and shares the mapping between its clients (reference counted), so a
handle turns into a view with offset arithmetic alone. Mappings are pre-faulted (MAP_POPULATE) so
the first copy into shared memory does not pay a page fault per 4 KiB.
"""
from __future__ import annotations

import mmap
import os
import threading

from .errors import HandleError, Reason, ResourceExhausted, Unavailable

SHM_DIR = "/dev/shm"
POPULATE_MAX_NBYTES = 4 << 30  # larger arenas fault pages in on first touch instead


class ArenaMapping:
    def __init__(self, name: str, nbytes: int, writable: bool):
        self.name = name
        self.nbytes = nbytes
        self.writable = writable
        self._refs = 0
        flags = os.O_RDWR if writable else os.O_RDONLY
        try:
            fd = os.open(os.path.join(SHM_DIR, name), flags | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise Unavailable(f"segment {name!r} does not exist (daemon gone?)", Reason.INSTANCE_MISMATCH) from exc
        except OSError as exc:  # EMFILE/ENFILE and the like: typed, so the caller can back off
            raise ResourceExhausted(f"cannot open segment {name!r}: {exc}", Reason.FD_LIMIT) from exc
        try:
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise HandleError(f"segment {name!r} holds {size} bytes, expected {nbytes}", Reason.OUT_OF_BOUNDS)
            map_flags = mmap.MAP_SHARED
            if nbytes <= POPULATE_MAX_NBYTES:
                map_flags |= getattr(mmap, "MAP_POPULATE", 0)
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self._mmap = mmap.mmap(fd, nbytes, flags=map_flags, prot=prot)
        finally:
            os.close(fd)

    @property
    def closed(self) -> bool:
        return self._mmap.closed

    def view(self, offset: int, nbytes: int) -> memoryview:
        """A memoryview of ``nbytes`` at ``offset``; bounds are checked, never trusted."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise HandleError(
                f"range [{offset}, {offset + nbytes}) outside segment {self.name!r} of {self.nbytes} bytes",
                Reason.OUT_OF_BOUNDS,
            )
        with memoryview(self._mmap) as whole:
            return whole[offset : offset + nbytes]

    def close(self) -> bool:
        """Unmap if no view is alive; False (mapping kept) when one still is."""
        if self._mmap.closed:
            return True
        try:
            self._mmap.close()
        except BufferError:
            return False
        return True

    def __repr__(self) -> str:
        mode = "rw" if self.writable else "ro"
        return f"ArenaMapping({self.name!r}, nbytes={self.nbytes}, {mode}, refs={self._refs})"


_lock = threading.Lock()
_mappings: dict[tuple[str, bool], ArenaMapping] = {}


def attach(name: str, nbytes: int, writable: bool) -> ArenaMapping:
    """The process-wide mapping of ``name`` (created on first use); pair with ``detach``."""
    with _lock:
        for key, candidate in list(_mappings.items()):
            if candidate._refs <= 0 and candidate.close():
                del _mappings[key]
        mapping = _mappings.get((name, writable))
        if mapping is None or mapping.closed:
            mapping = ArenaMapping(name, nbytes, writable)
            _mappings[(name, writable)] = mapping
        mapping._refs += 1
        return mapping


def detach(mapping: ArenaMapping) -> None:
    """Drop one reference; unmap the segments no client uses any more (now or, when a caller
    still holds a view, on a later attach/detach once the view is gone)."""
    with _lock:
        mapping._refs -= 1
        for key, candidate in list(_mappings.items()):
            if candidate._refs <= 0 and candidate.close():
                del _mappings[key]
