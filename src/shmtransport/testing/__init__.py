"""Plain helpers for testing code that uses shmtransport (the pytest plugin builds on these).

Nothing here imports gRPC, the daemon or torch at import time; ``start_daemon`` imports the daemon
when called. Import what is listed here from ``shmtransport.testing``; the submodules say where it
lives:

- ``children``: ``run_in_child(fn, *args, timeout_s=...)``: run a module-level function in a
  ``spawn`` process and return its result, or re-raise its exception (same class, same ``reason``)
  with the child's traceback attached as a note (``ChildError`` when it cannot be rebuilt,
  ``ChildTimeout``). ``start_children(fn, arg_list)``: the same for several children at once.
  ``BlockingChild(fn, *args)``: a ``spawn`` child that reports over a Pipe and then blocks, so a
  test can ``kill()`` (SIGKILL) it at a known point, or ``finish()`` it cleanly.
  ``hold_until_told``: a ``BlockingChild`` body holding one object (e.g. a full arena) until told.
- ``daemons``: ``start_daemon(**overrides)`` / ``stop_daemon(daemon)``: an in-process ``Daemon`` on
  a short socket path with a unique name prefix and a small arena; stopping reports leftover
  segments. ``settle_daemon`` / ``describe_daemon_state``: what a daemon still holds, by client.
  ``warm_up_process_state()``: the process-wide state a later fd check must not count.
- ``leaks``: ``LeakSnapshot`` / ``LeakCheck``: /dev/shm entries, open fds, live children and a
  daemon's live leases before/after a test, and a readable list of what leaked (leases and loans
  with the call site that took them). ``LeakCheck`` counts only the /dev/shm entries this test's
  processes made.
- ``util``: ``wait_until(predicate, timeout_s=...)``: poll with a deadline instead of sleeping;
  ``short_tmpdir()``, ``remove_tree``, ``unique_prefix()``, ``RUN_PREFIX``, ``parse_nbytes("64M")``,
  ``shm_entries()``, ``segments_of(prefix)``.
"""
from __future__ import annotations

from ..shm_names import SHM_DIR
from .children import BlockingChild, ChildError, ChildTimeout, hold_until_told, run_in_child, start_children
from .daemons import (
    DEFAULT_ARENA_NBYTES,
    describe_daemon_state,
    settle_daemon,
    start_daemon,
    stop_daemon,
    warm_up_process_state,
)
from .leaks import LeakCheck, LeakSnapshot, open_fds
from .util import (
    RUN_PREFIX,
    parse_nbytes,
    remove_tree,
    segments_of,
    shm_entries,
    short_tmpdir,
    unique_prefix,
    wait_until,
)

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
