"""Space granted to producers for the object table: kept while idle for a while, given back when
the daemon recalls it for another producer (so space one producer holds idle is space the others
wait for only briefly) and once idle long, never taken by the daemon on the strength of a word a
client wrote. (Grants need the C kernels; without them loans go through
the daemon.)
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from shmtransport import objtable
from shmtransport.client import Producer, table
from shmtransport.errors import Reason, ResourceExhausted
from shmtransport.testing import BlockingChild, wait_until

pytestmark = pytest.mark.skipif(not objtable.available(), reason="grants need the C kernels")

MiB = 1 << 20
TIMEOUT_S = 30


def _given_back(daemon) -> bool:
    s = daemon.stat()
    return s.used_nbytes == s.granted_nbytes == 0 and s.free_nbytes == s.arena.nbytes


def test_a_producer_keeps_its_empty_grant_and_gives_it_back_once_idle(make_daemon, monkeypatch):
    monkeypatch.setattr(table, "IDLE_GIVE_BACK_S", 0.5)  # (5 s)
    daemon = make_daemon(arena_nbytes=8 * MiB)
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer:
        calls: list[str] = []
        real_call = producer._conn.call
        producer._conn.call = lambda method, request, reconnect=True: (
            calls.append(method), real_call(method, request, reconnect))[1]
        producer.release(producer.put(np.ones(MiB, np.uint8)))
        producer.release(producer.put(np.ones(MiB, np.uint8)))  # the same grant: no new one
        assert calls.count("Grant") == 1 and daemon.stat().granted_nbytes > 0
        wait_until(lambda: _given_back(daemon), timeout_s=5, what="the idle producer's grant given back")
        producer.release(producer.put(np.ones(MiB, np.uint8)))  # a fresh grant after idleness
        assert calls.count("Grant") >= 2


@pytest.mark.parametrize("nbytes", [64 * 1024, 3 * MiB], ids=["standard-grant", "large-grant"])
def test_the_daemon_recalls_empty_grants_for_a_producer_that_needs_the_room(make_daemon, nbytes):
    """Grants are kept while idle (5 s), but another producer that needs their room waits only for
    the daemon's recall (their producer's next look, 0.1 s), here less than the idle period."""
    daemon = make_daemon(arena_nbytes=4 * MiB)
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S, alloc_wait_s=2) as first, \
            Producer(daemon.socket_path, timeout_s=TIMEOUT_S, alloc_wait_s=2) as second:
        first.release(first.put(np.ones(nbytes, np.uint8)))
        assert daemon.stat().granted_nbytes > 0  # kept, empty
        loan = second.loan(4 * MiB)  # the whole arena: first's grant back on recall
        loan.release()
        data = np.arange(nbytes, dtype=np.uint8)
        handle = first.put(data)  # and second's, the same way
        first.release(handle)


def test_grants_go_back_at_close_and_the_arena_is_whole_again(make_daemon):
    daemon = make_daemon(arena_nbytes=8 * MiB)
    producer = Producer(daemon.socket_path, timeout_s=TIMEOUT_S)
    producer.release(producer.put(np.ones(MiB, np.uint8)))
    producer.close()
    assert _given_back(daemon)


def _write_into_slots(conn, socket_path: str) -> None:
    """A producer session of the same tenant (it may write the slots): on request, write a word
    into a slot's seventh field (a grant's state word, when grants had one)."""
    with Producer(socket_path, timeout_s=TIMEOUT_S) as producer:
        conn.send("ready")
        slot, word = conn.recv()
        columns = producer._conn.table.columns
        columns[columns.dtype.names[6]][slot] = np.uint64(word)
        conn.send("written")
        conn.recv()


def test_a_word_another_producer_writes_into_a_grant_makes_the_daemon_take_nothing(make_daemon):
    """It once could: a producer rewrote another's grant word to PARKED, and the daemon gave that
    busy grant's bytes to a third producer while its owner went on placing objects there. Now the
    daemon takes a grant only when its producer gives it back (a Grant call) or its session ends."""
    daemon = make_daemon(arena_nbytes=4 * MiB)
    with BlockingChild(_write_into_slots, daemon.socket_path) as attacker, \
            Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as owner, \
            Producer(daemon.socket_path, timeout_s=TIMEOUT_S, alloc_wait_s=0) as other:
        assert attacker.recv(timeout_s=60) == "ready"
        first = owner.put(np.ones(4096, np.uint8))
        grant_id = owner._table_client()._grants[0].grant_id
        owner.release(first)  # its grant is empty now, and still its own
        attacker.send((first.shm.slot - 1, grant_id << 2 | 1))  # the old (id, PARKED) word
        assert attacker.recv(timeout_s=60) == "written"
        with pytest.raises(ResourceExhausted) as refused:
            other.loan(4 * MiB)  # needs the owner's grant
        assert refused.value.reason is Reason.ARENA_FULL
        owner.release(owner.put(np.arange(4096, dtype=np.uint8)))  # in its own grant, as before
        attacker.send("exit")


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
