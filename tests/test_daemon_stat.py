"""Stat's per-client byte counts are kept at every state transition, not recomputed by walking the
objects (that walk made Stat O(live objects) under the registry lock).

A seeded random walk over the registry's operations (arena and dedicated loans, Commit, Acquire
with and without commit tokens, releases of references and leases - plain and piggybacked -,
producer death, TTL expiry of leases and holds), refused operations included: after every step
each session's counters equal a recount of every live object that List reports.
"""
from __future__ import annotations

import collections
import random
import time

import pytest

from shmtransport import objtable
from shmtransport.allocator import Allocator
from shmtransport.daemon.objects import ObjectBook
from shmtransport.daemon.records import TenantLimits
from shmtransport.daemon.registry import Registry
from shmtransport.daemon.segments import Segment
from shmtransport.errors import ShmTransportError
from shmtransport.shm_names import new_instance_id
from shmtransport.testing import unique_prefix
from shmtransport.v1 import daemon_pb2 as pb

KiB = 1024
ARENA_NBYTES = 256 * KiB
QUOTA_NBYTES = 96 * KiB  # small enough that random loans also hit the quota and a full arena
STEPS = 400
SESSIONS = 4
MAX_TTL_MS = 2000
NSLOTS = 1024


class Walk:
    """One random sequence of operations on a registry, remembering every handle and lease it was
    given (stale ones too: reusing them exercises the refusals)."""

    mapped: list[Walk] = []  # whose object tables the test's teardown unmaps

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        instance = new_instance_id()
        limits = TenantLimits(quota_nbytes=QUOTA_NBYTES, quota_leases=64, default_lease_ttl_ms=MAX_TTL_MS,
                              max_lease_ttl_ms=10 * MAX_TTL_MS, default_hold_ms=0)
        table = [Segment.create_sealed(f"walk-{kind}", objtable.table_nbytes(NSLOTS)) for kind in ("slots", "holds")]
        self.objects = ObjectBook(*table, NSLOTS, limits.handoff_window_ms, limits.max_hold_ms)
        Walk.mapped.append(self)
        self.registry = Registry(instance, f"{unique_prefix()}-{instance}-arena", Allocator(ARENA_NBYTES), limits,
                                 self.objects)
        self.loans: list[tuple[str, pb.Handle, bytes]] = []  # (producer session, handle, commit token)
        self.leases: list[tuple[str, int]] = []  # (consumer session, lease id)
        self.sessions: list[str] = []
        self.remote_sessions: frozenset[str] = frozenset()
        self.opened = 0
        self.succeeded: collections.Counter[str] = collections.Counter()  # operation name -> count
        for _ in range(SESSIONS):
            self.open_session()

    def open_session(self) -> None:
        session_id = f"s{self.opened}"
        self.opened += 1
        # A third of the sessions stand for remote peers, whose expired leases are reclaimed, not quarantined.
        remote = self.opened % 3 == 0
        self.registry.open_session(session_id, pid=1000 + self.opened, uid=0, quarantine_expired=not remote)
        if remote:
            self.remote_sessions |= {session_id}
        self.sessions.append(session_id)

    def step(self) -> None:
        op = self.rng.choices(
            [self.loan, self.commit, self.acquire, self.release_refs, self.release_leases, self.die, self.expire],
            weights=[6, 2, 5, 4, 4, 1, 2],
        )[0]
        try:
            op()
        except ShmTransportError:
            return  # refusals (quota, full arena, stale handle, double release...) are steps too
        self.succeeded[op.__name__] += 1

    # -- operations ------------------------------------------------------------------------------
    def loan(self) -> None:
        session_id = self.rng.choice(self.sessions)
        sizes = [self.rng.randint(1, 16 * KiB) for _ in range(self.rng.randint(1, 3))]
        if self.rng.random() < 0.15:
            response = self.registry.loan_dedicated(session_id, sizes)
        else:
            response = self.registry.loan(session_id, sizes)
        self.loans += [(session_id, h, t) for h, t in zip(response.handles, response.commit_tokens)]

    def commit(self) -> None:
        session_id, handles = self.some_loans()
        self.registry.commit(session_id, handles, hold_ms=self.rng.choice([0, 0, self.rng.randint(1, MAX_TTL_MS)]))

    def acquire(self) -> None:
        session_id = self.rng.choice(self.sessions)
        picked = self.rng.sample(self.loans, min(len(self.loans), self.rng.randint(1, 3)))
        handles = [h for _, h, _ in picked]
        tokens = [t if self.rng.random() < 0.9 else b"forged-token-16b" for _, _, t in picked]
        with_tokens = self.rng.random() < 0.7
        lease_ids = self.registry.acquire(session_id, handles, ttl_ms=self.rng.randint(1, MAX_TTL_MS),
                                          commit_tokens=tokens if with_tokens else ())
        self.leases += [(session_id, lease_id) for lease_id in lease_ids]

    def release_refs(self) -> None:
        session_id, handles = self.some_loans()
        self.registry.release(session_id, handles, [], piggybacked=self.rng.random() < 0.3)

    def release_leases(self) -> None:
        if not self.leases:
            return
        session_id, _ = self.rng.choice(self.leases)
        own = [lease_id for sid, lease_id in self.leases if sid == session_id]
        picked = self.rng.sample(own, min(len(own), self.rng.randint(1, 3)))
        self.registry.release(session_id, [], picked, piggybacked=self.rng.random() < 0.3)

    def die(self) -> None:
        self.registry.close_session(self.sessions.pop(self.rng.randrange(len(self.sessions))))
        self.open_session()

    def expire(self) -> None:
        """Every lease and hold whose deadline falls before a random point of the next TTL span."""
        self.registry.expire(now=time.monotonic() + self.rng.uniform(0, MAX_TTL_MS / 1000))

    def some_loans(self) -> tuple[str, list[pb.Handle]]:
        """A session and 1-3 handles it was loaned (some maybe released or freed since)."""
        if not self.loans:
            return self.sessions[0], []
        session_id = self.rng.choice(self.loans)[0]
        own = [h for sid, h, _ in self.loans if sid == session_id]
        return session_id, self.rng.sample(own, min(len(own), self.rng.randint(1, 3)))

    # -- the end ---------------------------------------------------------------------------------
    def close(self) -> None:
        for session_id in self.sessions:
            self.registry.close_session(session_id)
        self.sessions.clear()
        self.registry.expire(now=time.monotonic() + 100 * MAX_TTL_MS / 1000)
        self.registry.unlink_dedicated()  # only reached with a leak, which the caller then reports

    def unmap(self) -> None:
        self.objects.close()
        self.objects.slots_segment.unlink()
        self.objects.holds_segment.unlink()


@pytest.fixture(autouse=True)
def _unmap_walks():
    yield
    while Walk.mapped:
        Walk.mapped.pop().unmap()


def recounted_nbytes(listing: pb.ListResponse) -> dict[str, tuple[int, int]]:
    """Per live session: (loaned, committed) bytes it holds producer references to, recounted
    from every live object that List reports."""
    nbytes = {c.session_id: [0, 0] for c in listing.clients}
    for obj in listing.objects:
        if obj.producer_held:
            assert obj.owner_session in nbytes, f"object {obj.generation} referenced by a closed session"
            nbytes[obj.owner_session][obj.state != "loaned"] += obj.nbytes
    return {session_id: (loaned, committed) for session_id, (loaned, committed) in nbytes.items()}


def reported_nbytes(registry: Registry) -> dict[str, tuple[int, int]]:
    """Per session: (loaned, committed) bytes as Stat reports them."""
    return {c.session_id: (c.loaned_nbytes, c.committed_nbytes) for c in registry.stat().clients}


def check_counters(registry: Registry, remote_sessions: frozenset[str] = frozenset()) -> None:
    """Stat's counters equal a recount of List's objects (two public views of one book)."""
    listing, stat = registry.list_objects(), registry.stat()
    objects = listing.objects
    assert listing.total_objects == len(objects) == stat.live_objects
    assert reported_nbytes(registry) == recounted_nbytes(listing)
    assert stat.live_leases == sum(len(obj.holder_sessions) for obj in objects)
    dedicated = sum(obj.nbytes for obj in objects if obj.segment_name)
    assert stat.dedicated_nbytes == dedicated
    assert registry.used_nbytes == registry.allocator.used_nbytes + dedicated
    assert stat.quarantined_leases == sum(obj.quarantined_leases for obj in objects)
    assert stat.quarantined_nbytes == sum(obj.nbytes * obj.quarantined_leases for obj in objects)
    for obj in objects:  # remote peers' expired leases are reclaimed, never quarantined
        local_holders = [s for s in obj.holder_sessions if s not in remote_sessions]
        assert obj.quarantined_leases <= len(local_holders), obj


@pytest.mark.parametrize("seed", range(6))
def test_stat_byte_counts_equal_a_recount_of_live_allocations_after_every_random_operation(seed):
    walk = Walk(seed)
    try:
        for _ in range(STEPS):
            walk.step()
            check_counters(walk.registry, walk.remote_sessions)
        walk.registry.expire(now=time.monotonic() + 100 * MAX_TTL_MS / 1000)  # every lease left expires
        check_counters(walk.registry, walk.remote_sessions)
        reclaimed = walk.registry.counters
        assert set(walk.succeeded) == {"loan", "commit", "acquire", "release_refs", "release_leases", "die", "expire"}
        assert reclaimed["reclaimed_ttl_leases"] + reclaimed["quarantined_leases_total"], "no lease expired"
        assert reclaimed["reclaimed_death_nbytes"] + reclaimed["reclaimed_death_leases"], "the walk missed a reclaim"
        assert reclaimed["dedicated_total"], "the walk made no dedicated loan"
    finally:
        walk.close()
    assert walk.registry.stat().live_objects == 0 and walk.registry.allocator.used_nbytes == 0
    assert walk.registry.dedicated_names() == []


def test_stat_byte_counts_follow_one_object_through_loan_commit_lease_and_release():
    walk = Walk(seed=0)
    registry = walk.registry
    try:
        response = registry.loan("s0", [100, 28])
        assert reported_nbytes(registry)["s0"] == (128, 0)
        registry.acquire("s1", response.handles[:1], ttl_ms=1000, commit_tokens=response.commit_tokens[:1])
        assert reported_nbytes(registry)["s0"] == (28, 100)  # committed by handoff; both still the producer's
        registry.commit("s0", response.handles[1:], hold_ms=1000)
        assert reported_nbytes(registry)["s0"] == (0, 128)
        registry.release("s0", response.handles, [])
        assert reported_nbytes(registry)["s0"] == (0, 0) and registry.stat().live_objects == 2  # lease, hold
    finally:
        walk.close()


def test_an_expired_lease_is_quarantined_for_a_local_client_and_reclaimed_for_a_remote_peer():
    walk = Walk(seed=0)
    registry = walk.registry
    try:
        registry.open_session("local", pid=1, uid=0)
        registry.open_session("remote", pid=0, uid=0, quarantine_expired=False)
        response = registry.loan("local", [4096, 4096])
        registry.commit("local", response.handles, hold_ms=0)
        local, = registry.acquire("local", response.handles[:1], ttl_ms=10)
        registry.acquire("remote", response.handles[1:], ttl_ms=10)
        registry.release("local", response.handles, [])
        registry.expire(now=time.monotonic() + 1)
        stat = registry.stat()
        assert (stat.live_leases, stat.quarantined_leases, stat.reclaimed_ttl_leases) == (1, 1, 1)
        assert stat.live_objects == 1 and stat.quarantined_nbytes == 4096
        registry.release("local", [], [local])  # a quarantined lease releases like any other
        assert registry.stat().live_objects == 0 and registry.stat().quarantined_leases == 0
        check_counters(registry)
    finally:
        walk.close()


def test_a_dead_producers_loans_count_as_loans_and_a_session_that_only_looked_as_an_observer():
    walk = Walk(seed=0)
    registry = walk.registry
    try:
        for session_id in ("producer", "consumer", "cli"):
            registry.open_session(session_id, pid=1, uid=0)
        loans = registry.loan("producer", [4096, 4096])  # never committed
        made = registry.loan("producer", [4096])
        registry.commit("producer", made.handles, hold_ms=0)
        registry.acquire("consumer", made.handles, ttl_ms=MAX_TTL_MS)
        registry.note_looked("consumer")  # a consumer that also asked for Stat is still a consumer
        registry.note_looked("cli")
        registry.close_session("producer")  # died: its loans are loans, its committed object lives on
        stat = registry.stat()
        assert (stat.reclaimed_death_leases, stat.reclaimed_death_loans, stat.reclaimed_death_nbytes) == (
            0, len(loans.handles), 2 * 4096)
        registry.close_session("consumer", closed_by_client=True)
        registry.close_session("cli", closed_by_client=True)
        stat = registry.stat()
        assert (stat.released_at_close_leases, stat.released_at_close_loans, stat.released_at_close_nbytes) == (
            1, 0, 4096)
        assert (stat.sessions_closed, stat.observer_sessions_closed) == (1, 1)
        check_counters(registry)
    finally:
        walk.close()
