"""The daemon's identity index (``Producer.publish``, ``lookup``): publish-if-absent, look-up from
any session of the tenant, entries that outlive their producer, eviction of unheld entries in LRU
order (over the budget, and for room), and every refusal. Real daemon, real clients; runs under
both backends (the pure-Python one places its objects through the daemon, the C one in its grants)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from shmtransport import testing
from shmtransport.client import Consumer, Producer
from shmtransport.errors import HandleError, InvalidArgument, OwnershipError, Reason, StateError, Unavailable

KIB = 1024


def _evict_all(daemon) -> None:
    """Drop every entry nobody holds, as a budget of 0 would: the fixture's teardown then finds no
    live object, so whatever a test left held shows up as a leak."""
    for tenant in daemon.tenants:
        registry = tenant.registry
        budget, registry.index.budget_nbytes = registry.index.budget_nbytes, 0
        try:
            registry.expire()
        finally:
            registry.index.budget_nbytes = budget


@pytest.fixture
def index_daemon(make_daemon):
    daemon = make_daemon(arena_nbytes=32 << 20, cache_nbytes=256 * KIB)
    yield daemon
    _evict_all(daemon)


@pytest.fixture
def clients(index_daemon):
    with Producer(index_daemon.config.socket_path) as producer, Consumer(index_daemon.config.socket_path) as consumer:
        yield producer, consumer


def _publish(producer: Producer, identity, value: int, nbytes: int = 64 * KIB, scope="s"):
    handle = producer.put(np.full(nbytes // 4, value, dtype=np.float32))
    published = producer.publish(handle, identity, scope=scope)
    producer.release(handle)
    return handle, published


def test_a_published_object_is_found_by_another_session_with_its_bytes(clients):
    producer, consumer = clients
    handle, published = _publish(producer, "item-1", 7)
    assert published.published and published.handle == handle
    found, missing = consumer.lookup(["item-1", "item-2"], scope="s")
    assert missing is None and found == handle
    with consumer.acquire(found) as lease:
        assert lease.array.dtype == np.float32 and (lease.array == 7).all()


def test_the_scope_is_part_of_the_identity(clients):
    producer, consumer = clients
    _publish(producer, "item", 1, scope="model-a")
    assert consumer.lookup(["item"], scope="model-b") == [None]
    assert consumer.lookup([b"item"], scope=b"model-a")[0] is not None  # a str is its UTF-8 bytes


def test_identities_are_opaque_bytes_never_names(clients):
    producer, consumer = clients
    odd = ["../escape", "a/b\\c", "\u00e9\u4e2d", b"\x00\xff\n"]
    for i, identity in enumerate(odd):
        _publish(producer, identity, i, nbytes=4 * KIB)
    assert all(h is not None for h in consumer.lookup(odd, scope="s"))
    assert consumer.lookup(["../escape/"], scope="s") == [None]  # exact, not a path
    shown = {o.identity for o in consumer.list_objects().objects}
    assert {"s/../escape", "s/a/b\\\\c", "s/\\xc3\\xa9\\xe4\\xb8\\xad", "s/\\x00\\xff\\n"} <= shown


def test_racing_publishers_publish_once_and_the_losers_bytes_are_freed(index_daemon):
    path = index_daemon.config.socket_path
    producers = [Producer(path) for _ in range(4)]
    barrier = threading.Barrier(len(producers))
    results = [None] * len(producers)

    def run(i: int) -> None:
        handle = producers[i].put(np.full(1024, i, dtype=np.int32))
        barrier.wait(timeout=10)
        results[i] = (handle, producers[i].publish(handle, "same", scope="s"))
        producers[i].release(handle)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(producers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    try:
        winners = [i for i, (_, p) in enumerate(results) if p.published]
        assert len(winners) == 1
        winner = results[winners[0]][0]
        assert all(p.handle == winner for _, p in results)
        s = testing.settle_daemon(index_daemon, max_leases=0, max_objects=1)
        assert s.live_objects == 1 and s.index_published == 1 and s.index_duplicates == 3
        with Consumer(path) as consumer, consumer.acquire(consumer.lookup(["same"], scope="s")[0]) as lease:
            assert (lease.array == winners[0]).all()
    finally:
        for p in producers:
            p.close()


def _publish_and_exit(socket_path: str, identity: str) -> str:
    with Producer(socket_path) as producer:
        handle = producer.put(np.arange(4096, dtype=np.int64))
        producer.publish(handle, identity, scope="s")
        producer.release(handle)
        return handle.to_bytes().hex()


def test_an_entry_outlives_its_producers_process(index_daemon, shm_run_in_child):
    wire = bytes.fromhex(shm_run_in_child(_publish_and_exit, index_daemon.config.socket_path, "kept"))
    with Consumer(index_daemon.config.socket_path) as consumer:
        [found] = consumer.lookup(["kept"], scope="s")
        assert found is not None and found.to_bytes() == wire
        with consumer.acquire(found) as lease:
            np.testing.assert_array_equal(lease.array, np.arange(4096, dtype=np.int64))


def test_over_the_budget_the_least_recently_used_unheld_entries_go(clients, index_daemon):
    producer, consumer = clients  # budget 256 KiB: four entries of 64 KiB
    for i in range(4):
        _publish(producer, f"k{i}", i)
    consumer.lookup(["k0"], scope="s")  # k1 is now the least recently used
    _publish(producer, "k4", 4)
    assert [h is None for h in consumer.lookup([f"k{i}" for i in range(5)], scope="s")] == \
        [False, True, False, False, False]
    s = consumer.stat()
    assert (s.index_entries, s.index_nbytes, s.index_evictions) == (4, 256 * KIB, 1)
    assert s.index_budget_nbytes == 256 * KIB


def test_an_entry_someone_holds_is_never_evicted(clients, index_daemon):
    producer, consumer = clients
    _publish(producer, "held", 9)
    lease = consumer.acquire(consumer.lookup(["held"], scope="s")[0])
    for i in range(6):  # well past the budget: every other entry may go, "held" may not
        _publish(producer, f"k{i}", i)
    testing.settle_daemon(index_daemon, max_leases=1, max_objects=5)
    assert consumer.lookup(["held"], scope="s")[0] is not None
    assert (lease.array == 9).all()
    lease.release()
    consumer.flush()
    for i in range(4):  # a budget's worth of newer entries: now "held" goes with the others
        _publish(producer, f"new{i}", i)
    assert consumer.lookup(["held"], scope="s") == [None]


def test_a_looked_up_handle_evicted_before_its_acquire_is_a_stale_handle(clients):
    producer, consumer = clients
    _publish(producer, "gone", 1)
    [found] = consumer.lookup(["gone"], scope="s")
    for i in range(5):
        _publish(producer, f"k{i}", i)
    with pytest.raises(HandleError) as err:
        consumer.acquire(found)
    assert err.value.reason is Reason.STALE_HANDLE


def test_a_full_arena_evicts_unheld_entries_instead_of_refusing_a_loan(make_daemon):
    daemon = make_daemon(arena_nbytes=4 << 20, cache_nbytes=4 << 20)
    try:
        with Producer(daemon.config.socket_path, alloc_wait_s=2.0) as producer:
            for i in range(6):  # 3 MiB of entries nobody holds
                _publish(producer, f"k{i}", i, nbytes=512 * KIB)
            big = producer.put(np.zeros(3 << 20, dtype=np.uint8))  # needs most of the arena
            producer.release(big)
            assert producer.stat().index_evictions >= 3
    finally:
        _evict_all(daemon)


def test_refusals(clients, index_daemon):
    producer, consumer = clients
    handle = producer.put(np.zeros(16, dtype=np.float32))
    for identity, scope in ((b"", "s"), (b"x" * 257, "s"), (b"x", b"s" * 257)):
        with pytest.raises(InvalidArgument):
            producer.publish(handle, identity, scope=scope)
    with pytest.raises(InvalidArgument):
        consumer.lookup([b"x" * 257])
    with pytest.raises(InvalidArgument):
        consumer.lookup([])
    forged = type(handle)(handle.shm, "float32", (17,))  # 68 bytes: not what the handle's 64 hold
    with pytest.raises(InvalidArgument):
        producer.publish(forged, "x")
    with pytest.raises(InvalidArgument):
        producer.publish(type(handle)(handle.shm, "complex64", (8,)), "x")
    assert producer.publish(handle, "first").published
    with pytest.raises(StateError):
        producer.publish(handle, "second")  # one object, one identity
    with Producer(index_daemon.config.socket_path) as other:
        theirs = other.put(np.zeros(16, dtype=np.float32))
        with pytest.raises(OwnershipError):
            producer.publish(theirs, "not-mine")
        other.release(theirs)
    loan = producer.loan(shape=(16,), dtype=np.float32)
    with pytest.raises((StateError, HandleError)):  # not committed
        producer.publish(loan.handle, "uncommitted")
    loan.release()
    stale = producer.put(np.zeros(16, dtype=np.float32))
    producer.release(stale)
    with pytest.raises(HandleError):
        producer.publish(stale, "stale")
    other_instance = type(handle)(type(handle.shm)(**{**_fields(handle.shm), "instance_id": "nope"}), "float32",
                                  (16,))
    with pytest.raises(Unavailable):
        producer.publish(other_instance, "elsewhere")
    producer.release(handle)
    assert consumer.lookup(["second", "not-mine", "uncommitted", "stale", "elsewhere"], scope=b"") == [None] * 5


def _fields(message) -> dict:
    return {field.name: value for field, value in message.ListFields()}


def test_stat_and_ls_show_the_index(clients, index_daemon):
    producer, consumer = clients
    _publish(producer, "seen", 1)
    consumer.lookup(["seen", "unseen"], scope="s")
    s = consumer.stat()
    assert (s.index_entries, s.index_hits, s.index_misses, s.index_published) == (1, 1, 1, 1)
    env = {**os.environ, "SHMTRANSPORT_SOCKET": index_daemon.config.socket_path}
    run = lambda *args: subprocess.run([sys.executable, "-m", "shmtransport", *args], env=env,  # noqa: E731
                                       capture_output=True, text=True, timeout=60, check=True).stdout
    assert "[s/seen]" in run("ls", "--published")
    assert json.loads(run("ls", "--json"))["objects"][0]["identity"] == "s/seen"
    assert "identity index  1 entries" in run("stat")
