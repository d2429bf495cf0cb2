"""Call sites of leases and loans, for leak reports (as ``ray memory`` lists them).

Off by default: ``Lease`` and ``Loan`` read ``enabled`` (one attribute load) and walk no stack.
``testing.LeakCheck`` (the pytest plugin's ``shm_leak_check``) turns it on for its test; every
lease and loan created in this process meanwhile then remembers the first frame of its creation
stack outside the shmtransport package (``file:line in function``): the caller's ``acquire``,
``loan`` or ``put``. The async clients run calls in worker threads and pass the awaiting
coroutine's call site along (``attributed_to``), so their views name the ``await`` line.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
import weakref
from collections.abc import Iterator

enabled = False

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_lock = threading.Lock()  # record() runs in any client thread
_seq = itertools.count(1)
_sites: weakref.WeakKeyDictionary[object, tuple[int, str]] = weakref.WeakKeyDictionary()  # view -> (seq, call site)
_on_behalf = threading.local()  # .site: the call site views made in this thread are attributed to


def caller() -> str:
    """``file:line in function`` of the innermost frame outside the shmtransport package (or
    the site this thread works for, inside ``attributed_to``)."""
    site: str | None = getattr(_on_behalf, "site", None)
    if site is not None:
        return site
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


@contextlib.contextmanager
def attributed_to(site: str | None) -> Iterator[None]:
    """Views created in this thread meanwhile are recorded at ``site`` (None: their own stack)."""
    before, _on_behalf.site = getattr(_on_behalf, "site", None), site
    try:
        yield
    finally:
        _on_behalf.site = before


def record(view: object) -> None:
    """Remember where ``view`` (a Lease or Loan being constructed) was created."""
    site = caller()
    with _lock:
        _sites[view] = (next(_seq), site)


def mark() -> int:
    """A point in time for ``since``: views recorded after it."""
    with _lock:
        return next(_seq)


def since(point: int) -> list[tuple[object, str]]:
    """(view, call site) of every view recorded after ``point`` that is still alive, in order."""
    with _lock:
        entries = [(seq, view, site) for view, (seq, site) in _sites.items() if seq > point]
    return [(view, site) for _, view, site in sorted(entries, key=lambda e: e[0])]
