"""Leak checks for tests: ``LeakSnapshot`` (/dev/shm entries, open fds, live children) and
``LeakCheck`` (one test's check: which new /dev/shm entries are its own, fds left open, live
children, and the leases and loans it left on a daemon with the call site that took each)."""
from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Any, Iterable

from .. import _call_sites
from ..shm_names import SHM_DIR
from .daemons import DAEMON_SETTLE_S, describe_daemon_state, settle_daemon
from .util import RUN_PREFIX, indent, shm_entries

if TYPE_CHECKING:  # pragma: no cover
    from ..daemon import Daemon


# -- leak snapshots ------------------------------------------------------------------------------
def open_fds() -> dict[int, str]:
    """This process's open fds, each with its ``readlink`` target."""
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
        self.descendants = set(_live_descendants())

    def new_shm_entries(self) -> set[str]:
        """Entries that appeared since the snapshot and are still there, whoever made them
        (``LeakCheck`` tells this test's from other processes')."""
        return shm_entries() - self.shm

    def fd_growth(self, settle_s: float = 2.0, ignore: Iterable[int] = (),
                  reported: Iterable[str] = ()) -> dict[int, str]:
        """fds opened since the snapshot that stay open for ``settle_s`` (gRPC closes lazily). No
        wait once every such fd is on one of ``reported`` (paths of leaks the test fails for
        anyway): settling only keeps fds that close late out of the report."""
        ignore = set(ignore) | (_process_global_fds() - set(self.fds))
        reported = set(reported)
        base = len(self.fds)
        deadline = time.monotonic() + settle_s
        while True:
            gc.collect()
            now = {fd: target for fd, target in open_fds().items() if fd not in ignore}
            grown = {fd: target for fd, target in now.items() if fd not in self.fds}
            if len(now) <= base or time.monotonic() >= deadline or reported.issuperset(grown.values()):
                return grown if len(now) > base else {}
            time.sleep(0.05)

    def live_children(self, settle_s: float = 2.0) -> dict[int, str]:
        """Descendant processes started since the snapshot that are still running after
        ``settle_s`` (pid -> command line), however they were started: ``multiprocessing``,
        ``subprocess``, ``os.fork``, or a grandchild of any of them. Exited ones not yet reaped
        (zombies) and process-wide helpers (multiprocessing's resource tracker) do not count."""
        deadline = time.monotonic() + settle_s
        while True:
            multiprocessing.active_children()  # reaps finished multiprocessing children
            ignore = self.descendants | _process_global_pids()
            alive = {pid: cmd for pid, cmd in _live_descendants().items() if pid not in ignore}
            if not alive or time.monotonic() >= deadline:
                return alive
            time.sleep(0.05)


def _process_global_pids() -> set[int]:
    """Helper processes that process-wide machinery starts once and keeps (multiprocessing's
    resource tracker, started by the first ``spawn``): not a test's leak."""
    from multiprocessing import resource_tracker

    pid = getattr(resource_tracker._resource_tracker, "_pid", None)
    return {pid} if isinstance(pid, int) else set()


def _live_descendants() -> dict[int, str]:
    """This process's running descendants (pid -> command line), zombies left out."""
    live = {}
    for pid in _process_tree(os.getpid())[1:]:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError):
            continue  # exited meanwhile
        if state not in (b"Z", b"X"):
            live[pid] = cmdline
    return live


def _kill(pids: Iterable[int], timeout_s: float = 5.0) -> None:
    """SIGKILL each process; reap the ones that are our own children."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    break
            except ChildProcessError:
                break  # a grandchild (its parent reaps it), or reaped by its owner meanwhile
            time.sleep(0.01)


# -- which new /dev/shm entries are a test's own ----------------------------------------------
_SHM_PATH_PREFIX = SHM_DIR + "/"
# One set per recording LeakCheck: the /dev/shm names this process opened or mapped meanwhile.
# A tuple, replaced whole, so that the audit hook (any thread) reads it without a lock.
_recorders: tuple[set[str], ...] = ()
_audit_hook_added = False


def _record_shm_access(event: str, args: tuple[Any, ...]) -> None:
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
        self._watched: list[Daemon] = []
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
        """Do not count these fds as leaked (opened on purpose, closed by someone else)."""
        self._ignored_fds.update(fds)

    def report(self, problem: str) -> None:
        """Record a problem found by someone else (a daemon fixture); the check then fails with it."""
        self._reported.append(problem)

    def watch_daemon(self, daemon: "Daemon") -> None:
        """Own the daemon's name prefix and remember its live leases now: ``check_daemon``
        reports only growth (a daemon shared by many tests may hold what earlier tests left)."""
        if id(daemon) not in self._baselines and not daemon.closed:
            self.own_shm(daemon.config.name_prefix)
            self._watched.append(daemon)
            self._baselines[id(daemon)] = daemon.stat().live_leases

    def check_daemon(self, daemon: "Daemon", timeout_s: float = DAEMON_SETTLE_S) -> bool:
        """Report leases this test left live on ``daemon`` (after a short settle); True if any."""
        if not self.check_leases or daemon.closed:
            return False
        base = self._baselines.get(id(daemon), 0)
        s = settle_daemon(daemon, max_leases=base, timeout_s=timeout_s)
        if s.live_leases > base:
            self.report(f"live leases left at the end of the test ({s.live_leases - base} new):\n"
                        + indent(describe_daemon_state(daemon, s)) + self.describe_held(daemon))
            return True
        return False

    def held(self, daemon: "Daemon") -> list[str]:
        """``<lease or loan> acquired|loaned at FILE:LINE in FUNCTION`` for each lease and
        uncommitted loan on ``daemon`` made in this process since the check started that still
        holds its bytes: not released (or released while the caller keeps a view of it), by a
        client not closed."""
        from ..client import Lease, Loan

        lines = []
        for view, site in _call_sites.since(self._call_mark):
            if not isinstance(view, (Lease, Loan)):
                continue  # only leases and loans are recorded
            if view.handle.shm.instance_id != daemon.instance_id or view._client.closed:
                continue
            loan = isinstance(view, Loan)
            if (isinstance(view, Loan) and view.committed) or (view.closed and view._memory is None):
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
        """(problems, notes); also kills live children it reports and removes the /dev/shm entries
        of its own it reports (no later test, nor the next run, inherits them)."""
        self.stop()
        problems = list(self._reported)
        notes: list[str] = []
        ours: set[str] = set()
        children = self.snapshot.live_children() if self.check_children else {}
        if children:
            problems.append("child processes still alive (killed): " + ", ".join(
                f"pid {pid} ({cmd[:120]})" for pid, cmd in sorted(children.items())))
        if self.check_shm:  # before the children are killed: what they hold is the test's
            ours, others = self.new_shm_entries()
            if ours:
                problems.append("/dev/shm entries left behind: " + ", ".join(
                    os.path.join(SHM_DIR, n) for n in sorted(ours)))
            if others:
                notes.append("new /dev/shm entries of other processes, not counted (no prefix of this run, "
                             f"not opened, mapped or held by this test's processes): {sorted(others)}")
        _kill(children)
        multiprocessing.active_children()  # lets multiprocessing see its killed children exit
        if self.check_fds:
            grown = self.snapshot.fd_growth(self.fd_settle_s, ignore=self._ignored_fds,
                                            reported=(os.path.join(SHM_DIR, n) for n in ours))
            if grown:
                problems.append("fds left open: " + ", ".join(f"{fd} -> {t}" for fd, t in sorted(grown.items())))
        # Except a running daemon's: only a daemon unlinks its segments (docs/design.md, lifetime rule 1).
        running = tuple(d.config.name_prefix for d in self._watched if not d.closed)
        for name in ours:
            if name.startswith(running):
                continue
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                pass  # its owner removed it meanwhile
        return problems, notes

    def failure_message(self, problems: list[str]) -> str:
        """The message a test fails with for these problems."""
        return "test left resources behind:\n  " + "\n  ".join(problems)
