"""Plain helpers for testing code that uses shmtransport (the pytest plugin builds on these).

Nothing here imports gRPC, the daemon or torch at import time; ``start_daemon`` imports the daemon
when called.

- ``run_in_child(fn, *args, timeout_s=...)``: run a module-level function in a ``spawn`` process and
  return its result, or re-raise its exception (same class, same ``reason``) with the child's
  traceback attached as a note (``ChildError`` when it cannot be rebuilt, ``ChildTimeout``).
- ``start_children(fn, arg_list)``: the same for several children at once.
- ``BlockingChild(fn, *args)``: a ``spawn`` child that reports over a Pipe and then blocks, so a
  test can ``kill()`` (SIGKILL) it at a known point, or ``finish()`` it cleanly.
- ``hold_until_told``: a ``BlockingChild`` body holding one object (e.g. a full arena) until told.
- ``wait_until(predicate, timeout_s=...)``: poll with a deadline instead of sleeping.
- ``LeakSnapshot`` / ``LeakCheck``: /dev/shm entries, open fds, live children and a daemon's live
  leases before/after a test, and a readable list of what leaked (leases and loans with the call
  site that took them). ``LeakCheck`` counts only the /dev/shm entries this test's processes made.
- ``start_daemon(**overrides)`` / ``stop_daemon(daemon)``: an in-process ``Daemon`` on a short
  socket path with a unique name prefix and a small arena; stopping reports leftover segments.
- ``short_tmpdir()``, ``unique_prefix()``, ``parse_nbytes("64M")``.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import itertools
import multiprocessing
import multiprocessing.connection
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import time
import traceback
from typing import TYPE_CHECKING, Any, Callable, Iterable

from . import _call_sites
from .shm_names import SHM_DIR

if TYPE_CHECKING:  # pragma: no cover
    from .daemon import Daemon

__all__ = [
    "BlockingChild",
    "ChildError",
    "ChildTimeout",
    "DEFAULT_ARENA_NBYTES",
    "LeakCheck",
    "LeakSnapshot",
    "RUN_PREFIX",
    "SHM_DIR",
    "describe_daemon_state",
    "hold_until_told",
    "open_fds",
    "parse_nbytes",
    "remove_tree",
    "run_in_child",
    "segments_of",
    "settle_daemon",
    "shm_entries",
    "short_tmpdir",
    "start_children",
    "start_daemon",
    "stop_daemon",
    "unique_prefix",
    "wait_until",
    "warm_up_process_state",
]

SPAWN = multiprocessing.get_context("spawn")

DEFAULT_CHILD_TIMEOUT_S = 60.0
DEFAULT_ARENA_NBYTES = 64 << 20
DAEMON_SETTLE_S = 3.0

# Every daemon this process starts through ``unique_prefix`` has a name prefix starting with
# RUN_PREFIX, so a leak check can tell this run's segments from those of anyone else sharing
# /dev/shm (even another run of the same suite). "shmtpy" + 6 hex here, + 2 (or more) hex per daemon.
RUN_PREFIX = "shmtpy" + secrets.token_hex(3)
_prefix_counter = itertools.count()


def unique_prefix() -> str:
    """A fresh segment-name prefix for one daemon ([A-Za-z0-9_.], short, unique in this process)."""
    return f"{RUN_PREFIX}{next(_prefix_counter):02x}"


_NBYTES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_nbytes(text: str | int) -> int:
    """``"64M"``, ``"1G"``, ``"512k"``, ``"64MiB"``, ``"4096"`` → bytes (binary units)."""
    if isinstance(text, int):
        nbytes = text
    else:
        m = _NBYTES_RE.match(str(text))
        if not m:
            raise argparse.ArgumentTypeError(f"not a size: {text!r} (use bytes or a K/M/G/T suffix, e.g. 64M)")
        nbytes = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if nbytes <= 0:
        raise argparse.ArgumentTypeError(f"a size must be positive, got {text!r}")
    return nbytes


class ChildError(RuntimeError):
    """A child failed with an exception that could not be rebuilt in the parent."""


class ChildTimeout(TimeoutError):
    """A child did not answer in time (it was killed)."""


# -- polling -------------------------------------------------------------------------------------
def wait_until(predicate: Callable[[], Any], timeout_s: float = 5.0, interval_s: float = 0.01, what: str = "") -> Any:
    """Poll ``predicate`` until it returns something truthy; that value, or TimeoutError."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"condition not met within {timeout_s} s: {what or predicate!r} (last {value!r})")
        time.sleep(interval_s)


def short_tmpdir(prefix: str = "shmtt") -> str:
    """A fresh directory under /tmp (pytest's tmp_path can exceed the 108-byte AF_UNIX limit)."""
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


def remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


# -- exceptions across the process boundary ------------------------------------------------------
def _pack_exception(exc: BaseException) -> tuple:
    """Plain data only (type path, message, reason, traceback text): the parent rebuilds the
    exception by its type, so nothing is unpickled beyond strings."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    reason = getattr(exc, "reason", None)
    reason = getattr(reason, "value", reason)
    return ("err", type(exc).__module__, type(exc).__qualname__, str(exc), reason, text)


def _rebuild_exception(module: str, qualname: str, message: str, reason: Any) -> BaseException | None:
    try:
        cls: Any = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
    except (ImportError, AttributeError):
        return None
    if not (isinstance(cls, type) and issubclass(cls, BaseException)):
        return None
    try:
        from .errors import Reason, ShmTransportError

        if issubclass(cls, ShmTransportError):
            return cls(message, Reason(reason) if reason is not None else None)
        return cls(message)
    except Exception:  # a constructor with another signature: report it generically
        return None


def _unpack_exception(msg: tuple) -> BaseException:
    _, module, qualname, text, reason, child_tb = msg
    exc = _rebuild_exception(module, qualname, text, reason)
    if exc is None:
        exc = ChildError(f"{module}.{qualname}: {text}")
    exc.add_note(f"--- traceback in the child process ---\n{child_tb.rstrip()}")
    return exc


def _child_main(conn: multiprocessing.connection.Connection, fn: Callable, args: tuple, kwargs: dict) -> None:
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        conn.send(_pack_exception(exc))
    else:
        conn.send(("ok", result))
    finally:
        conn.close()


def _join_or_kill(proc: multiprocessing.process.BaseProcess, timeout_s: float) -> None:
    proc.join(timeout_s)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


def run_in_child(fn: Callable, *args: Any, timeout_s: float = DEFAULT_CHILD_TIMEOUT_S, **kwargs: Any) -> Any:
    """Run module-level ``fn(*args, **kwargs)`` in a spawned process; its result or its exception."""
    parent, child = SPAWN.Pipe(duplex=False)
    proc = SPAWN.Process(target=_child_main, args=(child, fn, args, kwargs), daemon=True)
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout_s):
            raise ChildTimeout(f"{fn.__name__} did not finish within {timeout_s} s")
        try:
            msg = parent.recv()
        except EOFError:
            proc.join(5)
            raise ChildError(f"{fn.__name__}: child died without an answer (exit code {proc.exitcode})") from None
    finally:
        parent.close()
        _join_or_kill(proc, 5)
    if msg[0] == "ok":
        return msg[1]
    raise _unpack_exception(msg)


def start_children(fn: Callable, arg_list: list[tuple], timeout_s: float = DEFAULT_CHILD_TIMEOUT_S) -> list[Any]:
    """Run ``fn(*args)`` for every args tuple concurrently (one spawned process each); all results.

    The first failure (in argument order) is re-raised after every child has been collected.
    """
    procs = []
    try:
        for args in arg_list:
            parent, child = SPAWN.Pipe(duplex=False)
            proc = SPAWN.Process(target=_child_main, args=(child, fn, tuple(args), {}), daemon=True)
            proc.start()
            child.close()
            procs.append((proc, parent))
        deadline = time.monotonic() + timeout_s
        messages = []
        for proc, parent in procs:
            if not parent.poll(max(0.0, deadline - time.monotonic())):
                raise ChildTimeout(f"{fn.__name__} (pid {proc.pid}) did not finish within {timeout_s} s")
            try:
                messages.append(parent.recv())
            except EOFError:
                proc.join(5)
                raise ChildError(f"{fn.__name__}: child {proc.pid} died without an answer ({proc.exitcode})") from None
    finally:
        for _proc, parent in procs:
            parent.close()
        for proc, _ in procs:
            _join_or_kill(proc, 5)
    for msg in messages:
        if msg[0] != "ok":
            raise _unpack_exception(msg)
    return [msg[1] for msg in messages]


# -- a child that blocks at a known point --------------------------------------------------------
def _blocking_main(conn: multiprocessing.connection.Connection, fn: Callable, args: tuple) -> None:
    try:
        result = fn(conn, *args)
    except BaseException as exc:  # noqa: BLE001
        try:
            conn.send(_pack_exception(exc))
        except OSError:
            pass
    else:
        try:
            conn.send(("done", result))
        except OSError:
            pass
    finally:
        conn.close()


class BlockingChild:
    """A spawned child running ``fn(conn, *args)`` that talks to the test over a duplex Pipe.

    ``fn`` reports with ``conn.send(value)`` (any picklable value), then typically blocks in
    ``conn.recv()``. The test reads reports with ``recv(timeout_s)``, can ``send`` to it, ``kill()`` it
    (SIGKILL, at exactly the point it reported) or ``finish()`` it (returns what ``fn`` returned).
    An exception in the child is re-raised by the next ``recv``/``finish``.
    """

    def __init__(self, fn: Callable, *args: Any):
        self._conn, child = SPAWN.Pipe(duplex=True)
        self.process = SPAWN.Process(target=_blocking_main, args=(child, fn, args), daemon=True)
        self.process.start()
        child.close()
        self._done: tuple | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def recv(self, timeout_s: float = DEFAULT_CHILD_TIMEOUT_S) -> Any:
        if not self._conn.poll(timeout_s):
            raise ChildTimeout(f"child {self.pid} sent nothing within {timeout_s} s")
        try:
            msg = self._conn.recv()
        except EOFError:
            self.process.join(5)
            raise ChildError(f"child {self.pid} died (exit code {self.process.exitcode})") from None
        if isinstance(msg, tuple) and msg and msg[0] == "err" and len(msg) == 6:
            raise _unpack_exception(msg)
        if isinstance(msg, tuple) and len(msg) == 2 and msg[0] == "done":
            self._done = msg
            raise ChildError(f"child {self.pid} returned {msg[1]!r} instead of reporting")
        return msg

    def send(self, value: Any) -> None:
        self._conn.send(value)

    def kill(self, timeout_s: float = 10.0) -> int:
        """SIGKILL the child and reap it; its exit code (-9)."""
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(timeout_s)
        if self.process.is_alive():
            raise ChildTimeout(f"child {self.pid} survived SIGKILL for {timeout_s} s")
        self._conn.close()
        return self.process.exitcode

    def finish(self, message: Any = "exit", timeout_s: float = DEFAULT_CHILD_TIMEOUT_S) -> Any:
        """Send ``message``, wait for ``fn`` to return; its return value (or its exception)."""
        if self._done is None:
            try:
                self._conn.send(message)
            except OSError:
                pass
            if not self._conn.poll(timeout_s):
                self.kill()
                raise ChildTimeout(f"child {self.pid} did not finish within {timeout_s} s")
            try:
                msg = self._conn.recv()
            except EOFError:
                self.process.join(5)
                raise ChildError(f"child {self.pid} died (exit code {self.process.exitcode})") from None
            if msg[0] == "err":
                self.kill()
                raise _unpack_exception(msg)
            self._done = msg
        _join_or_kill(self.process, timeout_s)
        self._conn.close()
        return self._done[1]

    def close(self) -> None:
        """Kill if still running (idempotent); for ``finally``/``with``."""
        if self.process.is_alive():
            self.kill()
        else:
            self.process.join(1)
            self._conn.close()

    def __enter__(self) -> "BlockingChild":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def hold_until_told(conn: multiprocessing.connection.Connection, socket_path: str, nbytes: int) -> None:
    """A ``BlockingChild`` body: put one object of ``nbytes`` (say, as large as the arena), report
    "full", release it when told and report "released", then wait to be finished."""
    import numpy as np

    from .client import Producer

    with Producer(socket_path, timeout_s=DEFAULT_CHILD_TIMEOUT_S, alloc_wait_s=0) as producer:
        handle = producer.put(np.ones(nbytes, np.uint8))
        conn.send("full")
        conn.recv()
        producer.release(handle, wait=True)
        conn.send("released")
        conn.recv()


# -- leak snapshots ------------------------------------------------------------------------------
def shm_entries() -> set[str]:
    return set(os.listdir(SHM_DIR))


def segments_of(prefix: str) -> list[str]:
    """/dev/shm entries of the daemon(s) with this exact name prefix (``PREFIX-...``)."""
    return sorted(name for name in shm_entries() if name.startswith(prefix + "-"))


def open_fds() -> dict[int, str]:
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass  # the fd of the listdir itself, or one closed meanwhile
    return fds


def _process_global_fds() -> set[int]:
    """fds that process-wide machinery opens once and keeps (multiprocessing's resource tracker
    pipe, opened by the first ``spawn``): not a test's leak."""
    fds = set()
    try:
        from multiprocessing import resource_tracker

        fd = getattr(resource_tracker._resource_tracker, "_fd", None)
        if isinstance(fd, int):
            fds.add(fd)
    except Exception:  # pragma: no cover - best effort
        pass
    return fds


class LeakSnapshot:
    """What a test may not leave behind: /dev/shm entries, open fds, child processes."""

    def __init__(self) -> None:
        gc.collect()
        self.shm = shm_entries()
        self.fds = open_fds()

    def new_shm_entries(self) -> set[str]:
        """Entries that appeared since the snapshot and are still there, whoever made them
        (``LeakCheck`` tells this test's from other processes')."""
        return shm_entries() - self.shm

    def fd_growth(self, settle_s: float = 2.0, ignore: Iterable[int] = ()) -> dict[int, str]:
        """fds opened since the snapshot that stay open for ``settle_s`` (gRPC closes lazily)."""
        ignore = set(ignore) | (_process_global_fds() - set(self.fds))
        base = len(self.fds)
        deadline = time.monotonic() + settle_s
        while True:
            gc.collect()
            now = {fd: target for fd, target in open_fds().items() if fd not in ignore}
            grown = {fd: target for fd, target in now.items() if fd not in self.fds}
            if len(now) <= base or time.monotonic() >= deadline:
                return grown if len(now) > base else {}
            time.sleep(0.05)

    @staticmethod
    def live_children(settle_s: float = 2.0) -> list:
        deadline = time.monotonic() + settle_s
        while True:
            children = multiprocessing.active_children()  # also reaps finished ones
            if not children or time.monotonic() >= deadline:
                return children
            time.sleep(0.05)


# -- daemons -------------------------------------------------------------------------------------
def start_daemon(**overrides: Any) -> "Daemon":
    """Start an in-process ``Daemon``: socket in a fresh short directory under /tmp (AF_UNIX paths
    are limited to 108 bytes), ``unique_prefix()``, a ``DEFAULT_ARENA_NBYTES`` arena; any
    ``DaemonConfig`` field can be overridden. ``stop_daemon`` undoes all of it."""
    from .daemon import Daemon

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
    daemon._shmt_testing_tmpdir = tmp  # removed by stop_daemon
    return daemon


def stop_daemon(daemon: "Daemon", grace_s: float = 1.0) -> list[str]:
    """Stop the daemon, remove its socket directory, and check /dev/shm: the names of segments of
    its prefix that were still there (they are unlinked now, so nothing accumulates)."""
    try:
        daemon.stop(grace_s=grace_s)
    finally:
        tmp = getattr(daemon, "_shmt_testing_tmpdir", None)
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
                  timeout_s: float = DAEMON_SETTLE_S):
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


def describe_daemon_state(daemon: "Daemon", stat=None) -> str:
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


def _table_holdings(daemon: "Daemon", clients) -> dict[str, tuple[int, int, int]]:
    """session id -> (leases, bytes loaned, bytes committed) it holds with its bit in the default
    tenant's object table: ``ClientStat`` counts only the objects the daemon keeps itself. An
    object whose producer's bit is set is that producer's; any other bit on it is a lease."""
    book = daemon.tenants[0].objects if daemon.tenants else None
    if book is None:
        return {}
    import numpy as np

    from .objtable import LOANED

    cols = book.table.columns
    holders = cols["holders"].copy()  # one read: the words keep changing under us
    holdings = {}
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


def _indent(text: str, by: str = "    ") -> str:
    return "\n".join(by + line for line in text.splitlines())


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

    from .client import Consumer

    multiprocessing.resource_tracker.ensure_running()
    daemon = start_daemon(arena_nbytes=1 << 20)
    try:
        with Consumer(daemon.socket_path, timeout_s=10) as c:
            c.stat()
    finally:
        stop_daemon(daemon)
    # gRPC closes its poller fds when the last server object is collected and reopens them for the
    # next one: keeping this (stopped) daemon object keeps them open for the whole process.
    _keepalive.append(daemon)


_keepalive: list = []


# -- which new /dev/shm entries are a test's own ----------------------------------------------
_SHM_PATH_PREFIX = SHM_DIR + "/"
# One set per recording LeakCheck: the /dev/shm names this process opened or mapped meanwhile.
# A tuple, replaced whole, so that the audit hook (any thread) reads it without a lock.
_recorders: tuple[set[str], ...] = ()
_audit_hook_added = False


def _record_shm_access(event: str, args: tuple) -> None:
    """Audit hook: the /dev/shm name behind a Python ``open``/``os.open`` or ``mmap`` (how
    ``multiprocessing.shared_memory`` creates and attaches segments; shm_open itself raises no
    audit event). Added once for the rest of the process; returns at once while nothing records."""
    recorders = _recorders
    if not recorders:
        return
    try:
        if event == "open" and not isinstance(args[0], int):
            path = os.path.abspath(os.fsdecode(args[0]))
        elif event == "mmap.__new__" and args[0] >= 0:
            path = os.readlink(f"/proc/self/fd/{args[0]}")
        else:
            return
    except (OSError, TypeError, ValueError):
        return  # an exception here would fail the audited call itself
    name = path[len(_SHM_PATH_PREFIX):]
    if path.startswith(_SHM_PATH_PREFIX) and name and "/" not in name:
        for names in recorders:
            names.add(name)


def _start_recording(names: set[str]) -> None:
    global _recorders, _audit_hook_added
    if not _audit_hook_added:
        # Cannot be removed: between checks it costs one Python call per audited event (about
        # 0.5 us; id() is one) for the rest of the process.
        sys.addaudithook(_record_shm_access)
        _audit_hook_added = True
    _recorders = (*_recorders, names)
    _call_sites.enabled = True


def _stop_recording(names: set[str]) -> None:
    global _recorders
    _recorders = tuple(r for r in _recorders if r is not names)
    _call_sites.enabled = bool(_recorders)


def _process_tree(root: int) -> list[int]:
    """``root`` and its descendants, from every process's parent pid in /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])  # the command name may hold spaces
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


def _held_shm_names(pids: Iterable[int]) -> set[str]:
    """Names of the /dev/shm entries these processes have open (an fd) or mapped."""
    paths: set[str] = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            fds = []  # exited, or not ours to read
        for fd in fds:
            try:
                paths.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                pass
        try:
            with open(f"/proc/{pid}/maps") as f:
                paths.update(line.split(maxsplit=5)[-1].rstrip("\n") for line in f)  # the pathname, if any
        except OSError:
            pass
    return {p[len(_SHM_PATH_PREFIX):] for p in paths if p.startswith(_SHM_PATH_PREFIX)}


class LeakCheck:
    """One test's leak check: snapshot and recording from construction, ``problems()`` at the end.

    Fails on: new /dev/shm entries of the test's own (below), fds left open (number and readlink
    target), live child processes (killed), and whatever was ``report``ed (daemon fixtures report
    live leases and objects; ``check_daemon`` lists each lease and loan still held with the call
    site that took it: while the check records, leases and loans made in this process remember it).

    A new /dev/shm entry (not there at construction, still there at ``problems()``) is the test's
    own when
      1. its name starts with an owned prefix: ``RUN_PREFIX`` (random per process, so per xdist
         worker; ``start_daemon`` names every daemon with it, the plugin's fixtures included), the
         name prefix of a daemon given to ``watch_daemon``, one of ``shm_prefixes`` or of
         ``own_shm``; or
      2. this process opened or mapped it meanwhile through Python: ``open``/``os.open`` of a
         /dev/shm path, ``mmap`` of its fd (``multiprocessing.shared_memory`` creating or
         attaching), as an audit hook sees them; or
      3. this process or one of its descendants has it open or mapped at the end (what C code or a
         child made and still holds).
    Any other new entry (another xdist worker's arena, anyone else's segment) is not counted: it
    is returned as a note. Not seen: an entry a child process made under a name without an owned
    prefix and let go of before the end; own its prefix (``shm_prefixes``, ``own_shm``). The
    empty prefix ``""`` owns every new entry (the strict check, for a machine nobody else uses).

    Knobs a test may turn: ``check_shm``, ``check_fds``, ``check_children``, ``check_leases``,
    ``own_shm(prefix)``, ``ignore_shm(prefix)``, ``ignore_fds(*fds)``.
    """

    def __init__(self, shm_prefixes: str | Iterable[str] | None = None, fd_settle_s: float = 2.0) -> None:
        self.check_shm = True
        self.check_fds = True
        self.check_children = True
        self.check_leases = True
        self.fd_settle_s = fd_settle_s
        if shm_prefixes is None:
            shm_prefixes = ()
        elif isinstance(shm_prefixes, str):
            shm_prefixes = (shm_prefixes,)
        self._owned_prefixes: list[str] = [RUN_PREFIX, *shm_prefixes]
        self._ignored_prefixes: list[str] = []
        self._ignored_fds: set[int] = set()
        self._reported: list[str] = []
        self._baselines: dict[int, int] = {}  # id(daemon) -> live leases when first seen
        self._opened: set[str] = set()  # /dev/shm names this process opened or mapped meanwhile
        _start_recording(self._opened)
        self._call_mark = _call_sites.mark()
        self.snapshot = LeakSnapshot()

    def stop(self) -> None:
        """End the recording (of /dev/shm opens and of call sites); ``problems()`` does it too."""
        _stop_recording(self._opened)

    def own_shm(self, prefix: str) -> None:
        """Count new /dev/shm entries whose name starts with ``prefix`` as this test's."""
        self._owned_prefixes.append(prefix)

    def ignore_shm(self, prefix: str) -> None:
        """Leave new /dev/shm entries whose name starts with ``prefix`` out of the check."""
        self._ignored_prefixes.append(prefix)

    def ignore_fds(self, *fds: int) -> None:
        self._ignored_fds.update(fds)

    def report(self, problem: str) -> None:
        self._reported.append(problem)

    def watch_daemon(self, daemon: "Daemon") -> None:
        """Own the daemon's name prefix and remember its live leases now: ``check_daemon``
        reports only growth (a daemon shared by many tests may hold what earlier tests left)."""
        if id(daemon) not in self._baselines and not daemon.closed:
            self.own_shm(daemon.config.name_prefix)
            self._baselines[id(daemon)] = daemon.stat().live_leases

    def check_daemon(self, daemon: "Daemon", timeout_s: float = DAEMON_SETTLE_S) -> bool:
        """Report leases this test left live on ``daemon`` (after a short settle); True if any."""
        if not self.check_leases or daemon.closed:
            return False
        base = self._baselines.get(id(daemon), 0)
        s = settle_daemon(daemon, max_leases=base, timeout_s=timeout_s)
        if s.live_leases > base:
            self.report(f"live leases left at the end of the test ({s.live_leases - base} new):\n"
                        + _indent(describe_daemon_state(daemon, s)) + self.describe_held(daemon))
            return True
        return False

    def held(self, daemon: "Daemon") -> list[str]:
        """``<lease or loan> acquired|loaned at FILE:LINE in FUNCTION`` for each lease and
        uncommitted loan on ``daemon`` made in this process since the check started that still
        holds its bytes: not released (or released while the caller keeps a view of it), by a
        client not closed."""
        from .client import Loan

        lines = []
        for view, site in _call_sites.since(self._call_mark):
            if view.handle.shm.instance_id != daemon.instance_id or view._client.closed:
                continue
            loan = isinstance(view, Loan)
            if (loan and view.committed) or (view.closed and view._memory is None):
                continue  # committed (the handle is the reference now), or released
            note = " (released, but a view of its bytes is still alive)" if view.closed else ""
            lines.append(f"{view!r} {'loaned' if loan else 'acquired'} at {site}{note}")
        return lines

    def describe_held(self, daemon: "Daemon") -> str:
        """``held(daemon)`` as report lines (empty if none)."""
        return "".join(f"\n    {line}" for line in self.held(daemon))

    def new_shm_entries(self) -> tuple[set[str], set[str]]:
        """(the test's own, other processes') new /dev/shm entries, as the class docstring says;
        ignored ones in neither."""
        ignored = tuple(self._ignored_prefixes)
        new = {name for name in self.snapshot.new_shm_entries() if not name.startswith(ignored)}
        owned = tuple(self._owned_prefixes)
        others = {name for name in new if not name.startswith(owned) and name not in self._opened}
        if others:
            others -= _held_shm_names(_process_tree(os.getpid()))
        return new - others, others

    def problems(self) -> tuple[list[str], list[str]]:
        """(problems, notes); also kills live children it reports."""
        self.stop()
        problems = list(self._reported)
        notes: list[str] = []
        children = LeakSnapshot.live_children() if self.check_children else []
        if children:
            problems.append(f"child processes still alive: {children}")
        if self.check_shm:  # before the children are killed: what they hold is the test's
            ours, others = self.new_shm_entries()
            if ours:
                problems.append("/dev/shm entries left behind: " + ", ".join(
                    os.path.join(SHM_DIR, n) for n in sorted(ours)))
            if others:
                notes.append("new /dev/shm entries of other processes, not counted (no prefix of this run, "
                             f"not opened, mapped or held by this test's processes): {sorted(others)}")
        for child in children:
            child.kill()
            child.join(5)
        if self.check_fds:
            grown = self.snapshot.fd_growth(self.fd_settle_s, ignore=self._ignored_fds)
            if grown:
                problems.append("fds left open: " + ", ".join(f"{fd} -> {t}" for fd, t in sorted(grown.items())))
        return problems, notes

    def failure_message(self, problems: list[str]) -> str:
        return "test left resources behind:\n  " + "\n  ".join(problems)
