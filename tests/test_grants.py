"""Space granted to producers for the object table: kept while busy, parked once idle, and taken
back by the daemon when another producer needs it, so space one producer holds idle is never
space the others wait for. (Grants need the C kernels; without them loans go through the daemon.)
"""
from __future__ import annotations

import mmap
import os
import socket
import threading
import urllib.request

import numpy as np
import pytest

from shmtransport import objtable
from shmtransport.client import Producer
from shmtransport.errors import Reason, ResourceExhausted
from shmtransport.objtable import GRANT_ACTIVE, GRANT_PARKED, GRANT_TAKEN, ObjectTable, grant_word
from shmtransport.testing import wait_until

pytestmark = pytest.mark.skipif(not objtable.available(), reason="grants need the C kernels")

MiB = 1 << 20
TIMEOUT_S = 30


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(f'{name}{{tenant="uid:{os.geteuid()}"}} '):
                return float(line.rpartition(" ")[2])
    raise KeyError(name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _parked_all(daemon) -> bool:
    s = daemon.stat()
    return s.used_nbytes == 0 and s.granted_nbytes > 0 and s.parked_nbytes == s.granted_nbytes


def test_an_idle_producers_grant_is_parked_and_reused_without_a_new_grant(make_daemon):
    daemon = make_daemon(arena_nbytes=8 * MiB)
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer:
        producer.release(producer.put(np.ones(MiB, np.uint8)))
        wait_until(lambda: _parked_all(daemon), timeout_s=5, what="the emptied grant parked")
        granted = daemon.stat().granted_nbytes
        handle = producer.put(np.ones(MiB, np.uint8))  # taken back from parking: no new grant
        s = daemon.stat()
        assert (s.granted_nbytes, s.parked_nbytes, s.parked_grants_taken) == (granted, 0, 0)
        producer.release(handle)


@pytest.mark.parametrize("nbytes", [64 * 1024, 3 * MiB], ids=["standard-grant", "large-grant"])
def test_the_daemon_takes_a_parked_grant_for_a_producer_that_needs_the_space(make_daemon, nbytes):
    port = _free_port()
    daemon = make_daemon(arena_nbytes=4 * MiB, metrics_port=port)
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as idle, \
            Producer(daemon.socket_path, timeout_s=TIMEOUT_S, alloc_wait_s=0) as busy:
        idle.release(idle.put(np.ones(nbytes, np.uint8)))
        wait_until(lambda: _parked_all(daemon), timeout_s=5, what="the idle producer's grant parked")
        assert _metric(port, "shmtransport_parked_nbytes") == daemon.stat().parked_nbytes > 0
        # The whole arena, at once (no waiting for the idle producer to give anything back).
        loan = busy.loan(4 * MiB)
        assert daemon.stat().parked_grants_taken == 1
        assert _metric(port, "shmtransport_parked_grants_taken_total") == 1
        loan.release()
        busy.flush()
        # The idle producer finds its grant gone and gets a fresh one, from the busy one's parked.
        wait_until(lambda: _parked_all(daemon), timeout_s=5, what="the busy producer's grant parked")
        data = np.arange(nbytes, dtype=np.uint8)
        handle = idle.put(data)
        assert daemon.stat().parked_grants_taken == 2
        idle.release(handle)


def test_a_parked_grant_goes_back_at_close_and_the_arena_is_whole_again(make_daemon):
    daemon = make_daemon(arena_nbytes=8 * MiB)
    producer = Producer(daemon.socket_path, timeout_s=TIMEOUT_S)
    producer.release(producer.put(np.ones(MiB, np.uint8)))
    wait_until(lambda: _parked_all(daemon), timeout_s=5, what="the grant parked")
    producer.close()
    s = daemon.stat()
    assert (s.granted_nbytes, s.parked_nbytes, s.free_nbytes) == (0, 0, s.arena.nbytes)


def test_a_full_table_is_back_pressure_then_a_typed_error(make_daemon):
    """64 slots (the smallest table) bound the tenant's live objects: with every slot holding
    one, a put waits for a slot (another producer's objects dying) instead of failing, and one
    that cannot wait is refused with TABLE_FULL."""
    daemon = make_daemon(arena_nbytes=16 * MiB, object_slots=64)
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as first, \
            Producer(daemon.socket_path, timeout_s=TIMEOUT_S, alloc_wait_s=0) as impatient, \
            Producer(daemon.socket_path, timeout_s=TIMEOUT_S, alloc_wait_s=TIMEOUT_S) as patient:
        handles = [first.put(np.full(4096, i, np.uint8)) for i in range(64)]
        assert daemon.stat().live_objects == 64
        with pytest.raises(ResourceExhausted) as refused:
            impatient.put(np.zeros(4096, np.uint8))
        assert refused.value.reason is Reason.TABLE_FULL
        waited: list[object] = []
        putter = threading.Thread(target=lambda: waited.append(patient.put(np.full(4096, 7, np.uint8))))
        putter.start()
        wait_until(lambda: daemon.stat().waiting_calls >= 1, what="the put waiting for a slot")
        assert not waited
        first.release(handles, wait=True)
        first.close()  # its grant goes back once its objects are dead
        putter.join(TIMEOUT_S)
        assert len(waited) == 1
        patient.release(waited[0], wait=True)
    wait_until(lambda: daemon.stat().live_objects == 0, what="every object freed")


def test_many_tiny_objects_get_denser_grants_instead_of_filling_the_arena_with_empty_ones(make_daemon):
    """A grant first carries one slot per 4 KiB; 64-byte objects would leave its bytes idle and fill
    the arena with grants. Denser grants hold as many tiny objects as the table has slots."""
    daemon = make_daemon(arena_nbytes=64 * MiB)
    count = 16_000  # of the table's 16,384 slots
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S, alloc_wait_s=0) as producer:
        handles = []
        for start in range(0, count, 4000):
            handles += producer.put_many([np.full(64, i % 251, np.uint8)
                                          for i in range(start, min(count, start + 4000))])
        s = daemon.stat()
        assert s.live_objects == s.table_objects == count and s.allocation_failures == 0
        assert s.granted_nbytes < 16 * MiB  # dense grants: most of the arena was never granted
        producer.release(handles)
    wait_until(lambda: daemon.stat().live_objects == 0, what="every object freed")


# -- the grant word itself ------------------------------------------------------------------------
def _table(nslots: int = 64) -> tuple[mmap.mmap, ObjectTable]:
    """One anonymous mapping holding the slots, then the holds."""
    nbytes = objtable.table_nbytes(nslots)
    memory = mmap.mmap(-1, 2 * nbytes)
    return memory, ObjectTable(memoryview(memory)[:nbytes], memoryview(memory)[nbytes:], nslots)


def test_a_stale_grant_word_never_matches_a_later_grant_of_the_same_slots():
    memory, table = _table()
    try:
        table.set_grant_word(0, grant_word(7, GRANT_ACTIVE))
        assert table.grant_cas(0, grant_word(7, GRANT_ACTIVE), grant_word(7, GRANT_PARKED))
        assert table.grant_cas(0, grant_word(7, GRANT_PARKED), grant_word(7, GRANT_TAKEN))  # the daemon
        table.set_grant_word(0, grant_word(8, GRANT_ACTIVE))  # the slots' next grant, parked by its producer
        assert table.grant_cas(0, grant_word(8, GRANT_ACTIVE), grant_word(8, GRANT_PARKED))
        # Grant 7's producer, late, tries to take its grant back: refused, grant 8 is untouched.
        assert not table.grant_cas(0, grant_word(7, GRANT_PARKED), grant_word(7, GRANT_ACTIVE))
        assert int(table.columns["grant_state"][0]) == grant_word(8, GRANT_PARKED)
        # The object kernels leave the word alone.
        generation = table.publish(0, 0, 4096, 1)
        table.release(0, generation, 1)
        assert int(table.columns["grant_state"][0]) == grant_word(8, GRANT_PARKED)
    finally:
        table.close()
        memory.close()


def test_a_producer_unparking_and_the_daemon_taking_never_both_win():
    """One thread parks and unparks as a producer does, another takes as the daemon does: once
    the daemon won, the producer's next unpark fails, and before that every unpark won."""
    memory, table = _table()
    parked, active, taken = (grant_word(3, s) for s in (GRANT_PARKED, GRANT_ACTIVE, GRANT_TAKEN))
    table.set_grant_word(0, active)
    stop = threading.Event()
    producer_lost = threading.Event()
    broken: list[str] = []

    def producer() -> None:
        while not stop.is_set():
            if not table.grant_cas(0, active, parked):  # only the producer leaves ACTIVE
                broken.append("park from ACTIVE failed")
                return
            if not table.grant_cas(0, parked, active):
                producer_lost.set()
                return

    thread = threading.Thread(target=producer)
    thread.start()
    try:
        wait_until(lambda: table.grant_cas(0, parked, taken), timeout_s=10, interval_s=0, what="the daemon's take")
        thread.join(10)
        assert not broken
        assert producer_lost.is_set() and int(table.columns["grant_state"][0]) == taken
    finally:
        stop.set()
        thread.join(10)
        table.close()
        memory.close()


def test_a_placement_never_reaches_the_daemon_before_the_grant_returns_it_depends_on(make_daemon, monkeypatch):
    # The background thread gives back this producer's spare grants; a placement on another thread
    # needs their space. Were the return sent outside the lock, the placement's Grant could reach
    # the daemon first and be refused ARENA_FULL with the arena this producer's own (CI, once).
    daemon = make_daemon(arena_nbytes=4 * MiB)
    arrays = [np.full(MiB, i, dtype=np.uint8) for i in range(4)]  # one large grant each: the arena
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S, alloc_wait_s=0) as producer:
        handles = producer.put_many(arrays)
        returning, proceed, placement_sent = threading.Event(), threading.Event(), threading.Event()
        placer: list[threading.Thread] = []
        real_call = producer._conn.call

        def call(method, request, reconnect=True):
            if method == "Grant" and request.give_back and not request.nbytes:  # the background's return
                returning.set()
                assert proceed.wait(TIMEOUT_S)
            elif method == "Grant" and placer and threading.current_thread() is placer[0]:
                placement_sent.set()
            return real_call(method, request, reconnect)

        monkeypatch.setattr(producer._conn, "call", call)
        producer.release(handles, wait=True)  # three of the four grants are queued for return
        assert returning.wait(TIMEOUT_S)
        outcome: list[object] = []
        placer.append(threading.Thread(target=lambda: outcome.append(_put_or_error(producer, arrays))))
        placer[0].start()
        try:
            assert not placement_sent.wait(0.5), "the placement's Grant went out before the returns"
        finally:
            proceed.set()
        placer[0].join(TIMEOUT_S)
        assert len(outcome) == 1 and not isinstance(outcome[0], Exception), outcome
        producer.release(outcome[0])


def _put_or_error(producer: Producer, arrays: list[np.ndarray]) -> object:
    try:
        return producer.put_many(arrays)
    except Exception as exc:  # reported to the test's thread
        return exc
