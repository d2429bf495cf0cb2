"""When a tenant's leases and holds end: a heap of deadlines the sweeper pops as they pass."""
from __future__ import annotations

import enum
import heapq
from typing import Iterable, Iterator


class Deadline(enum.IntEnum):
    """What a deadline ends (ordered after the time, so ties compare cheaply)."""

    HOLD = 0  # an object's hold or hand-off window; the entry's key is the Allocation's key
    LEASE = 1  # a lease's TTL; the entry's key is the lease id


_Entry = tuple[float, Deadline, int]


class Deadlines:
    """(when, kind, key) entries. An entry whose lease or hold ended early stays behind (lazy
    deletion): whoever pops it checks it still applies. Used under the registry's lock."""

    def __init__(self) -> None:
        self._heap: list[_Entry] = []

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, when: float, kind: Deadline, key: int) -> None:
        """``key``'s lease or hold ends at ``when`` (monotonic)."""
        heapq.heappush(self._heap, (when, kind, key))

    def due(self, now: float) -> Iterator[tuple[Deadline, int]]:
        """Pop every entry at or before ``now``, earliest first."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, kind, key = heapq.heappop(heap)
            yield kind, key

    def compact(self, live: int, entries: Iterable[_Entry]) -> None:
        """Rebuild from ``entries`` (the deadlines still live, ``live`` of them at most) when
        stale ones dominate, so memory follows what is live, not the TTL times the call rate."""
        if len(self._heap) > 4 * live + 4096:
            self._heap = list(entries)
            heapq.heapify(self._heap)
