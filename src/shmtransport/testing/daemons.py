"""In-process daemons for tests: ``start_daemon`` / ``stop_daemon`` (a short socket directory, a
unique name prefix, a small arena; stopping reports and unlinks leftover segments),
``settle_daemon`` / ``describe_daemon_state`` (what a daemon still holds, by client), and
``warm_up_process_state`` (the process-wide state a later fd check must not count)."""
from __future__ import annotations

import dataclasses
import difflib
import gc
import os
import shutil
import time
import weakref
from typing import TYPE_CHECKING, Any, Iterable

from ..shm_names import SHM_DIR
from .util import remove_tree, segments_of, short_tmpdir, unique_prefix

if TYPE_CHECKING:  # pragma: no cover
    from ..daemon import Daemon
    from ..v1 import daemon_pb2 as pb

DEFAULT_ARENA_NBYTES = 64 << 20
DAEMON_SETTLE_S = 3.0


# Daemon -> the socket directory ``start_daemon`` made for it (``stop_daemon`` removes it).
_daemon_tmpdirs: weakref.WeakKeyDictionary[Daemon, str] = weakref.WeakKeyDictionary()


def tmpdir_of(daemon: "Daemon") -> str | None:
    """The socket directory ``start_daemon`` made for ``daemon`` (None for another daemon)."""
    return _daemon_tmpdirs.get(daemon)


def copy_sealed_segments(daemon: "Daemon", directory: str) -> list[str]:
    """Copy each tenant's arena and object table segments into files of ``directory`` named after
    them (they are memfds: they go with the daemon's process, so a failed test's state is kept
    this way); the files' paths."""
    paths = []
    for tenant in daemon.tenants:
        for segment in (tenant.segment, tenant.objects.slots_segment, tenant.objects.holds_segment):
            path = os.path.join(directory, segment.name)
            with open(segment.open_path, "rb") as source, open(path, "wb") as copy:
                shutil.copyfileobj(source, copy, 1 << 20)
            paths.append(path)
    return paths


def check_config_fields(overrides: Iterable[str], caller: str = "start_daemon") -> None:
    """One line for a keyword that is no ``DaemonConfig`` field (TypeError), naming the field meant:
    the one its ``shmtransport daemon`` flag sets (``arena_size``: ``arena_nbytes``), else the
    closest, else all of them."""
    __tracebackhide__ = True  # pytest: the caller's line is where the mistake is
    from ..daemon.config import DAEMON_FLAGS, DaemonConfig

    fields = [field.name for field in dataclasses.fields(DaemonConfig)]
    by_flag = {flag.removeprefix("--").replace("-", "_"): field for field, flag in DAEMON_FLAGS.items()}
    for name in overrides:
        if name in fields:
            continue
        meant = by_flag.get(name) or "".join(difflib.get_close_matches(name, fields, n=1))
        hint = f"did you mean {meant!r}?" if meant else f"the DaemonConfig fields are {', '.join(fields)}"
        raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}: {hint}")


def start_daemon(**overrides: Any) -> "Daemon":
    """Start an in-process ``Daemon``: socket in a fresh short directory under /tmp (AF_UNIX paths
    are limited to 108 bytes), ``unique_prefix()``, a ``DEFAULT_ARENA_NBYTES`` arena; any
    ``DaemonConfig`` field can be overridden, and ``extensions`` given as to ``Daemon`` (another
    keyword: a one-line TypeError naming the field meant; a bad value: ``DaemonConfig.validate``'s
    InvalidArgument). ``stop_daemon`` undoes all of it."""
    __tracebackhide__ = True  # pytest: a refused keyword or value is the caller's line
    from ..daemon import Daemon

    check_config_fields(name for name in overrides if name != "extensions")  # (``Daemon``'s own)
    tmp = short_tmpdir()
    overrides.setdefault("socket_path", os.path.join(tmp, "d.sock"))
    overrides.setdefault("arena_nbytes", DEFAULT_ARENA_NBYTES)
    overrides.setdefault("name_prefix", unique_prefix())
    try:
        daemon = Daemon(**overrides)
        daemon.start()
    except BaseException:
        remove_tree(tmp)
        raise
    _daemon_tmpdirs[daemon] = tmp  # removed by stop_daemon
    return daemon


def stop_daemon(daemon: "Daemon", grace_s: float = 1.0) -> list[str]:
    """Stop the daemon, remove its socket directory, and check /dev/shm: the names of segments of
    its prefix that were still there (they are unlinked now, so nothing accumulates)."""
    try:
        daemon.stop(grace_s=grace_s)
    finally:
        tmp = _daemon_tmpdirs.pop(daemon, None)
        if tmp:
            remove_tree(tmp)
    left = segments_of(daemon.config.name_prefix)
    for name in left:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass
    return left


def settle_daemon(daemon: "Daemon", max_leases: int = 0, max_objects: int | None = None,
                  timeout_s: float = DAEMON_SETTLE_S) -> pb.StatResponse:
    """The daemon's ``stat()`` once it has at most ``max_leases`` live leases (and ``max_objects``
    live objects, unless None), or the last one after ``timeout_s``: clients release and close
    sessions asynchronously, so a test's last release may still be in flight."""
    deadline = time.monotonic() + timeout_s
    while True:
        gc.collect()  # a dropped view defers its lease's release until collected
        s = daemon.stat()
        ok = s.live_leases <= max_leases and (max_objects is None or s.live_objects <= max_objects)
        if ok or time.monotonic() >= deadline:
            return s
        time.sleep(0.02)


def describe_daemon_state(daemon: "Daemon", stat: pb.StatResponse | None = None) -> str:
    """``Daemon(...) holds 2 live objects (8192 bytes), 1 live lease; by client: ...``"""
    s = stat if stat is not None else daemon.stat()
    head = f"{daemon!r} holds {s.live_objects} live object(s) ({s.used_nbytes} bytes), {s.live_leases} live lease(s)"
    if s.handoff_objects:
        head += f"; {s.handoff_objects} committed object(s) in hand-off, waiting for a first acquire"
    lines = [head]
    in_table = _table_holdings(daemon, s.clients)
    for c in s.clients:
        t_leases, t_loaned, t_committed = in_table.get(c.session_id, (0, 0, 0))
        leases, loaned, committed = c.leases + t_leases, c.loaned_nbytes + t_loaned, c.committed_nbytes + t_committed
        if not (leases or loaned or committed):
            continue
        who = "this process" if c.pid == os.getpid() else f"pid {c.pid}"
        lines.append(
            f"    client {c.session_id[:12]} ({who}): {leases} lease(s), "
            f"{loaned} bytes loaned, {committed} bytes committed"
        )
    return "\n".join(lines)


def _table_holdings(daemon: "Daemon", clients: Iterable[pb.ClientStat]) -> dict[str, tuple[int, int, int]]:
    """session id -> (leases, bytes loaned, bytes committed) it holds with its bit in the default
    tenant's object table: ``ClientStat`` counts only the objects the daemon keeps itself. An
    object whose producer's bit is set is that producer's; any other bit on it is a lease."""
    book = daemon.tenants[0].objects if daemon.tenants else None
    if book is None:
        return {}
    import numpy as np

    from ..objtable import LOANED

    cols = book.table.columns
    holders = book.table.holders.copy()  # one read: the words keep changing under us
    holdings: dict[str, tuple[int, int, int]] = {}
    for c in clients:
        bit = book.bit_of(c.session_id)
        if bit is None:
            continue
        held = (holders & np.uint64(1 << bit)) != 0
        own = held & (cols["owner"] == bit)
        holdings[c.session_id] = (
            int((held & ~own).sum()),
            int(cols["nbytes"][own & (cols["state"] == LOANED)].sum()),
            int(cols["nbytes"][own & (cols["state"] != LOANED)].sum()),
        )
    return holdings


_warmed_up = False


def warm_up_process_state() -> None:
    """Create, once, the process-wide state that gRPC, the client and multiprocessing's spawn keep
    for the whole process (gRPC's poller fds, the resource tracker's pipe), so a later fd check sees
    only what a test itself opened. Starts and stops a tiny daemon; idempotent."""
    global _warmed_up
    if _warmed_up:
        return
    _warmed_up = True
    import multiprocessing.resource_tracker

    from ..client import Consumer

    multiprocessing.resource_tracker.ensure_running()
    daemon = start_daemon(arena_nbytes=1 << 20)
    try:
        with Consumer(daemon.socket_path, timeout_s=10) as c:
            c.stat()
    finally:
        stop_daemon(daemon)
    # gRPC closes its poller fds when the last server object is collected and reopens them for the
    # next one: keeping this (stopped) daemon object keeps them open for the whole process.
    keep_alive(daemon)


_keepalive: list[Daemon] = []


def keep_alive(daemon: "Daemon") -> None:
    """Keep a (stopped) daemon object for the rest of the process, as ``warm_up_process_state``
    does with its own: gRPC keeps its process-wide poller fds open while a server object lives."""
    _keepalive.append(daemon)
