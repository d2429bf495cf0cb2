"""The object table's fast lane (``ObjectTable.open_lane``, ``csrc/shmt_lane_py.c``): a producer
places an object and writes its handle's wire form in one call, a consumer acquires from that
wire form and counts its leases natively. Checked against the rest of the system: the wire form
against protobuf's own serialization, the counts against the table's holder bits, from many
threads at once, and a closed lane refusing with a typed error."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmtransport import objtable
from shmtransport.errors import HandleError, InvalidArgument, Reason, StateError, Unavailable
from shmtransport.objtable import HANDOFF, slot_index
from shmtransport.tensors import DTYPES

pytestmark = pytest.mark.skipif(not objtable.available(), reason="the table lane is part of the C kernels")

TIMEOUT_S = 10.0


def _holders(client, handle) -> int:
    return int(client._tables.table.holders[slot_index(handle.where.slot)])


def _bit(client) -> int:
    return 1 << client._tables.bit


def test_the_lane_module_says_the_same_closed_code_as_python() -> None:
    from shmtransport import _shmt_lane

    assert _shmt_lane.LANE_CLOSED == objtable.LANE_CLOSED


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from(sorted(DTYPES)),
       shape=st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple))
def test_the_wire_form_a_placed_loan_carries_is_protobufs_own(pair, dtype, shape) -> None:
    producer, consumer = pair
    loan = producer.loan(shape=shape, dtype=dtype)
    handle = loan.commit()
    assert handle._wire is not None  # written by the lane, with the placement
    assert handle.to_bytes() == handle.to_proto().SerializeToString()
    with consumer.acquire_bytes(handle.to_bytes()) as lease:
        assert lease.array.shape == shape and lease.array.dtype == DTYPES[dtype]
        assert lease.handle.where == handle.where
    producer.release(handle)


def test_a_placement_the_wire_form_cannot_carry_is_refused_with_nothing_placed(pair) -> None:
    producer, _ = pair
    producer.release(producer.put(np.ones(8, dtype=np.uint8)))  # a grant to place in
    tables = producer._tables
    grant = tables._grants[-1]
    free_slots = grant.space.free_slots
    for dtype, shape in ((b"uint8", (1,) * 33), (b"x" * 65, (4,))):
        with pytest.raises(InvalidArgument):
            tables.lane.place(grant.space.address, 4, 4, dtype, shape)
    assert grant.space.free_slots == free_slots


def test_leases_of_one_client_on_one_object_share_its_bit_until_the_last_release(pair) -> None:
    producer, consumer = pair
    handle = producer.put(np.arange(10, dtype=np.int32))
    data = handle.to_bytes()
    first = consumer.acquire_bytes(data)
    assert _holders(producer, handle) & _bit(consumer)
    assert not _holders(producer, handle) & HANDOFF  # the first acquire ended the hand-off
    second = consumer.acquire(handle)
    third = consumer.acquire_bytes(data)
    assert consumer._tables.lease_count == 3
    for lease, left in ((second, 2), (first, 1)):
        lease.release()
        assert consumer._tables.lease_count == left
        assert _holders(producer, handle) & _bit(consumer)
    third.release()
    assert consumer._tables.lease_count == 0
    assert not _holders(producer, handle) & _bit(consumer)
    with pytest.raises(StateError) as err:
        consumer._tables.release_lease(slot_index(handle.where.slot), handle.where.generation)
    assert err.value.reason is Reason.DOUBLE_RELEASE
    producer.release(handle)


def test_a_stale_wire_form_is_refused_with_nothing_taken(pair) -> None:
    producer, consumer = pair
    handle = producer.put(np.ones(64, dtype=np.uint8))
    data = handle.to_bytes()
    producer.release(handle)  # nobody held it: gone
    with pytest.raises(HandleError) as err:
        consumer.acquire_bytes(data)
    assert err.value.reason is Reason.STALE_HANDLE
    assert consumer._tables.lease_count == 0


def test_threads_acquiring_and_releasing_one_object_leave_exactly_nothing_held(pair) -> None:
    producer, consumer = pair
    handle = producer.put(np.arange(256, dtype=np.uint8))
    data = handle.to_bytes()
    keep = consumer.acquire_bytes(data)  # the object outlives the threads' leases
    errors: list[BaseException] = []
    start = threading.Barrier(4, timeout=TIMEOUT_S)

    def churn() -> None:
        try:
            start.wait()
            for _ in range(500):
                lease = consumer.acquire_bytes(data)
                assert lease.array[5] == 5
                lease.release()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    assert not errors and not any(thread.is_alive() for thread in threads)
    assert consumer._tables.lease_count == 1
    assert _holders(producer, handle) & _bit(consumer)
    keep.release()
    assert consumer._tables.lease_count == 0
    assert not _holders(producer, handle) & _bit(consumer)
    producer.release(handle)


def test_a_lane_whose_session_ended_refuses_every_call_as_unavailable(pair) -> None:
    producer, consumer = pair
    handle = producer.put(np.ones(8, dtype=np.uint8))
    data = handle.to_bytes()
    consumer.acquire_bytes(data).release()
    producer.release(handle)
    lanes = consumer._tables.lane, producer._tables.lane
    space = producer._tables._grants[-1].space.address
    consumer.close()
    producer.close()
    lane, placer = lanes
    for call in (lambda: lane.acquire_wire(data), lambda: lane.release(0, 1), lambda: lane.acquire(0, 1, 0, 8),
                 lane.release_all, lambda: placer.place(space, 8, 8, b"uint8", (8,)),
                 lambda: placer.commit(0, 1, 0, False), lambda: placer.release_own(space, 0, 1, True)):
        with pytest.raises(Unavailable):
            call()
    assert lane.lease_count() == 0


def test_the_lane_refuses_ids_longer_than_a_handle_carries(pair) -> None:
    _, consumer = pair
    tables = consumer._table_client()
    table = tables.table
    arena = tables.mapping.view(0, 4096)
    with pytest.raises(InvalidArgument):
        table.open_lane(tables.bit, ("x" * 256, "owner", "instance"), arena)
    with pytest.raises(TypeError):
        tables.lane.release("slot", 1)
    with pytest.raises(TypeError):
        tables.lane.acquire_wire("not bytes")  # type: ignore[arg-type]
    arena.release()
