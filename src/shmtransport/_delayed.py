"""One background thread that runs a callable at the earliest time it was asked for.

A client's queued releases go out after a short delay, at once when too many are queued, and
its grants are looked at now and then: all through one long-lived thread per client, started on
first use, instead of a new thread per timer.
"""
from __future__ import annotations

import threading
import time
from typing import Callable


class DelayedCall:
    """Runs ``run`` on one lazily started daemon thread, at the earliest deadline asked for
    (``within``); thread-safe."""

    def __init__(self, run: Callable[[], None], name: str):
        self._run = run
        self._name = name
        self._cv = threading.Condition()
        self._due: float | None = None  # monotonic time of the next run; None: none asked for
        self._stopped = False
        self._thread: threading.Thread | None = None

    def within(self, delay_s: float) -> None:
        """Run at the latest ``delay_s`` from now (an earlier request stands)."""
        due = time.monotonic() + delay_s
        current = self._due
        if current is not None and current <= due:
            # An earlier run stands (read without the lock: the run clears it only once it is
            # about to run, and then sees whatever the caller changed before asking).
            return
        with self._cv:
            if self._stopped or (self._due is not None and self._due <= due):
                return
            self._due = due
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cv.notify()

    @property
    def pending(self) -> bool:
        """Whether a run is asked for and has not started yet."""
        return self._due is not None

    def cancel(self) -> None:
        """Forget the run asked for (a later ``within`` asks again)."""
        with self._cv:
            self._due = None

    def stop(self, timeout_s: float = 5.0) -> None:
        """No more runs; waits for one in progress unless called from it."""
        with self._cv:
            self._stopped, self._due = True, None
            self._cv.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and (self._due is None or self._due > time.monotonic()):
                    self._cv.wait(None if self._due is None else self._due - time.monotonic())
                if self._stopped:
                    return
                self._due = None
            self._run()
