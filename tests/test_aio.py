"""The asyncio clients (``shmtransport.aio``) against a real in-process daemon, and a spawned
process where it matters: the sync semantics through ``await``, a loop that never blocks (not
even while a loan waits for space), cancellation that leaves nothing behind, and close.

Each test runs its coroutine with ``asyncio.run`` (no pytest-asyncio). The conftest's leak check
(/dev/shm, fds, children, leases) and ``make_daemon``'s zero-live-objects teardown apply to all.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
import time

import numpy as np
import pytest

from shmtransport import AsyncConsumer, AsyncProducer
from shmtransport.client import Consumer, Handle, Lease, Loan, Producer
from shmtransport.errors import (
    ClosedError,
    HandleError,
    InvalidArgument,
    OwnershipError,
    Reason,
    ResourceExhausted,
    StateError,
    Unavailable,
)
from shmtransport.testing import BlockingChild, hold_until_told, remove_tree, run_in_child, short_tmpdir

KiB = 1024
MiB = 1 << 20
TIMEOUT_S = 10.0
TEST_TIMEOUT_S = 60.0
ALLOC_WAIT_S = 1.0
# A loop that ticks every 5 ms and never sees a gap this long was not blocked by a 1 s wait.
MAX_LOOP_GAP_S = ALLOC_WAIT_S / 5

# Properties that hold whether objects live in the object table (the default where the C kernels
# are) or go through the daemon's registry (a daemon without a table).
ON_BOTH_PATHS = pytest.mark.parametrize("shared_table", [True, False], ids=["default", "no_table"])


def run(coro):
    """Run a test's coroutine on a fresh loop, failing (not hanging) after TEST_TIMEOUT_S."""
    return asyncio.run(asyncio.wait_for(coro, TEST_TIMEOUT_S))


async def eventually(predicate, timeout_s: float = 5.0, what: str = ""):
    """Poll observable state without blocking the loop; the predicate's first truthy value."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.01)
    return value


class Heartbeat:
    """A task ticking every 5 ms; the longest gap between ticks is how long the loop was blocked."""

    def __init__(self) -> None:
        self.ticks = 0
        self.max_gap_s = 0.0

    async def _beat(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.005)
            now = time.monotonic()
            self.ticks += 1
            self.max_gap_s = max(self.max_gap_s, now - last)
            last = now

    async def __aenter__(self):
        self._task = asyncio.create_task(self._beat())
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


class Gate:
    """Patches a sync client method so that each call, once the real call returned, reports and
    waits for ``open()``: the test can cancel the awaiting task while the call is in the worker
    thread, then let it finish."""

    def __init__(self, monkeypatch, cls: type, name: str) -> None:
        self._returned = threading.Condition()
        self.calls = 0
        self._open = threading.Event()
        original = getattr(cls, name)

        def gated(client, *args, **kwargs):
            result = original(client, *args, **kwargs)
            with self._returned:
                self.calls += 1
                self._returned.notify_all()
            assert self._open.wait(TIMEOUT_S), "the test never opened the gate"
            return result

        monkeypatch.setattr(cls, name, gated)

    def wait_calls(self, n: int) -> None:
        """Block (call it off the loop) until ``n`` calls returned into the gate."""
        with self._returned:
            assert self._returned.wait_for(lambda: self.calls >= n, TIMEOUT_S), f"{self.calls} of {n} calls"

    def open(self) -> None:
        self._open.set()


def clients(daemon, **producer_options):
    return (AsyncProducer(daemon.socket_path, timeout_s=TIMEOUT_S, **producer_options),
            AsyncConsumer(daemon.socket_path, timeout_s=TIMEOUT_S))


def worker_threads(class_name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(f"shmtransport.{class_name}")]


def nothing_live(daemon) -> bool:
    s = daemon.stat()
    return s.live_objects == 0 and s.live_leases == 0


# -- children (module level: spawn pickles them by name) ------------------------------------------
def child_read_with_async_consumer(socket_path: str, blobs: list[bytes]) -> list[bytes]:
    """In its own process and event loop: acquire every handle, verify, copy out, release."""

    async def main() -> list[bytes]:
        async with AsyncConsumer(socket_path, timeout_s=TIMEOUT_S) as consumer:
            leases = await consumer.acquire_many([Handle.from_bytes(b) for b in blobs])
            out = []
            for lease in leases:
                lease.verify()
                out.append(lease.array.tobytes())
            await consumer.release(leases, wait=True)
            return out

    return asyncio.run(asyncio.wait_for(main(), TEST_TIMEOUT_S))


# -- the sync semantics through await --------------------------------------------------------------
@ON_BOTH_PATHS
def test_put_acquire_verify_release_round_trip_under_a_running_loop(make_daemon, shared_table):
    daemon = make_daemon(share_object_table=shared_table)
    data = np.random.default_rng(0).standard_normal((3, 64, 64), dtype=np.float32)

    async def main():
        producer, consumer = clients(daemon)
        async with producer, consumer:
            handle = await producer.put(data, digest=True)
            assert isinstance(handle, Handle)
            lease = await consumer.acquire(Handle.from_bytes(handle.to_bytes()))
            assert isinstance(lease, Lease)
            lease.verify()
            assert np.array_equal(lease.array, data)
            await consumer.release(lease, wait=True)
            await producer.release(handle, wait=True)
            assert lease.closed
            s = await producer.stat()
            assert s.live_objects == 0 and s.live_leases == 0
            assert (await consumer.list_objects(limit=10)).total_objects == 0

    run(main())


def test_loan_write_commit_and_acquire_many_round_trip(daemon):
    async def main():
        producer, consumer = clients(daemon)
        async with producer, consumer:
            loans = await producer.loan_many([(None, (4, 5), np.int32), (16, None, None)])
            assert all(isinstance(loan, Loan) for loan in loans)
            loans[0].array[:] = np.arange(20, dtype=np.int32).reshape(4, 5)
            loans[1].array[:] = 7
            handles = await producer.commit_many(loans, digest=True)
            single = await producer.loan(shape=(3,), dtype=np.float64)
            single.array[:] = 1.5
            handles.append(await producer.commit(single, digest=True, wait=True))
            leases = await consumer.acquire_many(handles)
            for lease in leases:
                lease.verify()
            assert np.array_equal(leases[0].array, np.arange(20).reshape(4, 5))
            assert leases[1].array.tolist() == [7] * 16 and leases[2].array.tolist() == [1.5] * 3
            await consumer.release(leases, wait=True)
            await producer.release(handles, wait=True)
            await consumer.flush()
            await producer.flush(strict=True)

    run(main())


@ON_BOTH_PATHS
def test_32_concurrent_tasks_on_one_producer_and_one_consumer_each_read_their_own_bytes(make_daemon, shared_table):
    daemon = make_daemon(share_object_table=shared_table)

    async def one(producer, consumer, i: int) -> bool:
        data = np.random.default_rng(i).integers(0, 2**31, size=1000 + 97 * i, dtype=np.int32)
        handle = await producer.put(data, digest=True)
        lease = await consumer.acquire(handle)
        lease.verify()
        same = np.array_equal(lease.array, data)
        await consumer.release(lease)
        await producer.release(handle)
        return same

    async def main():
        producer, consumer = clients(daemon)
        async with producer, consumer:
            results = await asyncio.gather(*(one(producer, consumer, i) for i in range(32)))
            await consumer.flush()
            s = await producer.stat()
        return results, s

    results, s = run(main())
    assert results == [True] * 32
    assert s.live_objects == 0 and s.live_leases == 0


def test_concurrent_first_calls_connect_one_session(daemon):
    before = {c.session_id for c in daemon.stat().clients}

    async def main():
        consumer = AsyncConsumer(daemon.socket_path, timeout_s=TIMEOUT_S)
        assert consumer.instance_id == ""  # constructing does no I/O
        try:
            stats = await asyncio.gather(*(consumer.stat() for _ in range(8)))
            assert consumer.instance_id == daemon.instance_id
            return {c.session_id for c in daemon.stat().clients} - before, stats
        finally:
            await consumer.close()

    new_sessions, stats = run(main())
    assert len(new_sessions) == 1 and len(stats) == 8


def test_errors_are_the_sync_clients_typed_errors(daemon):
    async def main():
        producer, consumer = clients(daemon)
        other = AsyncConsumer(daemon.socket_path, timeout_s=TIMEOUT_S)
        async with producer, consumer, other:
            with pytest.raises(InvalidArgument) as not_a_handle:
                await consumer.acquire(b"not a handle")
            with pytest.raises(InvalidArgument):
                await consumer.acquire_many([])
            with pytest.raises(InvalidArgument):
                await producer.loan()  # neither nbytes nor shape
            with pytest.raises(InvalidArgument):
                await producer.commit_many([])
            with pytest.raises(InvalidArgument):
                AsyncConsumer(daemon.socket_path, worker_threads=0)
            loan = await producer.loan(16)
            handle = await producer.commit(loan, wait=True)
            with pytest.raises(StateError):
                await producer.commit(loan)
            lease = await consumer.acquire(handle)
            with pytest.raises(OwnershipError):
                await other.release(lease)
            await consumer.release(lease, wait=True)
            await producer.release(handle, wait=True)
            with pytest.raises(HandleError) as stale:
                await consumer.acquire(handle)
            assert stale.value.reason is Reason.STALE_HANDLE
        with Consumer(daemon.socket_path, timeout_s=TIMEOUT_S) as sync_consumer, \
                pytest.raises(InvalidArgument) as sync_error:
            sync_consumer.acquire(b"not a handle")
        assert type(not_a_handle.value) is type(sync_error.value)
        assert str(not_a_handle.value) == str(sync_error.value)

    run(main())


def test_no_daemon_is_unavailable_at_connect_and_async_with_leaves_the_client_closed():
    tmp = short_tmpdir()
    try:
        async def main():
            consumer = AsyncConsumer(f"{tmp}/none.sock", timeout_s=TIMEOUT_S)
            with pytest.raises(Unavailable):
                await consumer.connect()
            with pytest.raises(Unavailable):
                await consumer.stat()  # not connected: the next call tries again
            await consumer.close()
            producer = AsyncProducer(f"{tmp}/none.sock", timeout_s=TIMEOUT_S)
            with pytest.raises(Unavailable):
                async with producer:
                    pass
            assert producer.closed and not worker_threads("AsyncProducer")

        run(main())
    finally:
        remove_tree(tmp)


# -- the loop never blocks --------------------------------------------------------------------------
@ON_BOTH_PATHS
def test_a_loan_on_a_full_arena_waits_without_blocking_the_loop_then_raises_resource_exhausted(
        make_daemon, shared_table):
    daemon = make_daemon(arena_nbytes=4 * MiB, share_object_table=shared_table)
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S, alloc_wait_s=0) as hog:
        held = hog.put_many([np.zeros(MiB, dtype=np.uint8)] * 4)
        assert daemon.stat().free_nbytes == 0

        async def main():
            async with AsyncProducer(daemon.socket_path, timeout_s=TIMEOUT_S, alloc_wait_s=ALLOC_WAIT_S) as patient, \
                    Heartbeat() as beat:
                start = time.monotonic()
                with pytest.raises(ResourceExhausted) as info:
                    await patient.loan(MiB)
                waited_s = time.monotonic() - start
            return info.value.reason, waited_s, beat

        reason, waited_s, beat = run(main())
        hog.release(held, wait=True)
    assert reason is Reason.ARENA_FULL
    assert waited_s >= 0.9 * ALLOC_WAIT_S  # it waited for space (back-pressure) before giving up
    assert beat.max_gap_s < MAX_LOOP_GAP_S, f"the loop stalled {beat.max_gap_s:.3f} s"
    assert beat.ticks >= 20


@ON_BOTH_PATHS
def test_a_loan_waiting_for_space_another_process_frees_succeeds_while_the_loop_runs(make_daemon, shared_table):
    daemon = make_daemon(arena_nbytes=MiB, share_object_table=shared_table)
    with BlockingChild(hold_until_told, daemon.socket_path, MiB) as child:
        assert child.recv(30) == "full"

        async def main():
            async with AsyncProducer(daemon.socket_path, timeout_s=TIMEOUT_S, alloc_wait_s=30) as patient:
                async with Heartbeat() as beat:
                    loan_task = asyncio.create_task(patient.loan(MiB))
                    await eventually(lambda: beat.ticks >= 20, what="the loop ticking while the loan waits")
                    assert not loan_task.done()  # the arena is full: the loan can only wait
                    await asyncio.to_thread(child.send, "release")
                    loan = await loan_task
                loan.array[:] = 3
                loan.release()
            return beat.max_gap_s

        max_gap_s = run(main())
        assert child.recv(10) == "released"
        child.finish()
    assert max_gap_s < MAX_LOOP_GAP_S, f"the loop stalled {max_gap_s:.3f} s"


def test_an_async_producer_hands_tensors_to_an_async_consumer_in_another_process(daemon):
    arrays = [np.random.default_rng(1).standard_normal((3, 32, 32), dtype=np.float32),
              np.arange(1000, dtype=np.int64)]

    async def main():
        async with AsyncProducer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer:
            handles = await producer.put_many(arrays, digest=True)
            read = await asyncio.to_thread(run_in_child, child_read_with_async_consumer, daemon.socket_path,
                                           [h.to_bytes() for h in handles], timeout_s=TEST_TIMEOUT_S)
            await producer.release(handles, wait=True)
        return read

    assert run(main()) == [a.tobytes() for a in arrays]


# -- cancellation -----------------------------------------------------------------------------------
async def _cancel_loan(producer, consumer, gate):
    return asyncio.create_task(producer.loan(64 * KiB))


async def _cancel_put(producer, consumer, gate):
    return asyncio.create_task(producer.put(np.ones(64 * KiB, np.uint8), digest=True))


async def _cancel_commit(producer, consumer, gate):
    loan = await producer.loan(64 * KiB)
    return asyncio.create_task(producer.commit(loan))


async def _cancel_acquire(producer, consumer, gate):
    handle = await producer.put(np.ones(64 * KiB, np.uint8))
    task = asyncio.create_task(consumer.acquire(handle))
    await asyncio.to_thread(gate.wait_calls, 1)
    await producer.release(handle, wait=True)  # from now on only the lease holds the object
    return task


CANCELLED_CALLS = {  # gated sync method, how to start the call to cancel
    "loan": ((Producer, "loan_many"), _cancel_loan),
    "put": ((Producer, "put_many"), _cancel_put),
    "commit": ((Producer, "commit_many"), _cancel_commit),
    "acquire": ((Consumer, "acquire_many"), _cancel_acquire),
}


@ON_BOTH_PATHS
@pytest.mark.parametrize("call", sorted(CANCELLED_CALLS))
def test_a_call_cancelled_while_it_runs_releases_what_it_returns_afterwards(
        make_daemon, monkeypatch, shared_table, call):
    daemon = make_daemon(share_object_table=shared_table)
    (cls, method), start = CANCELLED_CALLS[call]
    gate = Gate(monkeypatch, cls, method)

    async def main():
        producer, consumer = clients(daemon)
        async with producer, consumer:
            task = await start(producer, consumer, gate)
            await asyncio.to_thread(gate.wait_calls, 1)  # the call returned in its worker thread...
            assert not nothing_live(daemon)  # ... with a live loan, object or lease
            task.cancel()
            await asyncio.wait([task])
            assert task.cancelled()
            gate.open()  # ... and hands its result over after the cancellation
            # Released before the clients close (closing would reclaim loans and leases anyway).
            await eventually(lambda: nothing_live(daemon), what=f"the cancelled {call}'s result released")

    run(main())


def test_a_cancelled_call_still_waiting_for_a_worker_is_dropped_but_a_release_still_happens(daemon, monkeypatch):
    busy_worker = Gate(monkeypatch, Consumer, "stat")
    acquires = Gate(monkeypatch, Consumer, "acquire_many")
    acquires.open()  # only counts

    async def main():
        async with AsyncProducer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, \
                AsyncConsumer(daemon.socket_path, timeout_s=TIMEOUT_S, worker_threads=1) as consumer:
            handle = await producer.put(np.ones(KiB, np.uint8))
            lease = await consumer.acquire(handle)
            busy = asyncio.create_task(consumer.stat())
            await asyncio.to_thread(busy_worker.wait_calls, 1)  # the only worker is taken
            dropped = asyncio.create_task(consumer.acquire(handle))
            releasing = asyncio.create_task(consumer.release(lease))
            await asyncio.sleep(0)  # one loop iteration: each task's first step queues its call
            dropped.cancel()
            releasing.cancel()
            await asyncio.wait([dropped, releasing])
            assert dropped.cancelled() and releasing.cancelled() and not lease.closed
            busy_worker.open()
            await busy
            await eventually(lambda: lease.closed, what="the cancelled release done")
            assert acquires.calls == 1  # the queued acquire before it never ran
            await producer.release(handle, wait=True)
            await consumer.flush()
            assert nothing_live(daemon)

    run(main())


@ON_BOTH_PATHS
def test_cancelling_calls_at_every_stage_leaks_nothing(make_daemon, shared_table):
    daemon = make_daemon(share_object_table=shared_table)
    data = np.arange(16 * KiB, dtype=np.uint8)

    async def main():
        producer, consumer = clients(daemon)
        async with producer, consumer:
            shared = await producer.put(data)
            finished = 0
            for stage in range(40):
                tasks = [asyncio.create_task(producer.put(data)), asyncio.create_task(producer.loan(4 * KiB)),
                         asyncio.create_task(consumer.acquire(shared))]
                for _ in range(stage % 10):  # cancel while queued, running, or just returned
                    await asyncio.sleep(0)
                for task in tasks:
                    task.cancel()
                for result in await asyncio.gather(*tasks, return_exceptions=True):
                    if isinstance(result, Handle):  # finished before the cancel: ours to release
                        await producer.release(result)
                    elif isinstance(result, (Loan, Lease)):
                        result.release()
                    finished += not isinstance(result, asyncio.CancelledError)
            await producer.release(shared)
            await consumer.flush()
            await producer.flush()
            await eventually(lambda: nothing_live(daemon), what="every cancelled call's result released")
            return finished

    finished = run(main())
    assert finished < 120  # most calls were cancelled


@ON_BOTH_PATHS
def test_wait_for_gives_up_on_a_loan_waiting_for_space_at_once_and_the_space_comes_back(make_daemon, shared_table):
    daemon = make_daemon(arena_nbytes=4 * MiB, share_object_table=shared_table)
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S, alloc_wait_s=0) as hog:
        held = hog.put_many([np.zeros(MiB, dtype=np.uint8)] * 4)

        async def main():
            async with AsyncProducer(daemon.socket_path, timeout_s=TIMEOUT_S, alloc_wait_s=3.0) as patient:
                start = time.monotonic()
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(patient.loan(MiB), 0.2)
                gave_up_after_s = time.monotonic() - start
                await asyncio.to_thread(hog.release, held[:1], wait=True)
                # The cancelled loan (still waiting in its thread) takes the space and gives it
                # back, or this put gets it first: either way the put succeeds.
                handle = await patient.put(np.ones(MiB, dtype=np.uint8))
                await patient.release(handle, wait=True)
            return gave_up_after_s

        gave_up_after_s = run(main())
        hog.release(held[1:], wait=True)
    assert gave_up_after_s < 0.2 + MAX_LOOP_GAP_S  # not after alloc_wait_s


# -- close ------------------------------------------------------------------------------------------
def test_async_with_closes_the_session_and_the_worker_threads_and_a_closed_client_raises_closed_error(daemon):
    async def main():
        before = len(daemon.stat().clients)
        async with AsyncProducer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer:
            assert producer.instance_id == daemon.instance_id and not producer.closed
            assert len(daemon.stat().clients) == before + 1
            assert worker_threads("AsyncProducer")
        assert producer.closed and not worker_threads("AsyncProducer")
        await eventually(lambda: len(daemon.stat().clients) == before, what="the session ended")
        with pytest.raises(ClosedError):
            await producer.put(np.zeros(4))
        with pytest.raises(ClosedError):
            await producer.stat()
        await asyncio.gather(producer.close(), producer.close())  # idempotent

        consumer = AsyncConsumer(daemon.socket_path, timeout_s=TIMEOUT_S)
        with pytest.raises(ValueError):
            async with consumer:
                raise ValueError("the body's error propagates")
        assert consumer.closed and not worker_threads("AsyncConsumer")
        with pytest.raises(ClosedError):
            await consumer.acquire_many([])

    run(main())


def test_close_waits_for_calls_in_flight_and_releases_what_cancelled_ones_return(daemon, monkeypatch):
    """A put the close let finish hands its object off (it outlives the producer until a consumer
    takes it); the cancelled put's object is released before the session ends, so no hand-off."""
    gate = Gate(monkeypatch, Producer, "put_many")

    async def main():
        producer = AsyncProducer(daemon.socket_path, timeout_s=TIMEOUT_S)
        kept = asyncio.create_task(producer.put(np.full(KiB, 1, np.uint8)))
        cancelled = asyncio.create_task(producer.put(np.full(KiB, 2, np.uint8)))
        await asyncio.to_thread(gate.wait_calls, 2)
        cancelled.cancel()
        await asyncio.wait([cancelled])
        closing = asyncio.create_task(producer.close())
        await asyncio.sleep(0)
        assert producer.closed and not closing.done()  # waiting for the calls in the gate
        gate.open()
        await closing
        handle = await kept  # finished, not refused by the close
        assert daemon.stat().live_objects == 1  # only the kept put's object, in hand-off
        async with AsyncConsumer(daemon.socket_path, timeout_s=TIMEOUT_S) as consumer:
            lease = await consumer.acquire(handle)
            assert lease.array.tolist() == [1] * KiB
            await consumer.release(lease, wait=True)

    run(main())


def test_views_made_through_the_async_clients_name_the_await_line_as_their_call_site(daemon, monkeypatch):
    from shmtransport import _call_sites

    monkeypatch.setattr(_call_sites, "enabled", True)  # what a leak check turns on

    async def main():
        async with AsyncProducer(daemon.socket_path) as producer, AsyncConsumer(daemon.socket_path) as consumer:
            handle = await producer.put(np.arange(64, dtype=np.int32))
            point = _call_sites.mark()
            line = inspect.currentframe().f_lineno + 1
            lease = await consumer.acquire(handle)
            [(view, site)] = _call_sites.since(point)
            assert view is lease and site == f"{__file__}:{line} in main"
            await consumer.release(lease)
            await producer.release(handle, wait=True)

    run(main())
