"""Dedicated segment per object: a stock reader may unlink the segment; the daemon tolerates that,
still reclaims on release / TTL / hold, and leaves nothing in /dev/shm."""
from __future__ import annotations

import os
import re
from multiprocessing import shared_memory

import numpy as np
import pytest

from shmtransport.client import Consumer, Producer
from shmtransport.errors import HandleError
from shmtransport.testing import settle_daemon

SHM = "/dev/shm"


def stock_read_and_unlink(name: str, offset: int, nbytes: int) -> bytes:
    """What SMG's / vLLM's ShmHandle reader does: open by name, copy the bytes, unlink."""
    shm = shared_memory.SharedMemory(name=name, create=False)
    try:
        data = bytes(shm.buf[offset:offset + nbytes])
    finally:
        shm.close()
    shm.unlink()
    return data


def settle(daemon):
    """The daemon's Stat once its objects are gone (releases are asynchronous), or after 3 s."""
    return settle_daemon(daemon, max_leases=1 << 30, max_objects=0)


def test_handle_names_its_own_segment_and_reader_may_unlink(daemon):
    arr = np.arange(1000, dtype=np.float32)
    with Producer(daemon.socket_path, timeout_s=10) as producer:
        h = producer.put(arr, digest=True, dedicated=True)
        prefix = daemon.segment_names[0].rsplit("-", 1)[0]
        assert re.fullmatch(re.escape(prefix) + r"-obj\d+-[0-9a-f]{8}", h.shm.name)
        assert h.shm.offset == 0 and h.shm.nbytes == arr.nbytes
        assert os.path.exists(os.path.join(SHM, h.shm.name))
        assert h.shm.name in daemon.segment_names
        data = stock_read_and_unlink(h.shm.name, h.shm.offset, h.shm.nbytes)
        assert np.array_equal(np.frombuffer(data, np.float32), arr)
        assert not os.path.exists(os.path.join(SHM, h.shm.name))
        assert daemon.stat().live_objects == 1  # the daemon still owns the object
        producer.release(h, wait=True)  # freeing tolerates the missing name
    assert settle(daemon).live_objects == 0
    assert h.shm.name not in daemon.segment_names


def test_our_consumer_reads_dedicated_handles(daemon):
    arrs = [np.arange(10, dtype=np.int64), np.ones((3, 4), np.float16)]
    with Producer(daemon.socket_path, timeout_s=10) as producer, Consumer(daemon.socket_path, timeout_s=10) as consumer:
        hs = producer.put_many(arrs, digest=True, dedicated=True)
        assert len({h.shm.name for h in hs}) == 2
        leases = consumer.acquire_many(hs)
        for lease, a in zip(leases, arrs):
            lease.verify()
            assert np.array_equal(lease.array, a)
        consumer.release(leases, wait=True)
        producer.release(hs, wait=True)
    assert settle(daemon).live_objects == 0
    assert not any(os.path.exists(os.path.join(SHM, h.shm.name)) for h in hs)


def test_hold_ttl_reclaims_after_reader_unlinked(daemon):
    with Producer(daemon.socket_path, timeout_s=10) as producer:
        h = producer.put(np.zeros(64, np.uint8), hold_ms=150, dedicated=True)
        producer.release(h, wait=True)  # only the hold keeps it now
        stock_read_and_unlink(h.shm.name, 0, h.shm.nbytes)
        assert daemon.stat().live_objects == 1
        s = settle(daemon)
    assert s.live_objects == 0
    assert not os.path.exists(os.path.join(SHM, h.shm.name))


def test_hold_ttl_reclaims_without_a_reader(daemon):
    with Producer(daemon.socket_path, timeout_s=10) as producer:
        h = producer.put(np.zeros(64, np.uint8), hold_ms=100, dedicated=True)
        producer.release(h, wait=True)
        assert os.path.exists(os.path.join(SHM, h.shm.name))
        assert settle(daemon).live_objects == 0
    assert not os.path.exists(os.path.join(SHM, h.shm.name))


def test_freed_dedicated_handle_is_stale(daemon):
    with Producer(daemon.socket_path, timeout_s=10) as producer, Consumer(daemon.socket_path, timeout_s=10) as consumer:
        h = producer.put(np.zeros(8, np.uint8), dedicated=True)
        producer.release(h, wait=True)
        settle(daemon)
        with pytest.raises(HandleError, match="stale"):
            consumer.acquire(h)


@pytest.mark.allow_live_objects
def test_daemon_stop_unlinks_live_dedicated_segments(make_daemon):
    daemon = make_daemon()
    producer = Producer(daemon.socket_path, timeout_s=10)
    try:
        hs = producer.put_many([np.zeros(16, np.uint8)] * 3, dedicated=True)
        names = [h.shm.name for h in hs]
        stock_read_and_unlink(names[0], 0, 16)  # one already gone: stop must tolerate it
        assert all(os.path.exists(os.path.join(SHM, n)) for n in names[1:])
        daemon.stop()
        assert not any(os.path.exists(os.path.join(SHM, n)) for n in names)
    finally:
        try:
            producer.close()
        except Exception:
            pass


def test_quota_applies(make_daemon):
    daemon = make_daemon(quota_nbytes=1 << 16)
    before = daemon.segment_names
    with Producer(daemon.socket_path, timeout_s=10) as producer:
        from shmtransport.errors import Reason, ResourceExhausted

        with pytest.raises(ResourceExhausted) as info:
            producer.put(np.zeros(1 << 17, np.uint8), dedicated=True)
        assert (info.value.reason, info.value.field, info.value.limit) == (Reason.QUOTA_EXCEEDED, "nbytes", 1 << 16)
        del info
    assert daemon.stat().live_objects == 0
    assert daemon.segment_names == before  # no dedicated segment was left behind
