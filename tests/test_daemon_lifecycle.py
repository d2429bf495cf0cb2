"""The daemon + client lifecycle with a real in-process daemon and real (spawned) client processes.

Covers the lifetime rules of ``docs/design.md``: bytes live exactly as long as a producer reference,
a lease or a hold; dead clients lose everything they held; TTLs reclaim; quotas and a full arena
are typed errors that recover; views never outlive their lease silently.
"""
from __future__ import annotations

import gc
import os
import threading
import time

import numpy as np
import pytest

from shmtransport.client import Consumer, Handle, Producer
from shmtransport.errors import ClosedError, HandleError, IdentityMismatch, Reason, ResourceExhausted, StateError
from shmtransport.testing import BlockingChild, open_fds, run_in_child, start_children, wait_until
from shmtransport.v1 import daemon_pb2 as pb

KiB = 1024
MiB = 1 << 20
TIMEOUT_S = 10.0
HANDOFF_WINDOW_MS = 2_000  # long enough to see an object outlive its producer, short enough to wait for

# Properties that hold whether objects live in the object table (the default where the C kernels
# are) or go through the daemon's registry (a daemon without a table).
ON_BOTH_PATHS = pytest.mark.parametrize("shared_table", [True, False], ids=["default", "no_table"])


def wait_stat(daemon, predicate, timeout_s=5.0, what=""):
    """Poll the daemon's stat until ``predicate(stat)``; that stat."""

    def check():
        s = daemon.stat()
        return s if predicate(s) else None

    return wait_until(check, timeout_s=timeout_s, what=what)


def sample_arrays(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        rng.standard_normal((3, 224, 224), dtype=np.float32),  # pixel_values-like
        np.array([[1, 16, 16], [1, 32, 8]], dtype=np.int64),  # image_grid_thw-like
        rng.integers(0, 255, size=(1000,), dtype=np.uint8),
        rng.standard_normal((17, 5)).astype(np.float16),
        rng.integers(-(2**31), 2**31 - 1, size=(7, 3, 2), dtype=np.int32),
        (rng.random(33) > 0.5),
    ]


# -- children (module level: spawn pickles them by name) ------------------------------------------
def child_read_all(socket_path: str, blobs: list[bytes], verify: bool = False) -> list[tuple[str, tuple, bytes]]:
    """Acquire every handle in one batch, copy the bytes out, release; (dtype, shape, bytes) each."""
    with Consumer(socket_path, timeout_s=TIMEOUT_S) as consumer:
        leases = consumer.acquire_many([Handle.from_bytes(b) for b in blobs])
        out = []
        for lease in leases:
            if verify:
                lease.verify()
            out.append((lease.handle.dtype, lease.array.shape, lease.array.tobytes()))
        consumer.release(leases)
        del leases
    return out


def child_loan_and_block(conn, socket_path: str, nbytes: int) -> None:
    """Loan, write, report the (uncommitted) handle, then block until told to finish or killed."""
    with Producer(socket_path, timeout_s=TIMEOUT_S) as producer:
        loan = producer.loan(nbytes)
        loan.array[:] = 0xAB
        conn.send(loan.handle.to_bytes())
        conn.recv()
        loan.release()
        del loan


def child_put_and_block(conn, socket_path: str, array: np.ndarray) -> None:
    """Put (commit), report the handle, then block holding the producer reference."""
    with Producer(socket_path, timeout_s=TIMEOUT_S) as producer:
        handle = producer.put(array, digest=True)
        conn.send(handle.to_bytes())
        conn.recv()
        producer.release(handle)


def child_acquire_and_block(conn, socket_path: str, blobs: list[bytes]) -> None:
    """Acquire leases on every handle, report their ids, then block holding them."""
    with Consumer(socket_path, timeout_s=TIMEOUT_S) as consumer:
        leases = consumer.acquire_many([Handle.from_bytes(b) for b in blobs])
        conn.send([lease.lease_id for lease in leases])
        conn.recv()
        consumer.release(leases)
        del leases


def child_mixed_workload(socket_path: str, seed: int, shared: list[tuple[bytes, np.ndarray]], iterations: int) -> int:
    """One client process: put / put_many / loan→commit / acquire / release in a seeded random
    order, checking every byte it reads (its own objects and the shared ones); objects checked."""
    rng = np.random.default_rng(seed)
    checked = 0
    with Producer(socket_path, timeout_s=TIMEOUT_S) as producer, Consumer(socket_path, timeout_s=TIMEOUT_S) as consumer:
        shared_handles = [(Handle.from_bytes(blob), expected) for blob, expected in shared]
        outstanding: list[tuple[Handle, np.ndarray]] = []

        def make() -> np.ndarray:
            n = int(rng.integers(1, 64 * KiB))
            return rng.integers(0, 2**31, size=n, dtype=np.int32).astype(np.float32)

        for _ in range(iterations):
            op = int(rng.integers(0, 4))
            if op == 0:
                arr = make()
                outstanding.append((producer.put(arr, digest=True), arr))
            elif op == 1:
                arrs = [make() for _ in range(3)]
                outstanding.extend(zip(producer.put_many(arrs, digest=True), arrs))
            elif op == 2:
                arr = make()
                loan = producer.loan(shape=arr.shape, dtype=arr.dtype)
                loan.array[...] = arr
                outstanding.append((loan.commit(digest=True), arr))
                del loan
            if outstanding and (op == 3 or len(outstanding) > 4):
                picks = [outstanding.pop(int(rng.integers(0, len(outstanding))))]
                picks.append(shared_handles[int(rng.integers(0, len(shared_handles)))])
                leases = consumer.acquire_many([h for h, _ in picks])
                for lease, (_, expected) in zip(leases, picks):
                    lease.verify()
                    if not np.array_equal(lease.array, expected):
                        raise AssertionError(f"bytes differ for {lease.handle!r} (seed {seed})")
                    checked += 1
                consumer.release(leases)
                del leases
                producer.release(picks[0][0])
        if outstanding:
            producer.release([h for h, _ in outstanding])
    return checked


def child_fail_with(reason_value: str) -> None:
    raise HandleError("raised in the child", Reason(reason_value))


def child_report_and_wait(conn, value):
    conn.send(value)
    return conn.recv() * 2


# -- the harness itself --------------------------------------------------------------------------
def test_run_in_child_reraises_the_childs_error_with_its_class_reason_and_traceback():
    with pytest.raises(HandleError) as info:
        run_in_child(child_fail_with, Reason.STALE_HANDLE.value, timeout_s=60)
    assert info.value.reason is Reason.STALE_HANDLE
    assert any("child_fail_with" in note for note in info.value.__notes__)


def test_blocking_child_reports_then_finishes_or_dies_by_sigkill():
    with BlockingChild(child_report_and_wait, "ready") as child:
        assert child.recv(timeout_s=60) == "ready"
        assert child.finish(21) == 42
    with BlockingChild(child_report_and_wait, "ready") as child:
        assert child.recv(timeout_s=60) == "ready"
        assert child.kill() == -9


# -- round trips ---------------------------------------------------------------------------------
def test_put_then_acquire_in_another_process_returns_identical_bytes_dtype_and_shape(daemon):
    arrays = sample_arrays()
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer:
        handles = [producer.put(a, digest=True) for a in arrays]
        got = run_in_child(child_read_all, daemon.socket_path, [h.to_bytes() for h in handles], True, timeout_s=60)
        producer.release(handles)
    for arr, (dtype, shape, data) in zip(arrays, got):
        assert dtype == arr.dtype.name
        assert shape == arr.shape
        assert data == arr.tobytes()


def test_consumer_views_are_read_only_and_zero_copy_over_the_arena(daemon):
    arr = np.arange(1000, dtype=np.float32)
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, Consumer(
        daemon.socket_path, timeout_s=TIMEOUT_S
    ) as consumer:
        handle = producer.put(arr)
        with consumer.acquire(handle) as lease:
            view = lease.array
            assert not view.flags.writeable
            with pytest.raises(ValueError):
                view[0] = 1.0
            assert view.base is not None and not view.flags.owndata
            assert lease.array is view  # the same view, not a copy per access
            del view
        producer.release(handle)


def test_torch_tensor_has_the_leased_bytes_and_stays_the_same_view(daemon):
    torch = pytest.importorskip("torch")
    src = torch.arange(97 * 3, dtype=torch.float32).reshape(3, 97)
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, Consumer(
        daemon.socket_path, timeout_s=TIMEOUT_S
    ) as consumer:
        handle = producer.put(src, digest=True)
        assert handle.dtype == "float32" and handle.shape == (3, 97)
        with consumer.acquire(handle) as lease:
            tensor = lease.tensor()
            assert torch.equal(tensor, src)
            assert tensor.data_ptr() == lease.tensor().data_ptr()  # the lease's one private view
            lease.verify()
            del tensor
        producer.release(handle)

        # Writable side: a torch tensor over a loan writes the very bytes the numpy view sees.
        loan = producer.loan(shape=(4, 8), dtype=torch.float32)
        t = loan.tensor()
        t.copy_(torch.arange(32, dtype=torch.float32).reshape(4, 8))
        assert t.data_ptr() == loan.array.ctypes.data
        assert np.array_equal(loan.array, np.arange(32, dtype=np.float32).reshape(4, 8))
        del t
        handle = loan.commit()
        with consumer.acquire(handle) as lease:
            assert torch.equal(lease.tensor(), torch.arange(32, dtype=torch.float32).reshape(4, 8))
        loan.release()  # drops the producer reference
        del loan, lease


def test_bfloat16_written_through_a_loan_round_trips_bit_exactly(daemon):
    torch = pytest.importorskip("torch")
    src = torch.linspace(-3, 3, 97, dtype=torch.float32).to(torch.bfloat16).reshape(1, 97)
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, Consumer(
        daemon.socket_path, timeout_s=TIMEOUT_S
    ) as consumer:
        loan = producer.loan(shape=(1, 97), dtype=torch.bfloat16)
        assert loan.handle.dtype == "bfloat16" and loan.handle.nbytes == 97 * 2
        loan.tensor().copy_(src)
        handle = loan.commit(digest=True)
        with consumer.acquire(handle) as lease:
            tensor = lease.tensor()
            assert tensor.dtype == torch.bfloat16
            assert torch.equal(tensor.view(torch.int16), src.view(torch.int16))  # bit-exact
            assert tensor.data_ptr() == lease.tensor().data_ptr()
            lease.verify()
            del tensor
        loan.release()
        del loan, lease


def test_put_of_a_bfloat16_torch_tensor_round_trips_bit_exactly(daemon):
    torch = pytest.importorskip("torch")
    src = torch.linspace(-3, 3, 97, dtype=torch.float32).to(torch.bfloat16).reshape(1, 97)
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, Consumer(
        daemon.socket_path, timeout_s=TIMEOUT_S
    ) as consumer:
        handle = producer.put(src, digest=True)
        try:
            assert handle.dtype == "bfloat16" and handle.shape == (1, 97)
            lease = consumer.acquire(handle)
            assert torch.equal(lease.tensor().view(torch.int16), src.view(torch.int16))
            lease.verify()
            lease.release()
        finally:
            producer.release(handle)


def test_loan_then_commit_publishes_bytes_written_in_place(daemon):
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer:
        loan = producer.loan(shape=(64, 3), dtype=np.int16)
        assert loan.array.flags.writeable
        loan.array[...] = np.arange(192, dtype=np.int16).reshape(64, 3)
        handle = loan.commit(digest=True)
        assert handle.digest
        [(dtype, shape, data)] = run_in_child(child_read_all, daemon.socket_path, [handle.to_bytes()], True)
        assert (dtype, shape) == ("int16", (64, 3))
        assert data == np.arange(192, dtype=np.int16).tobytes()
        loan.release()  # drops the producer reference after commit
        producer.flush()  # releases are queued (piggybacked); send it now
        del loan
        assert daemon.stat().live_objects == 0


def test_batch_forms_round_trip_in_one_call_each(daemon):
    arrays = sample_arrays(1)
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, Consumer(
        daemon.socket_path, timeout_s=TIMEOUT_S
    ) as consumer:
        before = daemon.stat().allocations_total
        handles = producer.put_many(arrays, digest=True)
        assert daemon.stat().allocations_total == before + len(arrays)
        loans = producer.loan_many([(None, a.shape, a.dtype) for a in arrays])
        for loan, a in zip(loans, arrays):
            loan.array[...] = a
        handles2 = producer.commit_many(loans, digest=True)
        assert [h.digest for h in handles2] == [h.digest for h in handles]  # same content, same digest
        leases = consumer.acquire_many(handles + handles2)
        assert daemon.stat().live_leases == 2 * len(arrays)
        for lease, a in zip(leases, arrays + arrays):
            lease.verify()
            assert lease.array.dtype == a.dtype and np.array_equal(lease.array, a)
        consumer.release(leases, wait=True)
        assert daemon.stat().live_leases == 0
        producer.release(handles)
        for loan in loans:
            loan.release()  # after commit, releasing the loan drops its producer reference
        producer.flush()
        assert daemon.stat().live_objects == 0
        del loans, leases, loan, lease
    assert daemon.stat().live_objects == 0


def test_zero_size_tensor_round_trips_as_an_empty_array(daemon):
    empty = np.zeros((0, 4), dtype=np.float32)
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, Consumer(
        daemon.socket_path, timeout_s=TIMEOUT_S
    ) as consumer:
        handle = producer.put(empty, digest=True)
        assert handle.shape == (0, 4)
        lease = consumer.acquire(handle)
        problem = None
        try:  # no exception may escape while `lease` is alive (its traceback would pin the mapping)
            if lease.array.shape != (0, 4) or lease.array.dtype != np.float32:
                problem = f"got {lease.array.dtype}{lease.array.shape}"
            lease.verify()
        except Exception as exc:  # noqa: BLE001
            problem = repr(exc)
        lease.release()
        producer.release(handle)
        assert problem is None, problem


def test_zero_size_tensor_is_accepted_and_freed(daemon):
    """The part of the zero-size path that works today: put, acquire, release, bytes freed."""
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, Consumer(
        daemon.socket_path, timeout_s=TIMEOUT_S
    ) as consumer:
        handle = producer.put(np.zeros((0,), dtype=np.uint8))
        assert handle.shape == (0,)
        lease = consumer.acquire(handle)
        lease.release()
        producer.release(handle)
    assert daemon.stat().used_nbytes == 0


# -- when bytes are freed ------------------------------------------------------------------------
@ON_BOTH_PATHS
def test_bytes_are_freed_only_when_the_producer_and_every_lease_released(make_daemon, shared_table):
    daemon = make_daemon(share_object_table=shared_table)
    arr = np.ones(100_000, dtype=np.uint8)
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, Consumer(
        daemon.socket_path, timeout_s=TIMEOUT_S
    ) as c1, Consumer(daemon.socket_path, timeout_s=TIMEOUT_S) as c2:
        # producer first, then the leases one by one
        handle = producer.put(arr)
        l1, l2 = c1.acquire(handle), c2.acquire(handle)
        used = daemon.stat().used_nbytes
        assert used >= arr.nbytes
        producer.release(handle, wait=True)
        assert daemon.stat().used_nbytes == used and daemon.stat().live_objects == 1
        c1.release([l1], wait=True)
        assert daemon.stat().used_nbytes == used
        assert np.array_equal(l2.array, arr)  # still valid: one lease remains
        c2.release([l2], wait=True)
        s = daemon.stat()
        assert s.used_nbytes == 0 and s.live_objects == 0 and s.live_leases == 0

        # leases first, the producer last
        handle = producer.put(arr)
        l1 = c1.acquire(handle)
        c1.release([l1], wait=True)
        assert daemon.stat().live_objects == 1
        producer.release(handle, wait=True)
        assert daemon.stat().used_nbytes == 0
        del l1, l2


def test_an_expired_lease_of_a_live_client_is_quarantined_never_reused_until_released(make_daemon):
    """A lease past its TTL may still back a view: its bytes stay (reported), not reused under it.
    TTLs and quarantine apply to the leases the daemon holds: no object table (its leases have none)."""
    daemon = make_daemon(arena_nbytes=256 * KiB, share_object_table=False)
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S, alloc_wait_s=0) as producer, Consumer(
        daemon.socket_path, timeout_s=TIMEOUT_S
    ) as consumer:
        data = np.arange(4096, dtype=np.uint8)
        handle = producer.put(data)
        lease = consumer.acquire(handle, ttl_ms=100)
        view = lease.array
        producer.release(handle, wait=True)
        s = wait_stat(daemon, lambda s: s.quarantined_leases == 1, timeout_s=3, what="lease quarantined")
        assert s.live_leases == 1 and s.live_objects == 1 and s.quarantined_nbytes >= 4096
        assert s.reclaimed_ttl_leases == 0 and s.quarantined_leases_total == 1
        # Fill the arena: none of the new loans may land on the quarantined bytes.
        loans = []
        with pytest.raises(ResourceExhausted):
            while True:
                loans.append(producer.loan(4096))
                loans[-1].array[:] = 0xFF
        assert np.array_equal(view, data)
        for loan in loans:
            loan.release()
        del view
        consumer.release([lease], wait=True)  # a quarantined lease releases like any other
        s = wait_stat(daemon, lambda s: s.live_leases == 0 and s.used_nbytes == 0, timeout_s=3, what="released")
        assert s.quarantined_leases == 0


def _hold_past_ttl(conn, socket_path, handle_bytes):
    consumer = Consumer(socket_path, timeout_s=TIMEOUT_S)
    lease = consumer.acquire(Handle.from_bytes(handle_bytes), ttl_ms=50)
    conn.send(lease.lease_id)
    conn.recv()


def test_an_expired_lease_is_reclaimed_when_its_client_dies(make_daemon):
    daemon = make_daemon(share_object_table=False)  # TTLs apply to the leases the daemon holds: no object table
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer:
        handle = producer.put(np.arange(4096, dtype=np.uint8))
        with BlockingChild(_hold_past_ttl, daemon.socket_path, handle.to_bytes()) as child:
            child.recv()
            producer.release(handle, wait=True)
            wait_stat(daemon, lambda s: s.quarantined_leases == 1, timeout_s=3, what="lease quarantined")
            child.kill()
        s = wait_stat(daemon, lambda s: s.live_leases == 0 and s.used_nbytes == 0, timeout_s=5, what="reclaimed")
        assert s.quarantined_leases == 0 and s.reclaimed_death_leases == 1


@ON_BOTH_PATHS
def test_hold_ms_keeps_a_committed_object_alive_after_producer_release_until_it_expires(make_daemon, shared_table):
    daemon = make_daemon(share_object_table=shared_table)
    arr = np.arange(5000, dtype=np.int32)
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, Consumer(
        daemon.socket_path, timeout_s=TIMEOUT_S
    ) as consumer:
        handle = producer.put(arr, hold_ms=400)
        producer.release(handle, wait=True)  # hand-off: the producer lets go right away
        assert daemon.stat().live_objects == 1
        with consumer.acquire(handle) as lease:  # still acquirable inside the hold
            assert np.array_equal(lease.array, arr)
        consumer.flush()
        assert daemon.stat().live_objects == 1  # lease gone, hold still running
        wait_stat(daemon, lambda s: s.live_objects == 0 and s.used_nbytes == 0, timeout_s=3, what="hold expired")
        with pytest.raises(HandleError) as info:
            consumer.acquire(handle)
        assert info.value.reason is Reason.STALE_HANDLE


# -- death of clients ----------------------------------------------------------------------------
@ON_BOTH_PATHS
def test_producer_killed_between_loan_and_commit_gets_its_loan_reclaimed(make_daemon, shared_table):
    daemon = make_daemon(share_object_table=shared_table)
    before = daemon.stat()
    with BlockingChild(child_loan_and_block, daemon.socket_path, 1 * MiB) as child:
        handle = Handle.from_bytes(child.recv(timeout_s=60))
        s = daemon.stat()
        assert s.used_nbytes >= 1 * MiB and s.live_objects == 1
        assert child.kill() == -9
        s = wait_stat(daemon, lambda s: s.used_nbytes == 0, timeout_s=5, what="loan reclaimed")
    assert s.live_objects == 0
    assert s.reclaimed_death_nbytes - before.reclaimed_death_nbytes == 1 * MiB
    with Consumer(daemon.socket_path, timeout_s=TIMEOUT_S) as consumer:
        with pytest.raises(HandleError) as info:
            consumer.acquire(handle)
        assert info.value.reason is Reason.STALE_HANDLE


@ON_BOTH_PATHS
def test_producer_killed_after_commit_leaves_its_object_until_the_handoff_window_reclaims_it(make_daemon, shared_table):
    daemon = make_daemon(share_object_table=shared_table, handoff_window_ms=HANDOFF_WINDOW_MS)
    arr = np.arange(300_000, dtype=np.uint8)
    with BlockingChild(child_put_and_block, daemon.socket_path, arr) as child:
        child.recv(timeout_s=60)
        assert daemon.stat().live_objects == 1
        child.kill()
        s = wait_stat(daemon, lambda s: not s.clients, timeout_s=5, what="producer session gone")
    # Handed off: nobody acquired it yet, so it outlives its producer (a consumer may still come).
    assert s.live_objects == 1 and s.used_nbytes >= arr.nbytes and s.reclaimed_death_nbytes == 0
    assert s.handoff_objects == s.table_objects  # the table (if any) counts it as waiting
    s = wait_stat(daemon, lambda s: s.used_nbytes == 0, timeout_s=HANDOFF_WINDOW_MS / 1000 + 5,
                  what="hand-off window passed")
    assert s.live_objects == 0 and s.handoff_objects == 0
    assert (s.reclaimed_handoff_objects, s.reclaimed_handoff_nbytes) == (1, arr.nbytes)
    assert s.reclaimed_death_nbytes == 0


@ON_BOTH_PATHS
def test_producer_death_does_not_pull_bytes_from_under_a_live_lease(make_daemon, shared_table):
    daemon = make_daemon(share_object_table=shared_table)
    arr = np.random.default_rng(3).integers(0, 255, size=200_000, dtype=np.uint8)
    with Consumer(daemon.socket_path, timeout_s=TIMEOUT_S) as consumer:
        with BlockingChild(child_put_and_block, daemon.socket_path, arr) as child:
            handle = Handle.from_bytes(child.recv(timeout_s=60))
            lease = consumer.acquire(handle)
            child.kill()
            wait_stat(daemon, lambda s: len(s.clients) == 1, what="producer session gone")
        s = daemon.stat()
        assert s.live_objects == 1 and s.live_leases == 1
        assert np.array_equal(lease.array, arr)
        lease.verify()
        consumer.release([lease], wait=True)
        assert daemon.stat().used_nbytes == 0


@ON_BOTH_PATHS
def test_consumer_killed_while_holding_leases_gets_them_reclaimed_and_the_producer_reuses_the_bytes(
    make_daemon, shared_table
):
    daemon = make_daemon(arena_nbytes=4 * MiB, share_object_table=shared_table)
    arrays = [np.full(MiB, i, dtype=np.uint8) for i in range(4)]  # the whole arena
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S, alloc_wait_s=0) as producer:
        handles = producer.put_many(arrays)
        with BlockingChild(child_acquire_and_block, daemon.socket_path, [h.to_bytes() for h in handles]) as child:
            lease_ids = child.recv(timeout_s=60)
            assert len(lease_ids) == len(arrays)
            producer.release(handles, wait=True)
            s = daemon.stat()
            assert s.live_leases == 4 and s.live_objects == 4  # the leases keep the bytes
            with pytest.raises(ResourceExhausted) as info:  # ... from this producer too
                producer.put(arrays[0])
            assert info.value.reason is Reason.ARENA_FULL
            del info
            child.kill()
            s = wait_stat(daemon, lambda s: s.live_leases == 0 and s.used_nbytes == 0, what="leases reclaimed")
        assert s.reclaimed_death_leases == 4
        assert s.reclaimed_death_nbytes == sum(a.nbytes for a in arrays)
        # The dead consumer's holds are gone (in the table: its bit cleared), so the producer gets
        # the bytes back without waiting.
        producer.release(producer.put_many(arrays), wait=True)
    assert daemon.stat().used_nbytes == 0


def test_eight_concurrent_client_processes_read_back_exactly_what_was_written(daemon):
    rng = np.random.default_rng(42)
    shared_arrays = [rng.standard_normal(5000 + 1000 * i).astype(np.float32) for i in range(4)]
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer:
        shared_handles = producer.put_many(shared_arrays, digest=True)
        shared = [(h.to_bytes(), a) for h, a in zip(shared_handles, shared_arrays)]
        checked = start_children(
            child_mixed_workload, [(daemon.socket_path, seed, shared, 30) for seed in range(8)], timeout_s=90
        )
        assert all(n > 0 for n in checked), checked
        s = daemon.stat()
        assert s.live_leases == 0 and s.live_objects == len(shared_arrays)
        assert s.sessions_total >= 1 + 2 * 8
        producer.release(shared_handles)
    assert daemon.stat().used_nbytes == 0


# -- running out ---------------------------------------------------------------------------------
@ON_BOTH_PATHS
def test_full_arena_raises_arena_full_then_recovers_after_releases(make_daemon, shared_table):
    daemon = make_daemon(arena_nbytes=8 * MiB, share_object_table=shared_table)
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S, alloc_wait_s=0) as p1, Producer(
        daemon.socket_path, timeout_s=TIMEOUT_S, alloc_wait_s=0
    ) as p2:
        held = []
        with pytest.raises(ResourceExhausted) as info:
            for i in range(100):
                held.append((p1 if i % 2 else p2).put(np.full(MiB, i, dtype=np.uint8)))
        assert info.value.reason is Reason.ARENA_FULL
        assert 6 <= len(held) <= 8
        s = daemon.stat()
        assert s.allocation_failures >= 1
        used = s.used_nbytes
        # All or nothing: a batch that does not fit takes nothing.
        with pytest.raises(ResourceExhausted):
            p1.loan_many([(MiB, None, None)] * 3)
        assert daemon.stat().used_nbytes == used
        # Releasing makes room again, for either producer: p1's bytes go back to the arena at once
        # (no table), or once p1 gives back the grants they emptied (in the background).
        mine = [h for i, h in enumerate(held) if i % 2]
        p1.release(mine, wait=True)
        wait_stat(daemon, lambda s: s.free_nbytes >= MiB, what="p1's released bytes back in the arena")
        h = p2.put(np.full(MiB, 1, dtype=np.uint8))
        p2.release([h] + [h for i, h in enumerate(held) if not i % 2], wait=True)
    assert daemon.stat().used_nbytes == 0


@ON_BOTH_PATHS
def test_loan_on_a_full_arena_waits_for_space_freed_by_another_client(make_daemon, shared_table):
    daemon = make_daemon(arena_nbytes=4 * MiB, share_object_table=shared_table)
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S, alloc_wait_s=0) as hog, Producer(
        daemon.socket_path, timeout_s=TIMEOUT_S, alloc_wait_s=5.0
    ) as patient:
        held = hog.put_many([np.zeros(MiB, dtype=np.uint8)] * 4)
        assert daemon.stat().free_nbytes == 0
        timer = threading.Timer(0.2, lambda: hog.release(held[:1], wait=True))
        timer.start()
        try:
            handle = patient.put(np.ones(MiB, dtype=np.uint8))  # back-pressure, then success
        finally:
            timer.join(TIMEOUT_S)
        assert daemon.stat().allocation_failures == 0  # back-pressure is not a refusal
        patient.release(handle, wait=True)
        hog.release(held[1:], wait=True)
    assert daemon.stat().used_nbytes == 0


@ON_BOTH_PATHS
def test_a_producer_waiting_on_a_full_arena_gets_the_space_its_own_consumer_releases(make_daemon, shared_table):
    """Back-pressure with one producer. In the object table its consumer's release never reaches
    the daemon: the waiting producer must find the bytes in its own grants."""
    daemon = make_daemon(arena_nbytes=256 * KiB, share_object_table=shared_table)
    size = 64 * KiB  # a standard grant of this arena: one object each, the grants fill the arena
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S, alloc_wait_s=5.0) as producer, Consumer(
        daemon.socket_path, timeout_s=TIMEOUT_S
    ) as consumer:
        handles = producer.put_many([np.full(size, i, dtype=np.uint8) for i in range(4)])
        leases = consumer.acquire_many(handles)
        producer.release(handles, wait=True)  # only the consumer holds the bytes now
        assert daemon.stat().free_nbytes == 0
        timer = threading.Timer(0.2, consumer.release, (leases[:1],), {"wait": True})
        timer.start()
        try:
            handle = producer.put(np.ones(size, dtype=np.uint8))  # back-pressure, then success
        finally:
            timer.join(TIMEOUT_S)
        assert handle.shm.offset == handles[0].shm.offset  # the bytes the consumer released
        consumer.release(leases[1:], wait=True)
        producer.release(handle, wait=True)
        del leases
    assert daemon.stat().used_nbytes == 0


@ON_BOTH_PATHS
def test_the_byte_quota_belongs_to_the_tenant_so_more_sessions_do_not_evade_it(make_daemon, shared_table):
    # 1 MiB objects are larger than this arena's standard grant: in the object table each gets a
    # grant of exactly its size, so two of them hold the quota on both paths.
    daemon = make_daemon(arena_nbytes=8 * MiB, quota_nbytes=2 * MiB, share_object_table=shared_table)
    producers = [Producer(daemon.socket_path, timeout_s=TIMEOUT_S, alloc_wait_s=0) for _ in range(4)]
    try:
        a = producers[0].loan(MiB)
        b = producers[1].loan(MiB)
        for producer in producers:  # every further session of the tenant meets the same quota
            with pytest.raises(ResourceExhausted) as info:
                producer.loan(1)
            assert info.value.reason is Reason.QUOTA_EXCEEDED
        a.release()
        producers[0].flush()
        # a's bytes leave the quota at once (no table), or producer 0 gives back its emptied
        # grant when the daemon recalls it for the next producer (within 0.1 s): that one waits
        producers[3].alloc_wait_s = TIMEOUT_S
        d = producers[3].loan(256 * KiB)  # room again after a release
        for loan in (b, d):
            loan.release()
        del a, b, d, loan, info
    finally:
        for producer in producers:
            producer.close()


def test_the_lease_quota_belongs_to_the_tenant_and_recovers(make_daemon):
    daemon = make_daemon(quota_leases=2, share_object_table=False)  # the quota bounds the leases the daemon holds
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, Consumer(
        daemon.socket_path, timeout_s=TIMEOUT_S
    ) as consumer, Consumer(daemon.socket_path, timeout_s=TIMEOUT_S) as other:
        handle = producer.put(np.zeros(10, dtype=np.uint8))
        leases = consumer.acquire_many([handle, handle])
        for client in (consumer, other):
            with pytest.raises(ResourceExhausted) as info:
                client.acquire(handle)
            assert info.value.reason is Reason.QUOTA_EXCEEDED
        with pytest.raises(ResourceExhausted):
            consumer.acquire_many([handle] * 3)
        consumer.release(leases[:1], wait=True)
        leases[1:1] = [other.acquire(handle)]
        consumer.release(leases[2:])
        other.release(leases[1:2])
        producer.release(handle)
        del leases, info


# -- views and leases ----------------------------------------------------------------------------
def test_released_lease_array_raises_closed_error(daemon):
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, Consumer(
        daemon.socket_path, timeout_s=TIMEOUT_S
    ) as consumer:
        handle = producer.put(np.arange(10))
        lease = consumer.acquire(handle)
        lease.release()
        assert lease.closed
        with pytest.raises(ClosedError) as info:
            _ = lease.array
        assert info.value.reason is Reason.VIEW_RELEASED
        with pytest.raises(ClosedError):
            lease.tensor()
        lease.release()  # idempotent
        producer.release(handle)
        del info


def test_release_with_a_live_view_is_deferred_until_the_view_is_dropped(daemon):
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, Consumer(
        daemon.socket_path, timeout_s=TIMEOUT_S
    ) as consumer:
        handle = producer.put(np.arange(1000, dtype=np.int64))
        lease = consumer.acquire(handle)
        producer.release(handle, wait=True)
        view = lease.array
        consumer.release([lease], wait=True)
        with pytest.raises(ClosedError):
            _ = lease.array
        consumer.stat()
        s = daemon.stat()
        assert s.live_leases == 1 and s.live_objects == 1  # the bytes cannot be reused under `view`
        assert view[10:20].tolist() == list(range(10, 20))
        del view
        consumer.stat()  # the next client call (or the client's release timer) sends it
        wait_stat(daemon, lambda s: s.live_leases == 0 and s.used_nbytes == 0, timeout_s=2, what="deferred release")


def test_release_with_a_live_derived_view_is_deferred_until_the_view_is_dropped(daemon):
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, Consumer(
        daemon.socket_path, timeout_s=TIMEOUT_S
    ) as consumer:
        handle = producer.put(np.arange(1000, dtype=np.int64))
        lease = consumer.acquire(handle)
        producer.release(handle)
        view = lease.array[10:20]
        consumer.release([lease], wait=True)
        consumer.stat()
        s = daemon.stat()
        # What goes wrong otherwise: the same bytes are handed out again and change under `view`.
        again = producer.put(np.full(1000, -1, dtype=np.int64))
        seen = view.tolist()
        producer.release(again, wait=True)
        del view
        consumer.stat()
        assert s.live_leases == 1 and s.live_objects == 1, "lease released under a live derived view"
        assert seen == list(range(10, 20)), f"bytes changed under a live view: {seen}"


def test_lease_verify_passes_on_intact_bytes_and_raises_identity_mismatch_on_a_flipped_byte(daemon):
    arr = np.arange(50_000, dtype=np.float32)
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, Consumer(
        daemon.socket_path, timeout_s=TIMEOUT_S
    ) as consumer:
        handle = producer.put(arr, digest=True)
        with consumer.acquire(handle) as lease:
            lease.verify()
            # Corrupt one byte behind everyone's back, straight through the daemon's fd of the arena.
            path = daemon.tenants[0].segment.open_path
            fd = os.open(path, os.O_RDWR)
            try:
                pos = handle.shm.offset + 123_457
                (old,) = os.pread(fd, 1, pos)
                os.pwrite(fd, bytes([old ^ 0x01]), pos)
            finally:
                os.close(fd)
            with pytest.raises(IdentityMismatch) as info:
                lease.verify()
            assert info.value.reason is Reason.IDENTITY_MISMATCH
        producer.release(handle)
        del info


def test_lease_object_outliving_its_consumer_does_not_leak_the_mapping(daemon):
    from shmtransport import arena

    segment = daemon.segment_names[0]

    def mapped_fds():
        return {fd for fd, target in open_fds().items() if segment in target}

    daemon_fds = mapped_fds()  # the in-process daemon's own fd of its segment
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer:
        handle = producer.put(np.arange(10))
        consumer = Consumer(daemon.socket_path, timeout_s=TIMEOUT_S)
        with consumer.acquire(handle) as lease:
            assert lease.array.sum() == 45
        consumer.close()
        producer.release(handle, wait=True)
    try:
        gc.collect()
        assert mapped_fds() == daemon_fds, "client mapping still open after close and after the lease was dropped"
        assert arena.mappings_of(segment) == []
    finally:
        for mapping in arena.mappings_of(segment):  # undo the leak for the next tests
            mapping.close()


def test_acquires_waiting_for_a_missing_commit_do_not_stall_other_clients(make_daemon):
    daemon = make_daemon(commit_wait_s=1.5, share_object_table=False)  # in the table an Acquire never waits
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, Consumer(
        daemon.socket_path, timeout_s=TIMEOUT_S
    ) as waiting, Consumer(daemon.socket_path, timeout_s=TIMEOUT_S) as other:
        loan = producer.loan(4096)  # never committed
        handle = loan.handle
        errors = []

        def acquire_uncommitted():
            try:
                waiting.acquire(handle)
            except StateError as exc:
                errors.append(exc.reason)

        threads = [threading.Thread(target=acquire_uncommitted) for _ in range(daemon.config.grpc_workers)]
        for t in threads:
            t.start()
        # A tenant's calls wait in at most half the daemon's handler threads; the rest fail at once.
        waiting_acquires = daemon.config.grpc_workers // 2 // len(daemon.tenants)
        wait_until(lambda: daemon.stat().waiting_calls >= waiting_acquires, timeout_s=5,
                   what="the acquires waiting in the daemon")
        other.stat()  # served while they wait...
        assert daemon.stat().waiting_calls >= waiting_acquires  # ...not after they gave up
        for t in threads:
            t.join(TIMEOUT_S)
        loan.release()
        del loan
        assert errors == [Reason.WRONG_STATE] * len(threads)


def test_a_commit_by_handoff_wakes_acquires_waiting_for_that_loan(make_daemon):
    """Our client commits by RPC now, but the daemon still accepts a loan's commit token from the
    wire (no object table: tokens are the registry's): an Acquire presenting it commits the loan
    and wakes the Acquires waiting for that commit."""
    daemon = make_daemon(commit_wait_s=5.0, share_object_table=False)
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, Consumer(
        daemon.socket_path, timeout_s=TIMEOUT_S
    ) as waiting, Consumer(daemon.socket_path, timeout_s=TIMEOUT_S) as holder:
        loaned = producer._conn.call("Loan", pb.LoanRequest(nbytes=[4096]))  # the raw reply has the token
        uncommitted = Handle(loaned.handles[0], "uint8", (4096,))
        done = []

        def acquire_without_token():
            with waiting.acquire(uncommitted):  # no commit token: waits for someone to commit
                done.append(time.monotonic())

        t = threading.Thread(target=acquire_without_token)
        t.start()
        wait_until(lambda: daemon.stat().waiting_calls == 1, timeout_s=5, what="the acquire waiting for a commit")
        handle = Handle(loaned.handles[0], "uint8", (4096,), commit_token=loaned.commit_tokens[0])
        committed_at = time.monotonic()
        with holder.acquire(handle):  # commit by handoff: the token travels with the handle
            t.join(TIMEOUT_S)
        assert done and done[0] - committed_at < 1.0, "the waiting acquire slept through the handoff commit"
        producer.release(uncommitted, wait=True)
