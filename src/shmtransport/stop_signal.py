"""Serving until SIGTERM or SIGINT, from a process's main thread (the daemon's and workers' CLIs)."""
from __future__ import annotations

import signal
import threading

# Python runs signal handlers only in the main thread, between bytecodes. A signal the kernel
# delivers to another thread (NIXL's, gRPC's) does not interrupt the main thread's blocking wait,
# so an endless wait could miss it: the wait wakes this often to let a pending handler run.
_RECHECK_S = 0.2


class StopSignal:
    """Set by SIGTERM or SIGINT from the moment it is made (so a signal during start-up counts)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: self._event.set())

    def wait(self) -> None:
        """Until a stop signal arrived."""
        while not self._event.wait(_RECHECK_S):
            pass
