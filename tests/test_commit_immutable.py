"""Committed bytes are immutable in the producer too.

- ``loan.array`` kept past commit is read-only: a write raises ValueError (any size).
- Any other view kept past commit (a slice made before, ``loan.tensor()``) writes to pages that
  commit made read-only in the producer: the write faults (SIGSEGV) instead of changing what a
  consumer leased, and the consumer's bytes and digest are unchanged.
- A range committed and freed is writable again when it is loaned again; ``put`` (no view of the
  bytes survives it) protects nothing.
Both placements: the producer's own grants (object table) and the daemon's RPC path.
"""
from __future__ import annotations

import mmap
import signal

import numpy as np
import pytest

from shmtransport import arena
from shmtransport.client import Consumer, Handle, Producer
from shmtransport.testing import BlockingChild, ChildError

TIMEOUT_S = 10.0
NBYTES = 1 << 20


@pytest.fixture(params=["table", "rpc"])
def daemon(request, make_daemon):
    return make_daemon() if request.param == "table" else make_daemon(share_object_table=False)


def _write_after_commit(conn, socket_path: str, how: str) -> None:
    with Producer(socket_path, timeout_s=TIMEOUT_S) as producer:
        loan = producer.loan(shape=(NBYTES,), dtype=np.uint8)
        arr = loan.array
        arr[:] = 1
        tail = arr[mmap.PAGESIZE:]  # views made before the commit
        tensor = loan.tensor()
        handle = loan.commit(digest=True)
        try:
            arr[:] = 2
        except ValueError as exc:
            conn.send(("refused", str(exc), handle.to_bytes()))
        conn.recv()  # the consumer holds it now
        if how == "numpy":
            tail[:] = 2
        else:
            tensor.add_(1)
        conn.send("wrote")  # not reached: the write faults
        conn.recv()


@pytest.mark.parametrize("how", ["numpy", "torch"])
def test_a_write_through_a_view_kept_past_commit_faults_and_the_consumer_sees_the_committed_bytes(daemon, how):
    with BlockingChild(_write_after_commit, daemon.socket_path, how) as child, \
            Consumer(daemon.socket_path, timeout_s=TIMEOUT_S) as consumer:
        refused, message, handle_bytes = child.recv(timeout_s=TIMEOUT_S)
        assert "read-only" in message
        with consumer.acquire(Handle.from_bytes(handle_bytes)) as lease:
            child.send("write")
            with pytest.raises(ChildError, match="died"):
                child.recv(timeout_s=TIMEOUT_S)
            assert child.process.exitcode == -signal.SIGSEGV
            lease.verify()
            assert np.all(lease.array == 1)


def _protected_ranges(producer: Producer) -> int:
    return len(producer.arena_view().obj._protected_starts or [])


def _loan_commit_release_cycles(conn, socket_path: str, cycles: int) -> dict:
    kept, offsets = [], set()
    with Producer(socket_path, timeout_s=TIMEOUT_S) as producer:
        for i in range(cycles):
            loan = producer.loan(shape=(NBYTES,), dtype=np.uint8)
            offsets.add(loan.handle.shm.offset)
            view = loan.array.reshape(-1)  # kept past commit: the pages get protected
            view[:] = i  # faults if a freed, protected range were loaned again read-only
            kept.append(view)
            handle = loan.commit()
            producer.release(handle, wait=True)  # nobody holds it: freed for the next loan
        after_loans = _protected_ranges(producer)
        for _ in range(cycles):
            handle = producer.put(np.full(NBYTES, 3, np.uint8))  # put keeps no view
            producer.release(handle, wait=True)
        after_puts = _protected_ranges(producer)
    return {"distinct_offsets": len(offsets), "after_loans": after_loans, "after_puts": after_puts}


def test_a_freed_range_is_writable_again_when_loaned_again(daemon):
    with BlockingChild(_loan_commit_release_cycles, daemon.socket_path, 8) as child:
        result = child.finish(timeout_s=60)
    assert result["distinct_offsets"] < 8, result  # ranges were loaned again (and written) after protection
    assert 1 <= result["after_loans"] <= result["distinct_offsets"], result
    assert result["after_puts"] <= result["after_loans"], result  # put protected nothing new


def test_protect_covers_whole_pages_only_and_unprotect_lifts_what_meets_a_loan():
    segment = arena._SharedMap(-1, 8 * mmap.PAGESIZE)
    try:
        with memoryview(segment) as whole:
            inside = whole[100: 3 * mmap.PAGESIZE + 100]  # pages 1 and 2 whole; 0 and 3 partial
            assert arena.protect(inside)
            assert segment._protected_starts == [arena._address(whole[mmap.PAGESIZE:])]
            assert not arena.protect(whole[10: mmap.PAGESIZE - 10])  # no whole page: nothing to protect
            whole[0] = 1  # the partial pages stay writable
            whole[3 * mmap.PAGESIZE + 200] = 1
            arena.unprotect(whole[5 * mmap.PAGESIZE:])  # does not meet it
            assert len(segment._protected_starts) == 1
            arena.unprotect(whole[2 * mmap.PAGESIZE + 5: 2 * mmap.PAGESIZE + 6])  # meets it: all of it lifted
            assert segment._protected_starts == []
            whole[mmap.PAGESIZE: 3 * mmap.PAGESIZE] = b"\x07" * (2 * mmap.PAGESIZE)
            del inside
    finally:
        segment.close()
