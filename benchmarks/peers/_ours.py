"""shmtransport itself: the import guard and the daemon process (a third, spawned process).

Coded against the client API in the task brief::

    Daemon(socket_path=..., arena_nbytes=...).start() / .stop()
    Producer(socket_path, timeout_s=...) .put(array, digest=) .loan(nbytes=) -> loan.array, loan.commit()
        .release(handle) ; Handle.to_bytes() / Handle.from_bytes()
    Consumer(socket_path, timeout_s=...) .acquire_bytes(handle bytes) -> lease.array, lease.release()
"""
from __future__ import annotations

import os
import time

from .common import CTX, IDLE_POLL_S, START_TIMEOUT_S, stop_process, wait_reply

CLIENT_TIMEOUT_S = 10.0


def import_error() -> str | None:
    """None when the daemon and client are importable, else why not."""
    try:
        from shmtransport.client import Consumer, Handle, Producer  # noqa: F401
        from shmtransport.daemon import Daemon  # noqa: F401
    except Exception as exc:  # noqa: BLE001 — ImportError, or a half-landed module failing at import
        return f"{type(exc).__name__}: {exc}"
    return None


def client():
    from shmtransport import client as mod

    return mod


def _daemon_main(socket_path: str, arena_nbytes: int, object_slots: int | None, conn) -> None:
    import multiprocessing as mp
    import traceback

    daemon = None
    try:
        from shmtransport.daemon import Daemon

        daemon = Daemon(socket_path=socket_path, arena_nbytes=arena_nbytes, object_slots=object_slots)
        daemon.start()
        conn.send(("ready", int(getattr(daemon, "pid", None) or os.getpid())))
        parent = mp.parent_process()
        while not conn.poll(IDLE_POLL_S):
            if parent is not None and not parent.is_alive():
                return
        conn.recv()  # ("stop",)
        daemon.stop()
        daemon = None
        conn.send(("bye",))
    except BaseException:  # noqa: BLE001
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:  # noqa: BLE001
            pass
    finally:
        if daemon is not None:
            try:
                daemon.stop()
            except Exception:  # noqa: BLE001
                pass
        conn.close()


class DaemonProcess:
    """shmtransportd in a spawned process; ``pid`` is the process whose RSS is reported."""

    def __init__(self, socket_path: str, arena_nbytes: int, object_slots: int | None = None):
        """``object_slots``: the tenant's object table (None: the daemon's default for the arena)."""
        self.socket_path = socket_path
        self.arena_nbytes = arena_nbytes
        self.object_slots = object_slots
        self.proc = None
        self.conn = None
        self.pid: int | None = None

    def start(self) -> "DaemonProcess":
        parent, child = CTX.Pipe(duplex=True)
        self.proc = CTX.Process(target=_daemon_main, name="shmtransportd",
                                args=(self.socket_path, self.arena_nbytes, self.object_slots, child), daemon=True)
        self.proc.start()
        child.close()
        self.conn = parent
        try:
            _, self.pid = wait_reply(parent, START_TIMEOUT_S, "daemon")
            deadline = time.monotonic() + 10.0
            while not os.path.exists(self.socket_path) and time.monotonic() < deadline:
                time.sleep(0.01)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, self.conn, "daemon")
            self.proc = None
            self.conn = None

    def __enter__(self) -> "DaemonProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
