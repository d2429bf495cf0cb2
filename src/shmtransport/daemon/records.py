"""What a tenant's registry books: its sessions, allocations (objects of the RPC path) and
consumer leases, and the tenant's limits. Plain records; every rule about them lives in
``registry.Registry``, which changes them under its lock only."""
from __future__ import annotations

import dataclasses
import enum
import time

from ..wire import MAX_BATCH
from .segments import Segment


class ObjState(enum.Enum):
    """An RPC-path object's state: loaned (being written) or committed (readable)."""

    LOANED = "loaned"
    COMMITTED = "committed"


@dataclasses.dataclass
class Session:
    """A client session the registry books: its identity, and what it holds."""

    session_id: str
    pid: int
    uid: int
    # Local clients may hold views of leased bytes past the TTL: quarantine those. A remote peer
    # has no view (it copies the bytes out), so its expired leases are simply reclaimed.
    quarantine_expired: bool = True
    # Bytes of the allocations this session holds a producer reference to, by their state. Kept
    # at every transition (loan, commit, release, reclaim) so that Stat and the quota check cost
    # O(1) per session instead of a walk over its objects under the registry lock.
    loaned_nbytes: int = 0
    committed_nbytes: int = 0
    producer_refs: set[int] = dataclasses.field(default_factory=set)  # keys of their Allocations
    leases: set[int] = dataclasses.field(default_factory=set)  # lease ids
    # Whether it made a call that loans, grants, commits, acquires or releases through the daemon
    # (``used``), or asked for Stat or List (``looked``): a session that only looked and ends with
    # Close holding nothing is an observer's (``shmtransport stat``), counted apart.
    used: bool = False
    looked: bool = False

    @property
    def owned_nbytes(self) -> int:
        """Bytes counted against this session's quota: every allocation it holds a reference to."""
        return self.loaned_nbytes + self.committed_nbytes


@dataclasses.dataclass
class Allocation:
    """An object of the RPC path: its bytes, producer, holds and leases."""

    key: int  # in ``_objects``: the arena offset, or ``-generation`` for a dedicated segment
    nbytes: int
    generation: int
    owner: str  # session id of the producer
    state: ObjState = ObjState.LOANED
    producer_ref: bool = True
    hold_until: float = 0.0  # monotonic deadline; 0 = no hold
    handoff: bool = False  # the hold is the hand-off window: the first acquire ends it
    leases: set[int] = dataclasses.field(default_factory=set)
    commit_token: bytes = b""  # presenting it in Acquire commits the loan (commit by handoff)
    # Dedicated segment per object (LoanRequest.dedicated): the object's own segment; its handle
    # says offset 0.
    segment: Segment | None = None
    created_at: float = dataclasses.field(default_factory=time.monotonic)

    @property
    def offset(self) -> int:
        """Where the bytes start in their segment: the arena offset, or 0 in a dedicated segment."""
        return 0 if self.segment is not None else self.key


@dataclasses.dataclass
class LeaseRecord:
    """A consumer's lease as the daemon books it (the RPC path)."""

    lease_id: int
    key: int  # of the leased Allocation
    generation: int
    session_id: str
    expires_at: float
    quarantined: bool = False  # outlived its TTL; its bytes stay until release or session death


@dataclasses.dataclass(frozen=True)
class TenantLimits:
    """A tenant's quotas, TTLs and hold caps (milliseconds), fixed at daemon start."""

    quota_nbytes: int | None  # per tenant: arena + dedicated bytes; None: the arena size
    quota_leases: int  # per tenant
    default_lease_ttl_ms: int
    max_lease_ttl_ms: int
    default_hold_ms: int
    max_hold_ms: int = 60_000
    max_batch: int = MAX_BATCH
    handoff_window_ms: int = 30_000
