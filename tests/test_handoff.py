"""Ownership as users expect it, under either backend (the object table with the C kernels, the
daemon's registry without): a committed object outlives its producer's close or death until a
first consumer takes it, or until the hand-off window passes (then it is reclaimed and counted);
an explicit release ends the hand-off.

The state machine drives real producers and consumers against a real daemon and checks every
outcome, and the daemon's live objects, against a model.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from shmtransport import objtable
from shmtransport.client import Consumer, Producer
from shmtransport.errors import HandleError
from shmtransport.testing import (
    BlockingChild,
    run_in_child,
    start_daemon,
    stop_daemon,
    wait_until,
)

TIMEOUT_S = 30


class Obj:
    def __init__(self, handle, data, producer):
        self.handle, self.data, self.producer = handle, data, producer
        self.producer_holds = True
        self.handoff = True
        self.leases = 0

    @property
    def alive(self) -> bool:
        return self.producer_holds or self.handoff or self.leases > 0


class HandoffMachine(RuleBasedStateMachine):
    objects = Bundle("objects")
    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        self.daemon = start_daemon(arena_nbytes=4 << 20, handoff_window_ms=600_000)
        self.producers = [Producer(self.daemon.socket_path, timeout_s=TIMEOUT_S) for _ in range(2)]
        self.consumers = [Consumer(self.daemon.socket_path, timeout_s=TIMEOUT_S) for _ in range(2)]
        self.all: list[Obj] = []
        self.records: list[dict] = []
        self.seed = 0

    def teardown(self) -> None:
        for record in self.records:
            if record["live"]:
                record["lease"].release()
            record["lease"] = None  # hypothesis keeps the records: their leases hold arena views
        self.records.clear()
        for client in self.producers + self.consumers:
            client.close()
        stop_daemon(self.daemon)

    @rule(target=objects, p=st.integers(0, 1), n=st.integers(1, 5000))
    def put(self, p, n):
        self.seed += 1
        data = np.random.default_rng(self.seed).integers(0, 255, n, dtype=np.uint8)
        obj = Obj(self.producers[p].put(data), data, p)
        self.all.append(obj)
        return obj

    @rule(target=leases, obj=objects, c=st.integers(0, 1))
    def acquire(self, obj, c):
        if not obj.alive:
            with pytest.raises(HandleError):
                self.consumers[c].acquire(obj.handle)
            return None
        lease = self.consumers[c].acquire(obj.handle)
        assert np.array_equal(lease.array, obj.data)
        obj.leases += 1
        obj.handoff = False  # the first acquire takes the hand-off over
        record = {"lease": lease, "obj": obj, "consumer": self.consumers[c], "live": True}
        self.records.append(record)
        return record

    @rule(record=consumes(leases))
    def release_lease(self, record):
        if record is not None and record["live"]:
            record["lease"].release()
            record["obj"].leases -= 1
            record["live"] = False

    @rule(obj=objects)
    def producer_releases(self, obj):
        if obj.producer_holds and obj.producer is not None:
            self.producers[obj.producer].release(obj.handle)
            obj.producer_holds = False
            obj.handoff = False

    @rule(p=st.integers(0, 1))
    def producer_closes(self, p):
        self.producers[p].close()
        for obj in self.all:
            if obj.producer == p:
                obj.producer, obj.producer_holds = None, False  # the hand-off bit stays
        self.producers[p] = Producer(self.daemon.socket_path, timeout_s=TIMEOUT_S)

    @rule(c=st.integers(0, 1))
    def consumer_closes(self, c):
        consumer = self.consumers[c]
        consumer.close()
        self.consumers[c] = Consumer(self.daemon.socket_path, timeout_s=TIMEOUT_S)
        for record in self.records:
            if record["consumer"] is consumer and record["live"]:
                record["obj"].leases -= 1  # closing released it
                record["live"] = False

    @invariant()
    def the_daemon_holds_exactly_the_live_objects(self):
        for client in self.producers + self.consumers:
            client.flush(strict=False)
        expected = sum(obj.alive for obj in self.all)
        wait_until(lambda: self.daemon.stat().live_objects == expected, timeout_s=5,
                   what=f"{expected} live objects")


HandoffMachine.TestCase.settings = settings(max_examples=12, stateful_step_count=25, deadline=None)
test_handoff_state_machine = HandoffMachine.TestCase


# -- the hand-off window and a producer's death ---------------------------------------------------
def _put_and_block(conn, socket_path, data):
    producer = Producer(socket_path, timeout_s=TIMEOUT_S)
    conn.send(producer.put(data).to_bytes())
    conn.recv()  # killed here


def _acquire(socket_path, handle_bytes):
    from shmtransport.client import Handle

    with Consumer(socket_path, timeout_s=TIMEOUT_S) as consumer:
        with consumer.acquire(Handle.from_bytes(handle_bytes)) as lease:
            return lease.array.copy()


def test_an_object_outlives_its_killed_producer_until_a_consumer_takes_it(daemon):
    data = np.arange(10_000, dtype=np.uint8)
    with BlockingChild(_put_and_block, daemon.socket_path, data) as child:
        handle_bytes = child.recv()
        child.kill()
    wait_until(lambda: daemon.stat().sessions_total == 1 and len(daemon.stat().clients) == 0,
               timeout_s=5, what="the producer's session ended")
    assert daemon.stat().live_objects == 1
    assert np.array_equal(run_in_child(_acquire, daemon.socket_path, handle_bytes, timeout_s=TIMEOUT_S), data)
    s = daemon.stat()
    assert (s.live_objects, s.used_nbytes, s.reclaimed_handoff_objects) == (0, 0, 0)


def test_an_object_nobody_acquires_is_reclaimed_when_the_window_passes(make_daemon):
    daemon = make_daemon(handoff_window_ms=300)
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer:
        handle = producer.put(np.ones(5000, np.uint8))
    assert daemon.stat().live_objects == 1
    s = wait_until(lambda: daemon.stat().reclaimed_handoff_objects == 1 and daemon.stat(), timeout_s=5,
                   what="hand-off window passed")
    assert (s.live_objects, s.used_nbytes, s.reclaimed_handoff_nbytes) == (0, 0, 5000)
    with Consumer(daemon.socket_path, timeout_s=TIMEOUT_S) as consumer, pytest.raises(HandleError):
        consumer.acquire(handle)


def test_an_explicit_release_ends_the_handoff_at_once(daemon):
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer:
        handle = producer.put(np.ones(100, np.uint8))
        producer.release(handle)
        producer.flush()
        assert daemon.stat().live_objects == 0
    assert daemon.stat().reclaimed_handoff_objects == 0


def test_a_hold_survives_the_first_acquire_and_the_producers_release(make_daemon):
    daemon = make_daemon()
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, Consumer(
            daemon.socket_path, timeout_s=TIMEOUT_S) as consumer:
        handle = producer.put(np.ones(100, np.uint8), hold_ms=400)
        consumer.acquire(handle).release()
        producer.release(handle)
        consumer.flush()
        producer.flush()
        consumer.acquire(handle).release()  # a late second consumer of a fan-out
        consumer.flush()
        wait_until(lambda: daemon.stat().live_objects == 0, timeout_s=5, what="the hold ended")


# -- a client without the C kernels reaches table objects through the daemon ---------------------
def _acquire_in_pure_python(socket_path, handle_bytes):
    from shmtransport import BACKEND
    from shmtransport.client import Handle

    with Consumer(socket_path, timeout_s=TIMEOUT_S) as consumer:
        lease = consumer.acquire(Handle.from_bytes(handle_bytes))
        held = (BACKEND, lease.lease_id != 0, consumer.stat().live_leases)
        data = lease.array.copy()
        lease.release()
        consumer.flush()
        return held, data, consumer.stat().live_leases


@pytest.mark.skipif(not objtable.available(), reason="needs a daemon with an object table (the C kernels)")
def test_a_pure_python_consumer_acquires_table_objects_through_the_daemons_proxy_bit(daemon, monkeypatch):
    data = np.arange(3000, dtype=np.uint8)
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer:
        handle = producer.put(data)
        assert handle.shm.slot  # an object of the table
        monkeypatch.setenv("SHMTRANSPORT_BACKEND", "python")  # the spawned child's backend
        held, got, after = run_in_child(_acquire_in_pure_python, daemon.socket_path, handle.to_bytes(),
                                        timeout_s=TIMEOUT_S)
        assert held == ("python", True, 1)  # a daemon lease (proxy bit), counted by the daemon
        assert np.array_equal(got, data) and after == 0
        producer.release(handle)
    assert daemon.stat().live_objects == 0


def _put_in_pure_python(conn, socket_path, data):
    """A producer without the C kernels: its object is one the daemon places (proxy bit)."""
    from shmtransport import BACKEND

    with Producer(socket_path, timeout_s=TIMEOUT_S) as producer:
        handle = producer.put(data)
        producer.stat()  # its Commit has landed (a consumer would otherwise ask the daemon, which waits for it)
        conn.send((BACKEND, handle.to_bytes()))
        assert conn.recv() == "release"  # the consumer holds it now
        producer.release(handle, wait=True)
    return "closed"


@pytest.mark.skipif(not objtable.available(), reason="needs a consumer with the C kernels")
def test_a_table_consumer_holds_an_object_the_daemon_placed_for_a_pure_python_producer(daemon, monkeypatch):
    """One path: the daemon placed the object in the table for a client without the C kernels, so
    a consumer with them acquires it there with its own bit, and the object outlives its
    producer's release until that bit goes; then the janitor gives its slot and bytes back."""
    data = np.arange(5000, dtype=np.uint8)
    monkeypatch.setenv("SHMTRANSPORT_BACKEND", "python")  # the spawned child's backend
    with Consumer(daemon.socket_path, timeout_s=TIMEOUT_S) as consumer, \
            BlockingChild(_put_in_pure_python, daemon.socket_path, data) as child:
        backend, wire = child.recv(timeout_s=TIMEOUT_S)
        assert backend == "python"
        lease = consumer.acquire_bytes(wire)
        assert lease.lease_id == 0 and lease.handle.shm.slot  # held with this consumer's bit, no RPC
        assert np.array_equal(lease.array, data)
        assert child.finish("release", timeout_s=TIMEOUT_S) == "closed"
        stat = daemon.stat()
        assert stat.live_objects == 1 and stat.live_leases == 1  # the producer's reference is gone
        lease.release()
        wait_until(lambda: daemon.stat().live_objects == 0, what="the janitor to reclaim the dead object")
        assert daemon.stat().used_nbytes == 0


def _acquire_twice_in_pure_python(socket_path, handle_bytes):
    from shmtransport.client import Handle

    with Consumer(socket_path, timeout_s=TIMEOUT_S) as consumer:
        handle = Handle.from_bytes(handle_bytes)
        leases = [consumer.acquire(handle), consumer.acquire(handle)]  # the second finds the proxy bit set
        assert all(lease.lease_id for lease in leases)
        consumer.release(leases, wait=True)


@pytest.mark.skipif(not objtable.available(), reason="needs a producer with the C kernels")
def test_leases_the_daemon_holds_on_a_held_table_object_never_end_its_hold(daemon, monkeypatch):
    """A table producer's object committed with a hold outlives every acquire and release until
    the hold passes: the daemon's proxy leases on it (a first, then a second on the bit it already
    holds) must not end it as they end a hand-off window."""
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer:
        handle = producer.put(np.arange(4000, dtype=np.uint8), hold_ms=60_000)
        monkeypatch.setenv("SHMTRANSPORT_BACKEND", "python")  # the spawned child's backend
        run_in_child(_acquire_twice_in_pure_python, daemon.socket_path, handle.to_bytes(), timeout_s=TIMEOUT_S)
        producer.release(handle, wait=True)
    slot = handle.shm.slot - 1
    assert daemon.stat().live_objects == 1  # only the hold keeps it now
    assert int(daemon.registry.objects.table.holders[slot]) == objtable.HANDOFF
    daemon.registry.expire(now=time.monotonic() + 61)  # the janitor, as of a minute later
    wait_until(lambda: daemon.stat().live_objects == 0, what="the object freed once its hold passed")
