"""Test helpers: child processes (spawn) with exceptions sent back, polling, leak snapshots.

Everything here is generic (no test knowledge) so it can move into a pytest plugin as is:

- ``run_in_child(fn, *args, timeout_s=...)``: run a module-level function in a ``spawn`` process and
  return its result, or re-raise its exception (same class, same ``reason``) with the child's
  traceback attached as a note.
- ``BlockingChild(fn, *args)``: a ``spawn`` child that reports over a Pipe and then blocks, so a
  test can ``kill()`` (SIGKILL) it at a known point, or ``finish()`` it cleanly.
- ``wait_until(predicate, timeout_s=...)``: poll with a deadline instead of sleeping.
- ``LeakSnapshot``: /dev/shm entries, open fds and live children before/after a test.
- ``short_tmpdir()``: a directory short enough for AF_UNIX socket paths (108 bytes).
"""
from __future__ import annotations

import gc
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from typing import Any, Callable

SPAWN = multiprocessing.get_context("spawn")
SHM_DIR = "/dev/shm"
DEFAULT_CHILD_TIMEOUT_S = 60.0


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
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)
    except Exception:
        blob = None
    reason = getattr(exc, "reason", None)
    return ("err", blob, f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc), reason, text)


def _unpack_exception(msg: tuple) -> BaseException:
    _, blob, type_name, text, reason, child_tb = msg
    exc: BaseException | None = None
    if blob is not None:
        try:
            exc = pickle.loads(blob)
        except Exception:
            exc = None
    if exc is None:
        exc = ChildError(f"{type_name}: {text}")
    if reason is not None:
        try:
            exc.reason = reason  # ShmTransportError pickles its message only: restore the reason
        except AttributeError:
            pass
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
        for proc, parent in procs:
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


# -- leak snapshots ------------------------------------------------------------------------------
def shm_entries() -> set[str]:
    return set(os.listdir(SHM_DIR))


def open_fds() -> dict[int, str]:
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass  # the fd of the listdir itself, or one closed meanwhile
    return fds


class LeakSnapshot:
    """What a test may not leave behind: /dev/shm entries, open fds, child processes."""

    def __init__(self, ours_prefix: str) -> None:
        """``ours_prefix``: the segment-name prefix of every daemon this test run starts. Others
        (people's daemons, benchmarks, a concurrent run of the suite) share /dev/shm with us: only
        new entries with our prefix fail a test, other new entries are reported as a warning."""
        gc.collect()
        self.ours_prefix = ours_prefix
        self.shm = shm_entries()
        self.fds = open_fds()

    def new_shm_entries(self) -> tuple[set[str], set[str]]:
        """(ours, foreign) entries that appeared since the snapshot and are still there."""
        new = shm_entries() - self.shm
        ours = {name for name in new if name.startswith(self.ours_prefix)}
        return ours, new - ours

    def fd_growth(self, settle_s: float = 2.0) -> dict[int, str]:
        """fds opened since the snapshot that stay open for ``settle_s`` (gRPC closes lazily)."""
        deadline = time.monotonic() + settle_s
        while True:
            gc.collect()
            now = open_fds()
            grown = {fd: target for fd, target in now.items() if fd not in self.fds}
            if len(now) <= len(self.fds) or time.monotonic() >= deadline:
                return grown if len(now) > len(self.fds) else {}
            time.sleep(0.05)

    @staticmethod
    def live_children(settle_s: float = 2.0) -> list:
        deadline = time.monotonic() + settle_s
        while True:
            children = multiprocessing.active_children()  # also reaps finished ones
            if not children or time.monotonic() >= deadline:
                return children
            time.sleep(0.05)
