"""Releases a client owes the daemon for the references the daemon holds for it (objects it
placed, leases it holds with its proxy bit): producer references and lease ids, sent in batches
with the client's next call or on their own."""
from __future__ import annotations

from typing import Iterable

from ..v1 import daemon_pb2 as pb
from ..wire import MAX_BATCH


class PendingReleases:
    """Queued releases, taken a batch at a time (the daemon's limit). Not thread-safe: the
    client's lock serializes every use."""

    def __init__(self) -> None:
        self._handles: list[pb.Handle] = []
        self._lease_ids: list[int] = []

    def __len__(self) -> int:
        return len(self._handles) + len(self._lease_ids)

    def add_handles(self, handles: Iterable[pb.Handle]) -> None:
        """Producer references to drop."""
        self._handles.extend(handles)

    def add_lease_ids(self, lease_ids: Iterable[int]) -> None:
        """Leases to end."""
        self._lease_ids.extend(lease_ids)

    @property
    def has_handles(self) -> bool:
        """Whether a producer reference is queued (a commit of it must land first)."""
        return bool(self._handles)

    def take(self) -> pb.ReleaseRequest | None:
        """Up to one batch, handles first; None when nothing is queued. The rest stays queued."""
        if not self._handles and not self._lease_ids:
            return None
        handles = self._handles[:MAX_BATCH]
        lease_ids = self._lease_ids[: MAX_BATCH - len(handles)]
        del self._handles[: len(handles)]
        del self._lease_ids[: len(lease_ids)]
        return pb.ReleaseRequest(handles=handles, lease_ids=lease_ids)
