"""Spawned children for tests: ``run_in_child``, ``start_children``, ``BlockingChild`` (and its
``hold_until_told`` body); a child's exception is re-raised in the parent (same class, same
``reason``) with the child's traceback attached as a note."""
from __future__ import annotations

import importlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time
import traceback
from typing import Any, Callable, TypeVar, cast

SPAWN = multiprocessing.get_context("spawn")

DEFAULT_CHILD_TIMEOUT_S = 60.0

_T = TypeVar("_T")
# What a child sends back for an exception: ("err", module, qualname, message, reason, traceback text).
_PackedError = tuple[str, str, str, str, Any, str]


class ChildError(RuntimeError):
    """A child failed with an exception that could not be rebuilt in the parent."""


class ChildTimeout(TimeoutError):
    """A child did not answer in time (it was killed)."""


# -- exceptions across the process boundary ------------------------------------------------------
def _pack_exception(exc: BaseException) -> _PackedError:
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
        from ..errors import Reason, ShmTransportError

        if issubclass(cls, ShmTransportError):
            return cls(message, Reason(reason) if reason is not None else None)
        return cls(message)
    except Exception:  # a constructor with another signature: report it generically
        return None


def _unpack_exception(msg: tuple[Any, ...]) -> BaseException:
    """The exception a ``_pack_exception`` message (as received: unchecked) describes."""
    _, module, qualname, text, reason, child_tb = msg
    exc = _rebuild_exception(module, qualname, text, reason)
    if exc is None:
        exc = ChildError(f"{module}.{qualname}: {text}")
    _add_note(exc, f"--- traceback in the child process ---\n{child_tb.rstrip()}")
    return exc


def _add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, also before Python 3.11 (no ``add_note``): there the note goes into
    ``__notes__`` as ``add_note`` would put it, where pytest shows it."""
    if sys.version_info >= (3, 11):
        exc.add_note(note)
    else:
        exc.__dict__.setdefault("__notes__", []).append(note)


def _child_main(conn: multiprocessing.connection.Connection, fn: Callable[..., Any], args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> None:
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


def run_in_child(fn: Callable[..., _T], *args: Any, timeout_s: float = DEFAULT_CHILD_TIMEOUT_S, **kwargs: Any) -> _T:
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
        return cast(_T, msg[1])  # unpickled: what fn returned in the child
    raise _unpack_exception(msg)


def start_children(fn: Callable[..., _T], arg_list: list[tuple[Any, ...]],
                   timeout_s: float = DEFAULT_CHILD_TIMEOUT_S) -> list[_T]:
    """Run ``fn(*args)`` for every args tuple concurrently (one spawned process each); all results.

    The first failure (in argument order) is re-raised after every child has been collected.
    """
    procs: list[tuple[multiprocessing.context.SpawnProcess, multiprocessing.connection.Connection]] = []
    try:
        for args in arg_list:
            parent, child = SPAWN.Pipe(duplex=False)
            proc = SPAWN.Process(target=_child_main, args=(child, fn, tuple(args), {}), daemon=True)
            proc.start()
            child.close()
            procs.append((proc, parent))
        deadline = time.monotonic() + timeout_s
        messages: list[Any] = []  # unpickled: ("ok", result) or a _PackedError
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
def _blocking_main(conn: multiprocessing.connection.Connection, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
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

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self._conn, child = SPAWN.Pipe(duplex=True)
        self.process = SPAWN.Process(target=_blocking_main, args=(child, fn, args), daemon=True)
        self.process.start()
        child.close()
        self._done: tuple[Any, ...] | None = None  # ("done", what fn returned)

    @property
    def pid(self) -> int:
        """The child's process id."""
        pid = self.process.pid
        if pid is None:  # not reached: started in __init__
            raise ChildError("child process not started")
        return pid

    def recv(self, timeout_s: float = DEFAULT_CHILD_TIMEOUT_S) -> Any:
        """The child's next report; ChildTimeout after ``timeout_s``, the child's exception re-raised."""
        if not self._conn.poll(timeout_s):
            raise ChildTimeout(f"child {self.pid} sent nothing within {timeout_s} s")
        msg = self._receive()
        if isinstance(msg, tuple) and msg and msg[0] == "err" and len(msg) == 6:
            raise _unpack_exception(msg)
        if isinstance(msg, tuple) and len(msg) == 2 and msg[0] == "done":
            self._done = msg
            raise ChildError(f"child {self.pid} returned {msg[1]!r} instead of reporting")
        return msg

    def _receive(self) -> Any:
        """The child's next message (one is waiting); ChildError when it died instead."""
        try:
            return self._conn.recv()
        except EOFError:
            self.process.join(5)
            raise ChildError(f"child {self.pid} died (exit code {self.process.exitcode})") from None

    def send(self, value: Any) -> None:
        """Send ``value`` (picklable) to the child."""
        self._conn.send(value)

    def kill(self, timeout_s: float = 10.0) -> int:
        """SIGKILL the child and reap it; its exit code (-9)."""
        if self.process.is_alive():
            os.kill(self.pid, signal.SIGKILL)
        self.process.join(timeout_s)
        if self.process.is_alive():
            raise ChildTimeout(f"child {self.pid} survived SIGKILL for {timeout_s} s")
        self._conn.close()
        exitcode = self.process.exitcode
        if exitcode is None:  # not reached: a reaped child has one
            raise ChildError(f"child {self.pid} has no exit code")
        return exitcode

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
            msg = self._receive()
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

    def __exit__(self, *exc: object) -> None:
        self.close()


def hold_until_told(conn: multiprocessing.connection.Connection, socket_path: str, nbytes: int) -> None:
    """A ``BlockingChild`` body: put one object of ``nbytes`` (say, as large as the arena), report
    "full", release it when told and report "released", then wait to be finished."""
    import numpy as np

    from ..client import Producer

    with Producer(socket_path, timeout_s=DEFAULT_CHILD_TIMEOUT_S, alloc_wait_s=0) as producer:
        handle = producer.put(np.ones(nbytes, np.uint8))
        conn.send("full")
        conn.recv()
        producer.release(handle, wait=True)
        conn.send("released")
        conn.recv()
