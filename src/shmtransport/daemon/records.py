"""What a tenant's registry books: its sessions, the daemon's references to objects
(``Allocation``: a producer's, and consumer leases), and the tenant's limits. Plain records;
every rule about them lives in the registry and its books, which change them under its lock only."""
from __future__ import annotations

import dataclasses
import enum
import time
from typing import NamedTuple

from ..wire import MAX_BATCH
from .segments import Segment


class ObjState(enum.Enum):
    """What the daemon knows of an object it booked: loaned (being written) or committed (readable)."""

    LOANED = "loaned"
    COMMITTED = "committed"


class OwnObjects(NamedTuple):
    """A producer session's own live objects: loans, and committed objects it kept its reference to."""

    loans: int = 0
    loaned_nbytes: int = 0
    committed: int = 0
    committed_nbytes: int = 0


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
    """An object the daemon books a reference to: one it placed for a producer without a holder
    bit (an arena loan, or a dedicated segment), or a table producer's object it leases to clients
    without one. Its state lives in the object table (``slot``), held by the proxy bit while the
    producer's reference or a lease is booked here."""

    key: int  # in ``_objects``: the arena offset, or ``-serial`` for a dedicated segment
    nbytes: int
    generation: int  # its slot's
    owner: str  # session id of the producer ("" for a table producer's object)
    slot: int
    state: ObjState = ObjState.LOANED
    producer_ref: bool = True
    placed: bool = True  # the daemon placed it (and frees its bytes); False: a table producer's
    held: bool = False  # committed with a hold: no acquire or release ends it before its deadline
    leases: set[int] = dataclasses.field(default_factory=set)
    indexed: bool = False  # the identity index keeps it (``index.IdentityIndex``)
    commit_token: bytes = b""  # presenting it in Acquire commits the loan (commit by handoff)
    # Dedicated segment per object (LoanRequest.dedicated): the object's own segment; its handle
    # says offset 0.
    segment: Segment | None = None
    created_at: float = dataclasses.field(default_factory=time.monotonic)

    @property
    def offset(self) -> int:
        """Where the bytes start in their segment: the arena offset, or 0 in a dedicated segment."""
        return 0 if self.segment is not None else self.key

    @property
    def referenced(self) -> bool:
        """Whether a reference is booked, so the daemon's proxy bit holds the object."""
        return self.producer_ref or bool(self.leases) or self.indexed


class LeaseRecord(NamedTuple):
    """A consumer's lease the daemon holds for it (a client without a holder bit); immutable (one
    past its TTL is in ``AllocationBook``'s quarantine, not marked here)."""

    lease_id: int
    key: int  # of the leased Allocation
    generation: int
    session_id: str
    expires_at: float


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
    cache_nbytes: int | None = None  # the identity index's budget; None: half the byte quota
