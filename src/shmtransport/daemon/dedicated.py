"""A tenant's dedicated segments (``LoanRequest.dedicated``): one named file in /dev/shm per
object, for stock readers that open segments by name. Their bytes count against the tenant's
quota; each is created under the daemon-wide /dev/shm reserve and handed to the tenant's owner."""
from __future__ import annotations

from typing import Sequence

from .. import shm_names
from ..errors import PermissionDenied
from .segments import Segment, ShmReserve


class DedicatedSegments:
    """The live dedicated segments of one tenant, by name, and the bytes they (and segments being
    created) take. Booked under the registry's lock; created and unlinked by the methods that say so."""

    def __init__(self, tenant_base: str, reserve: ShmReserve, owner: tuple[int, int] | None) -> None:
        """``owner``: the (uid, gid) segments are handed to (-1: keep the daemon's); None: this
        tenant cannot be given any (a daemon that is not root cannot hand files over)."""
        self.tenant_base = tenant_base
        self._reserve = reserve
        self._owner = owner
        self._keys: dict[str, int] = {}  # segment name -> the key of its object in the registry
        self.nbytes = 0  # live segments' bytes, plus those reserved for segments being created

    def check_allowed(self) -> None:
        """PermissionDenied when this tenant cannot be given dedicated segments."""
        if self._owner is None:
            raise PermissionDenied(
                "dedicated segments are opened by name, so a daemon not running as root can give them "
                "only to its own uid; use arena loans, or run the daemon as root"
            )

    def create(self, first_generation: int, sizes: Sequence[int]) -> list[Segment]:
        """One new segment per size, named after its generation (all or none; outside the lock).
        Their bytes must have been added to ``nbytes`` first, so concurrent loans cannot overshoot
        the quota."""
        assert self._owner is not None  # check_allowed came first
        segments: list[Segment] = []
        try:
            for i, nbytes in enumerate(sizes):
                name = shm_names.dedicated_name(self.tenant_base, first_generation + i)
                segments.append(self._reserve.create(name, nbytes, *self._owner))
        except BaseException:
            for seg in segments:
                seg.unlink()
            raise
        return segments

    def add(self, name: str, key: int) -> None:
        """A created segment now names the registry's object ``key``."""
        self._keys[name] = key

    def key_of(self, name: str) -> int | None:
        """The registry key of the live segment ``name``."""
        return self._keys.get(name)

    def keys(self) -> list[int]:
        """The registry keys of every live segment."""
        return list(self._keys.values())

    def names(self) -> list[str]:
        """The names in /dev/shm of the live segments, sorted."""
        return sorted(self._keys)

    def freed(self, segment: Segment, nbytes: int) -> None:
        """Its object died: unlink the segment (a stock reader may have unlinked the name already)."""
        del self._keys[segment.name]
        self.nbytes -= nbytes
        segment.unlink()

    def is_stale(self, name: str, next_generation: int) -> bool:
        """Whether ``name`` is one of this tenant's dedicated names that lived once and is freed."""
        generation = shm_names.dedicated_generation(self.tenant_base, name)
        return generation is not None and 0 < generation < next_generation
