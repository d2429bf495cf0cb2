"""A producer that runs for days: ``keep=False`` hands each object off for good (it lives until its
first consumer acquires it, or the hand-off window passes), so a loop never fills the arena, and a
full arena's error tells the producer what it still holds and what to call. Under either backend
(the object table with the C kernels, the daemon's Loan/Commit RPCs without)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from shmtransport import AsyncProducer
from shmtransport.client import Consumer, Producer
from shmtransport.errors import HandleError, ResourceExhausted, ShmTransportError
from shmtransport.testing import BlockingChild, wait_until

MIB = 1 << 20
TIMEOUT_S = 30


def _live(client: Producer | Consumer) -> tuple[int, int]:
    stat = client.stat()
    return stat.live_objects, stat.live_leases


def test_put_keep_false_lives_until_its_first_acquire(shm_make_daemon):
    daemon = shm_make_daemon(arena_nbytes=8 * MIB, handoff_window_ms=60_000)
    data = np.arange(MIB, dtype=np.uint8)
    with Producer(daemon.socket_path) as producer, Consumer(daemon.socket_path) as consumer:
        handle = producer.put(data, keep=False)
        assert _live(producer) == (1, 0)  # the producer holds nothing, the hand-off keeps it
        with consumer.acquire(handle) as lease:
            assert np.array_equal(lease.array, data)
        wait_until(lambda: _live(producer) == (0, 0), timeout_s=TIMEOUT_S, what="freed at the first release")
        with pytest.raises(HandleError):
            consumer.acquire(handle)  # the first consumer took it: gone for good


def test_commit_keep_false_is_reclaimed_when_the_window_passes(shm_make_daemon):
    daemon = shm_make_daemon(arena_nbytes=8 * MIB, handoff_window_ms=300)
    with Producer(daemon.socket_path) as producer, Consumer(daemon.socket_path) as consumer:
        loan = producer.loan(shape=(256,), dtype=np.float32)
        loan.array[:] = 1.5
        handle = loan.commit(keep=False)
        loan.release()  # harmless: the loan's reference went with the commit
        before = producer.stat().reclaimed_handoff_objects
        wait_until(lambda: _live(producer) == (0, 0), timeout_s=TIMEOUT_S, what="reclaimed after the window")
        assert producer.stat().reclaimed_handoff_objects == before + 1
        with pytest.raises(HandleError):
            consumer.acquire(handle)


def test_async_put_and_commit_keep_false(shm_make_daemon):
    daemon = shm_make_daemon(arena_nbytes=8 * MIB, handoff_window_ms=60_000)

    async def produce() -> list:
        async with AsyncProducer(daemon.socket_path) as producer:
            loan = await producer.loan(4096)
            loan.array[:] = 7
            return [await producer.put(np.full(4096, 3, dtype=np.uint8), keep=False),
                    await producer.commit(loan, keep=False)]

    handles = asyncio.run(produce())  # the producer closed: the objects wait for their consumer
    with Consumer(daemon.socket_path) as consumer:
        for handle, value in zip(handles, (3, 7)):
            with consumer.acquire(handle) as lease:
                assert (lease.array == value).all()
        wait_until(lambda: _live(consumer) == (0, 0), timeout_s=TIMEOUT_S, what="freed at the first release")


def test_release_of_a_handed_off_object_is_refused(shm_make_daemon):
    daemon = shm_make_daemon(arena_nbytes=8 * MIB)
    with Producer(daemon.socket_path) as producer, Consumer(daemon.socket_path) as consumer:
        handle = producer.put(np.ones(4096, dtype=np.uint8), keep=False)
        with pytest.raises(ShmTransportError):  # not this producer's any more: nothing changes
            producer.release(handle, wait=True)
        with consumer.acquire(handle) as lease:  # still the consumer's
            assert lease.array.sum() == 4096


def test_full_arena_says_what_the_session_holds_and_what_to_call(shm_make_daemon):
    daemon = shm_make_daemon(arena_nbytes=8 * MIB)
    with Producer(daemon.socket_path, alloc_wait_s=0) as producer:
        kept = []
        with pytest.raises(ResourceExhausted) as raised:
            for _ in range(16):
                kept.append(producer.put(np.zeros(MIB, dtype=np.uint8)))
        message = raised.value.message
        assert f"This session still holds {len(kept)} committed objects" in message, message
        assert "producer.release(handle)" in message and "keep=False" in message, message
        producer.release(kept, wait=True)
        producer.release(producer.put(np.zeros(MIB, dtype=np.uint8)), wait=True)  # room again


# -- a frontend loop that runs for days ---------------------------------------------------------
OBJECT_NBYTES = 64 * MIB
OBJECTS = 2000
NEVER_EVERY = 50  # one request in 50 is dropped before any worker acquires it


def _consume(conn, socket_path: str, lag: int) -> dict:
    """A worker: acquires each handle it is sent ``lag`` handles later (0: at once) and checks the
    object's first and last words; ``lag`` None: never acquires (dropped requests)."""
    acquired, pending = 0, []
    with Consumer(socket_path, timeout_s=TIMEOUT_S) as consumer:
        while True:
            message = conn.recv()
            if message is not None:
                pending.append(message)
            if lag is None:
                pending.clear()
            while pending and (len(pending) > lag or message is None):
                seq, data = pending.pop(0)
                with consumer.acquire_bytes(data) as lease:
                    words = lease.array.view(np.int64)
                    assert words[0] == seq and words[-1] == seq, (seq, words[0], words[-1])
                acquired += 1
            if message is None:
                return {"acquired": acquired}


def test_a_producer_loop_of_64_mib_objects_never_fills_a_1_gib_arena(shm_make_daemon):
    """2,000 objects of 64 MiB through a 1 GiB arena (16 of them fit), handed off with keep=False
    to workers that acquire at once, two handles late, or never: the loop never fails, every
    acquire reads its own object, and nothing is left once the window has passed."""
    daemon = shm_make_daemon(arena_nbytes=1 << 30, handoff_window_ms=2000)
    workers = {"early": 0, "late": 2, "never": None}
    children = {name: BlockingChild(_consume, daemon.socket_path, lag) for name, lag in workers.items()}
    sent = dict.fromkeys(workers, 0)
    try:
        # alloc_wait_s covers a hand-off window: room comes back when a dropped object's window ends
        with Producer(daemon.socket_path, timeout_s=TIMEOUT_S, alloc_wait_s=10) as producer:
            for seq in range(OBJECTS):
                loan = producer.loan(shape=(OBJECT_NBYTES // 8,), dtype=np.int64)
                loan.array[0] = loan.array[-1] = seq  # (the renderer would write it all)
                handle = loan.commit(keep=False)
                name = "never" if seq % NEVER_EVERY == 0 else ("early", "late")[seq % 2]
                children[name].send((seq, handle.to_bytes()))
                sent[name] += 1
            results = {name: child.finish(None) for name, child in children.items()}
            assert results["early"]["acquired"] == sent["early"]
            assert results["late"]["acquired"] == sent["late"]
            assert results["never"]["acquired"] == 0
            wait_until(lambda: _live(producer) == (0, 0), timeout_s=TIMEOUT_S, what="the dropped objects reclaimed")
            stat = producer.stat()
            assert stat.reclaimed_handoff_objects == sent["never"]
    finally:
        for child in children.values():
            child.close()


def test_producers_that_hand_off_one_object_and_close_keep_one_slot_each(shm_make_daemon):
    """Each such producer once kept its whole grant's 64 slots for the hand-off window: two of them
    filled a table of 128 slots, and the next producer was refused at once. Now a dead slot of an
    orphaned grant goes back to the table when its object dies (or at once), and a grant gets the
    longest run of free slots when no 64 are free in a row."""
    daemon = shm_make_daemon(arena_nbytes=16 * MIB, object_slots=128, handoff_window_ms=60_000)
    handed_off = []
    for value in range(2):
        with Producer(daemon.socket_path) as producer:
            handed_off.append(producer.put(np.full(4096, value, np.uint8), keep=False))
    with Producer(daemon.socket_path, alloc_wait_s=0) as producer, Consumer(daemon.socket_path) as consumer:
        for value in range(10, 110):
            handle = producer.put(np.full(4096, value, np.uint8), keep=False)
            with consumer.acquire(handle) as lease:
                assert int(lease.array[0]) == int(lease.array[-1]) == value
        for value, handle in enumerate(handed_off):
            with consumer.acquire(handle) as lease:
                assert int(lease.array[0]) == value
        wait_until(lambda: _live(consumer) == (0, 0), timeout_s=TIMEOUT_S, what="every object freed")
