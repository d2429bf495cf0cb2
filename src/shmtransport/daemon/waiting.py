"""Calls of a tenant that wait: for bytes to be freed, or for a producer's commit. Counted (Stat's
``waiting_calls``) and woken by what they wait for only."""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Sequence


class WaitingCalls:
    """How many calls wait now; its lock is its own, taken with or without the registry's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Counted meanwhile."""
        with self._lock:
            self.count += 1
        try:
            yield
        finally:
            with self._lock:
                self.count -= 1


class CommitWaiters:
    """Acquires waiting for loans to be committed, by object key: a commit (or the loan's end)
    wakes the waiters of its own object, never rescans the others. Used under the registry's lock."""

    def __init__(self) -> None:
        self._by_key: dict[int, list[threading.Event]] = {}

    def register(self, keys: Sequence[int]) -> threading.Event:
        """One waiter on every key in ``keys``; set when any of them is committed or freed."""
        event = threading.Event()
        for key in keys:
            self._by_key.setdefault(key, []).append(event)
        return event

    def forget(self, event: threading.Event, keys: Sequence[int]) -> None:
        """The waiter stopped waiting (woken or timed out)."""
        for key in keys:
            events = self._by_key.get(key)
            if events is not None and event in events:
                events.remove(event)
                if not events:
                    del self._by_key[key]

    def wake(self, key: int) -> None:
        """The object ``key`` was committed or freed: its waiters look again."""
        for event in self._by_key.pop(key, ()):
            event.set()
