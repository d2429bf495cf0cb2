"""One tenant's identity index: committed objects published under an identity (an encoder output
under its item's ``mm_hash``), found again by any session of the tenant. The other book of a
tenant's ``Registry`` beside the allocations and the table, called under its lock.

- **Publish if absent.** The first committed object published under ``(scope, identity)`` wins;
  a later publisher gets the winner's handle and releases its own object as it would any other.
- **Entries hold their objects.** An entry is a reference in ``allocations.AllocationBook``
  (``Allocation.indexed``): the proxy bit keeps the object alive after its producer released it
  or died, so an engine that restarts finds its cache.
- **Eviction, least recently used first, of entries nobody holds.** When the published bytes pass
  the budget, and when a loan or grant of the tenant finds no room, entries whose object only the
  index holds (no producer reference, no lease, no other bit in the table) are dropped. An entry
  someone holds is never evicted, so a consumer's view never loses its bytes.
- **Identities are data, never names.** Scope and identity are opaque bytes compared exactly,
  bounded in length; what an entry gives back is the handle the daemon checked at publish (its
  slot and generation), so a consumer's acquire of it is refused if the object ever changed.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

from ..errors import InvalidArgument
from ..tensors import tensor_nbytes
from ..v1 import daemon_pb2 as pb
from .allocations import AllocationBook
from .records import Allocation, Session

MAX_IDENTITY_NBYTES = 256
_SHOWN_CHARS = 120


@dataclasses.dataclass
class _Entry:
    obj: Allocation
    tensor: pb.TensorHandle  # as checked at publish; handed to every look-up


def shown_identity(scope: bytes, identity: bytes) -> str:
    """How List and ``shmtransport ls`` print an entry's identity: printable whatever its bytes."""
    text = f"{repr(scope)[2:-1]}/{repr(identity)[2:-1]}"
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS - 3] + "..."


def _check_key(scope: bytes, identity: bytes) -> None:
    if len(scope) > MAX_IDENTITY_NBYTES:
        raise InvalidArgument(f"scope of {len(scope)} bytes exceeds {MAX_IDENTITY_NBYTES}", field="scope")
    if not 0 < len(identity) <= MAX_IDENTITY_NBYTES:
        raise InvalidArgument(f"identity must be 1 to {MAX_IDENTITY_NBYTES} bytes, got {len(identity)}",
                              field="identity")


class IdentityIndex:
    """``(scope, identity)`` → a committed object of the tenant, in least-recently-used order."""

    def __init__(self, book: AllocationBook, budget_nbytes: int, counters: collections.Counter[str]) -> None:
        """``book``: the tenant's allocations, where entries book their references; ``counters``:
        the registry's (shared)."""
        self._book = book
        self.budget_nbytes = budget_nbytes
        self._counters = counters
        self._entries: collections.OrderedDict[tuple[bytes, bytes], _Entry] = collections.OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def publish(self, session: Session, scope: bytes, identity: bytes, tensor: pb.TensorHandle
                ) -> pb.PublishResponse:
        """Publish ``session``'s committed object under the identity, unless an entry is there."""
        _check_key(scope, identity)
        h = tensor.shm
        expected = max(1, tensor_nbytes(tensor.shape, tensor.dtype))  # a zero-size tensor occupies 1
        if expected != h.nbytes:
            raise InvalidArgument(f"a {tensor.dtype} tensor of shape {list(tensor.shape)} is {expected} bytes, "
                                  f"the handle says {h.nbytes}", field="tensor")
        key = (scope, identity)
        entry = self._live(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self._counters["index_duplicates"] += 1
            return pb.PublishResponse(tensor=entry.tensor, published=False)
        obj = self._book.index_hold(session, h)
        stored = pb.TensorHandle(shm=h, dtype=tensor.dtype, shape=tensor.shape, digest=tensor.digest)
        self._entries[key] = _Entry(obj, stored)
        self.nbytes += obj.nbytes
        self._counters["index_published"] += 1
        while self.nbytes > self.budget_nbytes and self.evict_one(keep=key):
            pass
        return pb.PublishResponse(tensor=stored, published=True)

    def lookup(self, scope: bytes, identities: Sequence[bytes]) -> pb.LookupResponse:
        """The entry of each identity (a hit counts as a use), or an empty TensorHandle."""
        response = pb.LookupResponse()
        for identity in identities:
            _check_key(scope, identity)
        for identity in identities:
            key = (scope, identity)
            entry = self._live(key)
            if entry is None:
                self._counters["index_misses"] += 1
                response.tensors.add()
                continue
            self._entries.move_to_end(key)
            self._counters["index_hits"] += 1
            response.tensors.append(entry.tensor)
        return response

    def evict_one(self, keep: tuple[bytes, bytes] | None = None) -> bool:
        """Drop the least recently used entry nobody but the index holds (never ``keep``);
        whether there was one."""
        for key, entry in self._entries.items():
            if key != keep and self._book.only_indexed(entry.obj):
                self._drop(key)
                self._counters["index_evictions"] += 1
                return True
        return False

    def identities_by_slot(self) -> dict[int, str]:
        """Each entry's shown identity, by its object's slot (for List)."""
        return {entry.obj.slot: shown_identity(*key) for key, entry in self._entries.items()}

    def _live(self, key: tuple[bytes, bytes]) -> _Entry | None:
        """The entry under ``key``, dropped if its object died anyway: only a client's forgery in
        the table (clearing the proxy bit) kills an object the index holds."""
        entry = self._entries.get(key)
        if entry is not None and not self._book.still_indexed(entry.obj):
            self._drop(key)
            return None
        return entry

    def _drop(self, key: tuple[bytes, bytes]) -> None:
        entry = self._entries.pop(key)
        self.nbytes -= entry.obj.nbytes
        self._book.index_release(entry.obj)

