"""Mapping a daemon-owned segment into this process, once, and cutting views out of it.

Clients map, read, write and close — never unlink (``docs/design.md``, lifetime rule 1). A process maps each segment
at most once per access mode and shares the mapping between its clients (reference counted), so a
handle turns into a view with offset arithmetic alone. Mappings are pre-faulted (MAP_POPULATE) so
the first copy into shared memory does not pay a page fault per 4 KiB.

Nothing is mapped on a name's word alone: the arena comes as an fd the daemon passed over its
socket, a dedicated segment is opened without following links, and either file must be a regular
file of the expected owner that others cannot reach, at least as large as the caller expects.

Read-only mappings keep their fd so that a lease can get private copy-on-write pages of its bytes
(``private_view``): torch has no read-only tensors, and an in-place op on a tensor over a
read-only shared mapping would kill the process with SIGSEGV.
"""
from __future__ import annotations

import bisect
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import re
import stat
import threading
import weakref

from .errors import HandleError, PermissionDenied, Reason, ResourceExhausted, Unavailable
from .shm_names import SHM_DIR

_log = logging.getLogger(__name__)
POPULATE_MAX_NBYTES = 4 << 30  # larger arenas fault pages in on first touch instead
_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,128}")


def validate_segment_name(name: str) -> str:
    """``name`` if it is a plain /dev/shm file name (no path, no ``.``/``..``); else HandleError."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or name in (".", ".."):
        raise HandleError(f"segment name {name!r} is not a plain /dev/shm name", Reason.BAD_HANDLE)
    return name


def _check_segment_fd(
    fd: int, name: str, nbytes: int, owner_uids: frozenset[int], forbidden_mode: int
) -> os.stat_result:
    """The file behind ``fd`` must be what a daemon creates: a regular file of one of
    ``owner_uids``, without ``forbidden_mode`` permission bits, holding at least ``nbytes``."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise HandleError(f"segment {name!r} is not a regular file", Reason.BAD_HANDLE)
    if st.st_uid not in owner_uids:
        owners = " or ".join(map(str, sorted(owner_uids)))
        raise PermissionDenied(f"segment {name!r} belongs to uid {st.st_uid}, expected uid {owners} (the daemon's)")
    if st.st_mode & forbidden_mode:
        raise PermissionDenied(
            f"segment {name!r} has mode {stat.S_IMODE(st.st_mode):o}: others could read or change its bytes"
        )
    if nbytes <= 0 or st.st_size < nbytes:
        raise HandleError(f"segment {name!r} holds {st.st_size} bytes, expected {nbytes}", Reason.OUT_OF_BOUNDS)
    return st


_SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


def _check_size_sealed(fd: int, name: str) -> None:
    """The arena and table are memfds the daemon sealed: a segment whose size anyone holding an
    fd could change would let them truncate it under this process (SIGBUS on the next access)."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0  # not a file that supports seals at all
    if seals & _SIZE_SEALS != _SIZE_SEALS:
        raise PermissionDenied(f"segment {name!r} is not sealed against resizing: anyone holding an fd of it "
                               "could truncate it under this process")


class _SharedMap(mmap.mmap):
    """A MAP_SHARED mapping that keeps its segment's fd (read-only ones) for ``private_view``,
    and (writable ones) the page ranges ``protect`` made read-only."""

    fd: int | None = None
    _close_fd: weakref.finalize | None = None  # set when an fd is kept: closes it at close or collection
    # Read-only page ranges of a writable mapping: sorted starts, and start -> end (addresses).
    _protected_starts: list[int] | None = None
    _protected_ends: dict[int, int] | None = None
    # Of those, the ones whose page tables ``protect`` moved aside: start -> (stash address, length).
    _stashes: dict[int, tuple[int, int]] | None = None
    _unmap_stashes: weakref.finalize | None = None  # unmaps the stashes at close or collection

    def close(self) -> None:
        super().close()  # BufferError while a view is alive: the fd stays too
        if self._close_fd is not None:
            self._close_fd()
        if self._unmap_stashes is not None:
            self._unmap_stashes()


class ArenaMapping:
    """This process's one mapping of a segment in one access mode, shared by its clients
    (``attach_fd``/``detach`` count the references); views of it are cut with ``view``."""

    def __init__(self, fd: int, name: str, nbytes: int, writable: bool, st: os.stat_result):
        """Map ``nbytes`` of the checked segment file ``fd``; takes ownership of ``fd``."""
        self.name = name
        self.nbytes = nbytes
        self.writable = writable
        self.file_id = (st.st_dev, st.st_ino)
        self._refs = 0
        try:
            map_flags = mmap.MAP_SHARED
            if nbytes <= POPULATE_MAX_NBYTES:
                map_flags |= getattr(mmap, "MAP_POPULATE", 0)
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self._mmap = _SharedMap(fd, nbytes, flags=map_flags, prot=prot)
        except BaseException as exc:
            os.close(fd)
            if isinstance(exc, PermissionError):  # e.g. a read-only fd mapped for writing
                raise PermissionDenied(f"cannot map segment {name!r}: {exc}") from exc
            if isinstance(exc, OSError) and exc.errno in (errno.ENOMEM, errno.EMFILE, errno.ENFILE):
                raise ResourceExhausted(f"cannot map segment {name!r}: {exc}", Reason.FD_LIMIT) from exc
            raise
        if writable:
            os.close(fd)  # a producer writes the shared bytes themselves: no private windows
        else:
            self._mmap.fd = fd
            close_fd = weakref.finalize(self._mmap, os.close, fd)
            close_fd.atexit = False
            self._mmap._close_fd = close_fd

    @property
    def closed(self) -> bool:
        """Whether the segment was unmapped (``close()`` succeeded)."""
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


def _close_unused() -> None:
    for key, candidate in list(_mappings.items()):
        if candidate._refs <= 0 and candidate.close():
            del _mappings[key]


def attach_fd(fd: int, name: str, nbytes: int, writable: bool, owner_uid: int) -> ArenaMapping:
    """The process-wide mapping of the arena segment ``name`` whose fd the daemon passed (created
    on first use, else ``fd`` is closed and the existing mapping shared); pair with ``detach``.
    Takes ownership of ``fd`` in every outcome."""
    try:
        validate_segment_name(name)
        st = _check_segment_fd(fd, name, nbytes, frozenset((owner_uid,)), 0o077)
        _check_size_sealed(fd, name)
        with _lock:
            _close_unused()
            mapping = _mappings.get((name, writable))
            if mapping is not None and not mapping.closed:
                if mapping.file_id != (st.st_dev, st.st_ino) or mapping.nbytes < nbytes:
                    raise Unavailable(
                        f"segment {name!r} is not the file this process mapped under that name",
                        Reason.INSTANCE_MISMATCH,
                    )
            else:
                owned, fd = fd, -1  # ArenaMapping owns it from here, and closes it if it fails
                mapping = ArenaMapping(owned, name, nbytes, writable, st)
                _mappings[(name, writable)] = mapping
            mapping._refs += 1
            return mapping
    finally:
        if fd >= 0:
            os.close(fd)


def detach(mapping: ArenaMapping) -> None:
    """Drop one reference; unmap the segments no client uses any more (now or, when a caller
    still holds a view, on a later attach/detach once the view is gone)."""
    with _lock:
        mapping._refs -= 1
        _close_unused()


def mappings_of(name: str) -> list[ArenaMapping]:
    """This process's live mappings of the arena segment ``name`` (both modes), after unmapping
    the ones nobody uses any more, as the next attach would."""
    with _lock:
        _close_unused()
        return [mapping for (mapped, _), mapping in _mappings.items() if mapped == name]


def map_dedicated(name: str, nbytes: int, writable: bool, owner_uids: frozenset[int]) -> memoryview:
    """A view of the dedicated segment ``name`` (one object, offset 0) that keeps its own mapping
    alive; the mapping goes once no view of it remains."""
    validate_segment_name(name)
    path = os.path.join(SHM_DIR, name)
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except FileNotFoundError as exc:
        raise HandleError(f"dedicated segment {name!r} does not exist (released, or unlinked by a reader)",
                          Reason.STALE_HANDLE) from exc
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PermissionDenied(f"dedicated segment {name!r} is a symbolic link") from exc
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise PermissionDenied(f"cannot open dedicated segment {name!r}: {exc}") from exc
        # EMFILE/ENFILE and the like: typed, so the caller can back off
        raise ResourceExhausted(f"cannot open segment {name!r}: {exc}", Reason.FD_LIMIT) from exc
    try:
        st = _check_segment_fd(fd, name, nbytes, owner_uids, 0o007)
    except BaseException:
        os.close(fd)
        raise
    return ArenaMapping(fd, name, nbytes, writable, st).view(0, nbytes)


# -- private copy-on-write windows ----------------------------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_MAP_FAILED = ctypes.c_void_p(-1).value
PRIVATE_COPY_MAX_NBYTES = 1 << 20  # below: a plain copy costs less than mapping and unmapping a window


def private_view(shared: memoryview, offset: int) -> memoryview:
    """Writable private bytes equal to ``shared``, a read-only view at ``offset`` of a segment
    mapped here; nobody else sees what is written to them. Small views are copied; larger ones get
    a copy-on-write window (MAP_PRIVATE): reads share the segment's pages, a write copies just the
    page it touches. The window is unmapped once no view of it remains.

    Only for committed (immutable) bytes, and only while a lease keeps them from being reused: a
    page of a window not yet written shows whatever the segment holds."""
    segment = shared.obj
    if not isinstance(segment, _SharedMap) or segment.fd is None:
        raise TypeError("private_view needs a view of a read-only segment mapping of this module")
    if offset < 0 or offset + shared.nbytes > len(segment):
        raise HandleError(f"range at {offset} outside the segment of {len(segment)} bytes", Reason.OUT_OF_BOUNDS)
    if shared.nbytes < PRIVATE_COPY_MAX_NBYTES:
        return memoryview(bytearray(shared))
    start = offset - offset % mmap.PAGESIZE
    length = offset - start + shared.nbytes
    # Faulted in on first touch, never MAP_POPULATE: populating a writable private mapping would
    # copy every page, and even populating it read-only first costs more than the faults do.
    addr = _libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, segment.fd, start)
    if addr is None or addr == _MAP_FAILED:
        raise ResourceExhausted(
            f"cannot map a private window of {length} bytes: {os.strerror(ctypes.get_errno())}", Reason.FD_LIMIT
        )
    window = (ctypes.c_ubyte * length).from_address(addr)
    weakref.finalize(window, _libc.munmap, addr, length).atexit = False  # views may outlive exit hooks
    with memoryview(window) as whole:
        return whole.cast("B")[offset - start : offset - start + shared.nbytes]


# -- committed bytes made read-only in the producer ----------------------------------------------
_libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.mremap.restype = ctypes.c_void_p
_libc.mremap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
_MREMAP_MAYMOVE, _MREMAP_FIXED, _MREMAP_DONTUNMAP = 1, 2, 4
_MAP_NORESERVE, _PROT_NONE = 0x4000, 0
_PMD_NBYTES = 2 << 20  # one page-table page maps this much: mremap moves such a page whole
# Each protected range may split the mapping into two more VMAs and add its stash (vm.max_map_count
# is 65530 by default): past this many, commits are left writable rather than risk ENOMEM elsewhere.
PROTECTED_RANGES_MAX = 8192


def _address(memory: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(memory)) if memory.nbytes else 0


def _stash_page_tables(lo: int, length: int) -> int:
    """Move the page tables of ``[lo, lo + length)`` to a fresh address (the stash), leaving the
    range mapped but with no page present; the stash's address, or 0 when the kernel cannot
    (before Linux 5.13). Why: mprotect rewrites every 4 KiB page-table entry (~90 ns each here:
    ~6 ms for 256 MiB, and as much again to undo), while mremap moves one page-table page per
    2 MiB when both addresses are congruent modulo 2 MiB (~0.1 ms for 256 MiB), and an emptied
    range is protected in O(1). ``_restore_page_tables`` moves them back, writable and present."""
    reserved = _libc.mmap(None, length + _PMD_NBYTES, _PROT_NONE,
                          mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
    if reserved is None or reserved == _MAP_FAILED:
        return 0
    stash: int = reserved + (lo - reserved) % _PMD_NBYTES
    moved = _libc.mremap(lo, length, length, _MREMAP_MAYMOVE | _MREMAP_FIXED | _MREMAP_DONTUNMAP, stash)
    if moved != stash:
        _log.debug("mremap to a stash failed: %s", os.strerror(ctypes.get_errno()))
        _libc.munmap(reserved, length + _PMD_NBYTES)
        return 0
    # The stash replaced part of the reservation; the rest around it goes.
    if stash > reserved:
        _libc.munmap(reserved, stash - reserved)
    if reserved + _PMD_NBYTES > stash:
        _libc.munmap(stash + length, reserved + _PMD_NBYTES - stash)
    return stash


def _restore_page_tables(lo: int, stash: int, length: int) -> bool:
    """Move the stash's page tables back over ``[lo, lo + length)`` (replacing the read-only
    mapping there in one step: no moment without a mapping); whether it worked."""
    return bool(_libc.mremap(stash, length, length, _MREMAP_MAYMOVE | _MREMAP_FIXED, lo) == lo)


def _unmap_all(stashes: dict[int, tuple[int, int]]) -> None:
    """Unmap every stash (its segment is gone: nobody restores them any more)."""
    for stash, length in stashes.values():
        _libc.munmap(stash, length)
    stashes.clear()


def protect(memory: memoryview) -> bool:
    """Make the whole pages of ``memory`` (a writable view of a segment mapped here) read-only in
    this process, so a write through a view kept past commit faults instead of changing what
    consumers read. The partial pages at either end (shared with neighbouring objects) stay
    writable. True when some page was protected. Undone by ``unprotect`` when the range is loaned
    again.

    From 2 MiB the range's page tables are moved aside first (``_stash_page_tables``), so the cost
    does not grow with the range: a read through a kept view faults its pages back in, read-only."""
    segment = memory.obj
    if not isinstance(segment, _SharedMap):
        return False
    start = _address(memory)
    lo = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    hi = (start + memory.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if hi <= lo:
        return False
    if segment._protected_starts is None or segment._protected_ends is None:
        segment._protected_starts, segment._protected_ends = [], {}
    if len(segment._protected_starts) >= PROTECTED_RANGES_MAX:
        return False
    # Below 2 MiB the few entries cost less to rewrite than the four calls a stash takes.
    stash = _stash_page_tables(lo, hi - lo) if hi - lo >= _PMD_NBYTES else 0
    if _libc.mprotect(lo, hi - lo, mmap.PROT_READ) != 0:
        _log.debug("mprotect read-only failed: %s", os.strerror(ctypes.get_errno()))
        if stash and not _restore_page_tables(lo, stash, hi - lo):
            _libc.munmap(stash, hi - lo)  # the range stays writable; its pages fault back in
        return False
    bisect.insort(segment._protected_starts, lo)
    segment._protected_ends[lo] = hi
    if stash:
        if segment._stashes is None:
            segment._stashes = {}
            segment._unmap_stashes = weakref.finalize(segment, _unmap_all, segment._stashes)
            segment._unmap_stashes.atexit = False
        segment._stashes[lo] = (stash, hi - lo)
    return True


def unprotect(memory: memoryview) -> None:
    """Make writable again every range ``protect`` made read-only that meets ``memory`` (a new
    loan over bytes of an object that is gone). Costs nothing while no range is protected."""
    segment = memory.obj
    if not isinstance(segment, _SharedMap) or not segment._protected_starts or segment._protected_ends is None:
        return
    starts, ends = segment._protected_starts, segment._protected_ends
    start = _address(memory)
    end = start + memory.nbytes
    # Ranges are disjoint and sorted: those starting before our end that also end after our start.
    i = bisect.bisect_left(starts, end)
    while i > 0 and ends[starts[i - 1]] > start:
        lo = starts.pop(i - 1)
        hi = ends.pop(lo)
        stash, _ = segment._stashes.pop(lo, (0, 0)) if segment._stashes else (0, 0)
        if stash and _restore_page_tables(lo, stash, hi - lo):
            i -= 1
            continue
        if stash:
            _libc.munmap(stash, hi - lo)  # made writable below instead; its pages fault back in
        if _libc.mprotect(lo, hi - lo, mmap.PROT_READ | mmap.PROT_WRITE) != 0:
            raise ResourceExhausted(f"cannot make a loaned range writable again: {os.strerror(ctypes.get_errno())} "
                                    "(too many mappings: vm.max_map_count)", Reason.FD_LIMIT)
        i -= 1
