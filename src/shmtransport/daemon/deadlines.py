"""When a tenant's leases end: a heap of TTL deadlines the sweeper pops as they pass."""
from __future__ import annotations

import heapq
from typing import Iterable, Iterator

_Entry = tuple[float, int]  # (when, lease id)


class Deadlines:
    """(when, lease id) entries. An entry whose lease ended early stays behind (lazy deletion):
    whoever pops it checks it still applies. Used under the registry's lock."""

    def __init__(self) -> None:
        self._heap: list[_Entry] = []

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, when: float, lease_id: int) -> None:
        """Lease ``lease_id`` ends at ``when`` (monotonic)."""
        heapq.heappush(self._heap, (when, lease_id))

    def due(self, now: float) -> Iterator[int]:
        """Pop every lease id due at or before ``now``, earliest first."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            yield heapq.heappop(heap)[1]

    def compact(self, live: int, entries: Iterable[_Entry]) -> None:
        """Rebuild from ``entries`` (the deadlines still live, ``live`` of them at most) when
        stale ones dominate, so memory follows what is live, not the TTL times the call rate."""
        if len(self._heap) > 4 * live + 4096:
            self._heap = list(entries)
            heapq.heapify(self._heap)
