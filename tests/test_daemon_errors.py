"""Every way a client can get a call wrong is refused with a typed error and a reason, and the
daemon keeps serving everyone else (it never crashes and never hands out someone else's bytes).

Each test runs on both object paths: a daemon with its default object table (under the C backend
loans are placed in the producer's grants and leases taken in shared memory) and one without
(``share_object_table=False``: every object goes through the daemon's RPC registry). Tests whose subject is
the RPC registry itself run on that path only (``RPC_PATH``)."""
from __future__ import annotations

import grpc
import numpy as np
import pytest

from shmtransport.client import Consumer, Handle, Producer
from shmtransport.errors import (
    ClosedError,
    HandleError,
    InvalidArgument,
    OwnershipError,
    PermissionDenied,
    Reason,
    StateError,
    Unavailable,
    error_from_rpc,
)
from shmtransport.testing import wait_until
from shmtransport.v1 import daemon_pb2 as pb
from shmtransport.v1 import daemon_pb2_grpc as pb_grpc
from shmtransport.wire import GRPC_OPTIONS, SESSION_METADATA_KEY, framed

TIMEOUT_S = 10.0
ARRAY = np.arange(1000, dtype=np.float32)


def assert_still_serves(daemon) -> None:
    """A good put → acquire → verify → release round trip on fresh clients."""
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, Consumer(
        daemon.socket_path, timeout_s=TIMEOUT_S
    ) as consumer:
        handle = producer.put(ARRAY, digest=True)
        lease = consumer.acquire(handle)
        lease.verify()
        assert np.array_equal(lease.array, ARRAY)
        consumer.release([lease], wait=True)
        producer.release(handle, wait=True)


@pytest.fixture(params=[True, False], ids=["default_table", "no_table"])
def shared_table(request):
    """Whether the daemon hands its object table to clients (its default), or not (every object
    through the daemon)."""
    return request.param


# For tests of the daemon's RPC registry (Loan/Commit/Acquire/Release RPCs, lease ids and TTLs):
# a daemon without an object table, so they test it under both backends.
RPC_PATH = pytest.mark.parametrize("shared_table", [False], ids=["no_table"])


@pytest.fixture
def served(make_daemon, shared_table):
    """The daemon, checked after the test to still serve a good request."""
    daemon = make_daemon(share_object_table=shared_table)
    yield daemon
    assert_still_serves(daemon)


@pytest.fixture
def producer(served):
    with Producer(served.socket_path, timeout_s=TIMEOUT_S) as p:
        yield p


@pytest.fixture
def consumer(served):
    with Consumer(served.socket_path, timeout_s=TIMEOUT_S) as c:
        yield c


def forged(handle: Handle, **fields) -> Handle:
    """A copy of ``handle`` with some daemon-handle fields replaced."""
    shm = pb.Handle()
    shm.CopyFrom(handle.shm)
    for name, value in fields.items():
        setattr(shm, name, value)
    shape = (shm.nbytes,) if "nbytes" in fields else handle.shape
    dtype = "uint8" if "nbytes" in fields else handle.dtype
    return Handle(shm, dtype, shape, digest=handle.digest)


def raise_reason(excinfo, cls, reason: Reason) -> None:
    assert type(excinfo.value) is cls, repr(excinfo.value)
    assert excinfo.value.reason is reason, repr(excinfo.value)


# -- bad handles ---------------------------------------------------------------------------------
def test_forged_generation_is_refused_as_bad_handle(producer, consumer):
    handle = producer.put(ARRAY)
    with pytest.raises(HandleError) as info:
        consumer.acquire(forged(handle, generation=handle.shm.generation + (1 << 40)))
    raise_reason(info, HandleError, Reason.BAD_HANDLE)
    producer.release(handle, wait=True)


def test_handle_to_an_offset_where_nothing_lives_is_refused_as_bad_handle(producer, consumer):
    handle = producer.put(ARRAY)
    with pytest.raises(HandleError) as info:
        consumer.acquire(forged(handle, offset=handle.shm.offset + (1 << 20), generation=0))
    raise_reason(info, HandleError, Reason.BAD_HANDLE)
    producer.release(handle, wait=True)


def test_stale_handle_after_free_is_refused(producer, consumer):
    handle = producer.put(ARRAY)
    producer.release(handle, wait=True)
    with pytest.raises(HandleError) as info:
        consumer.acquire(handle)
    raise_reason(info, HandleError, Reason.STALE_HANDLE)


def put_in_the_place_of(producer, old: Handle, array: np.ndarray) -> Handle:
    """``array`` put where ``old`` was (its bytes, and its object-table slot if it had one): a
    producer reuses its grant's slots in FIFO order, so this cycles once through them."""
    new = producer.put(array)
    for _ in range(1 << 16):
        if new.shm.slot == old.shm.slot:
            return new
        producer.release(new, wait=True)
        new = producer.put(array)
    pytest.fail(f"slot {old.shm.slot} was never reused")


def test_old_handle_to_reallocated_bytes_is_refused_as_stale_never_aliased(producer, consumer):
    old = producer.put(np.full(1000, 1.0, dtype=np.float32))
    producer.release(old, wait=True)
    new = put_in_the_place_of(producer, old, np.full(1000, 2.0, dtype=np.float32))
    assert new.shm.offset == old.shm.offset and new.shm.nbytes == old.shm.nbytes  # same bytes (ABA)
    assert new.shm.generation != old.shm.generation
    with pytest.raises(HandleError) as info:
        consumer.acquire(old)
    raise_reason(info, HandleError, Reason.STALE_HANDLE)
    with pytest.raises(HandleError) as info:
        producer.release(old, wait=True)  # nor can the old handle drop the new object's reference
    raise_reason(info, HandleError, Reason.STALE_HANDLE)
    lease = consumer.acquire(new)
    assert float(lease.array[0]) == 2.0
    consumer.release([lease], wait=True)
    producer.release(new, wait=True)


def test_handle_beyond_the_arena_is_refused_as_out_of_bounds(served, producer, consumer):
    handle = producer.put(ARRAY)
    arena_nbytes = served.stat().arena.nbytes
    with pytest.raises(HandleError) as info:
        consumer.acquire(forged(handle, offset=arena_nbytes - 64, nbytes=128))
    raise_reason(info, HandleError, Reason.OUT_OF_BOUNDS)
    with pytest.raises(HandleError) as info:
        consumer.acquire(forged(handle, offset=(1 << 64) - 1, nbytes=1))  # would wrap a 64-bit sum
    raise_reason(info, HandleError, Reason.OUT_OF_BOUNDS)
    producer.release(handle, wait=True)


def test_handle_whose_nbytes_differs_from_the_allocation_is_refused_as_out_of_bounds(producer, consumer):
    handle = producer.put(ARRAY)
    with pytest.raises(HandleError) as info:  # claims more bytes than were allocated
        consumer.acquire(forged(handle, nbytes=handle.nbytes + 4096))
    raise_reason(info, HandleError, Reason.OUT_OF_BOUNDS)
    with pytest.raises(HandleError) as info:  # and fewer
        consumer.acquire(forged(handle, nbytes=handle.nbytes - 4))
    raise_reason(info, HandleError, Reason.OUT_OF_BOUNDS)
    with pytest.raises(HandleError) as info:  # a producer reference cannot be dropped through it either
        producer.release(forged(handle, nbytes=0), wait=True)
    raise_reason(info, HandleError, Reason.OUT_OF_BOUNDS)
    producer.release(handle, wait=True)


def test_the_daemons_second_hold_of_an_object_checks_the_bytes_the_handle_names(served, producer, consumer):
    """The daemon's Acquire (as clients without a holder bit use it) of an object it already holds
    for someone: a handle with that object's slot and generation but other bytes is refused."""
    first, second = producer.put(ARRAY), producer.put(ARRAY)
    [lease_id] = consumer._call("Acquire", pb.AcquireRequest(handles=[second.shm])).lease_ids
    for field, value in (("offset", first.shm.offset), ("nbytes", second.nbytes + 4096)):
        with pytest.raises(HandleError) as info:
            consumer._call("Acquire", pb.AcquireRequest(handles=[forged(second, **{field: value}).shm]))
        assert info.value.reason in (Reason.OUT_OF_BOUNDS, Reason.STALE_HANDLE), (field, info.value)
    assert served.stat().live_leases == 1
    consumer._call("Release", pb.ReleaseRequest(lease_ids=[lease_id]))
    producer.release([first, second], wait=True)


def test_handle_whose_manifest_does_not_match_its_nbytes_is_refused_before_any_call(producer, consumer):
    handle = producer.put(ARRAY)
    lying = Handle(handle.shm, "float64", handle.shape)  # 8000 bytes claimed, 4000 allocated
    with pytest.raises(InvalidArgument) as info:
        consumer.acquire(lying)
    raise_reason(info, InvalidArgument, Reason.INVALID_ARGUMENT)
    producer.release(handle, wait=True)


def test_handle_naming_another_segment_is_refused_as_bad_handle(producer, consumer):
    handle = producer.put(ARRAY)
    with pytest.raises(HandleError) as info:
        consumer.acquire(forged(handle, name="shmttnope-000000000000-arena"))
    raise_reason(info, HandleError, Reason.BAD_HANDLE)
    producer.release(handle, wait=True)


def test_handle_of_another_daemon_instance_is_refused_with_instance_mismatch(producer, consumer):
    handle = producer.put(ARRAY)
    foreign = forged(handle, instance_id="000000000000")
    with pytest.raises(Unavailable) as info:  # the consumer refuses it before mapping anything
        consumer.acquire(foreign)
    raise_reason(info, Unavailable, Reason.INSTANCE_MISMATCH)
    with pytest.raises(Unavailable) as info:  # the daemon refuses it too
        consumer._call("Acquire", pb.AcquireRequest(handles=[foreign.shm]))
    raise_reason(info, Unavailable, Reason.INSTANCE_MISMATCH)
    producer.release(handle, wait=True)


def test_a_foreign_instance_handle_does_not_cost_the_client_its_session(served, producer):
    mine = producer.put(ARRAY)
    foreign = forged(mine, instance_id="000000000000")
    with pytest.raises(Unavailable) as info:
        producer.release(foreign, wait=True)
    raise_reason(info, Unavailable, Reason.INSTANCE_MISMATCH)
    try:
        producer.release(mine, wait=True)  # still ours: the session must have survived
    except HandleError as exc:
        pytest.fail(f"the producer lost its object after a refused foreign handle: {exc!r}")


def test_unknown_lease_id_is_refused_as_bad_handle(consumer):
    with pytest.raises(HandleError) as info:
        consumer._call("Release", pb.ReleaseRequest(lease_ids=[10**12]))
    raise_reason(info, HandleError, Reason.BAD_HANDLE)


def test_garbage_handle_bytes_are_refused_as_invalid_argument():
    with pytest.raises(InvalidArgument) as info:
        Handle.from_bytes(b"garbage")
    raise_reason(info, InvalidArgument, Reason.INVALID_ARGUMENT)


# -- double release, ownership, state ------------------------------------------------------------
# A second Release RPC of a lease id (an object-table lease has none: it is released in shared memory).
@RPC_PATH
def test_double_release_of_a_lease_is_refused(producer, consumer):
    handle = producer.put(ARRAY)
    lease = consumer.acquire(handle)
    lease_id = lease.lease_id
    consumer.release([lease], wait=True)
    lease.release()  # the client-side object is idempotent ...
    with pytest.raises(StateError) as info:  # ... the daemon refuses a second release
        consumer._call("Release", pb.ReleaseRequest(lease_ids=[lease_id]))
    raise_reason(info, StateError, Reason.DOUBLE_RELEASE)
    producer.release(handle, wait=True)


def test_double_release_of_a_producer_handle_is_refused_while_the_object_lives(producer, consumer):
    handle = producer.put(ARRAY)
    lease = consumer.acquire(handle)  # keeps the object alive after the producer lets go
    producer.release(handle, wait=True)
    with pytest.raises(StateError) as info:
        producer.release(handle, wait=True)
    raise_reason(info, StateError, Reason.DOUBLE_RELEASE)
    lease.release()


def test_release_of_a_producer_handle_whose_bytes_were_freed_is_refused_as_stale(producer):
    handle = producer.put(ARRAY)
    producer.release(handle, wait=True)  # nothing else held it: freed
    with pytest.raises(HandleError) as info:
        producer.release(handle, wait=True)
    raise_reason(info, HandleError, Reason.STALE_HANDLE)


# Another client's lease id in a Release RPC (an object-table lease has no id to send).
@RPC_PATH
def test_release_of_another_clients_lease_is_refused_as_not_owner(served, producer, consumer):
    handle = producer.put(ARRAY)
    lease = consumer.acquire(handle)
    with Consumer(served.socket_path, timeout_s=TIMEOUT_S) as thief:
        with pytest.raises(OwnershipError) as info:
            thief._call("Release", pb.ReleaseRequest(lease_ids=[lease.lease_id]))
        raise_reason(info, OwnershipError, Reason.NOT_OWNER)
    assert served.stat().live_leases == 1
    lease.release()
    producer.release(handle, wait=True)
    del info


def test_a_refused_release_leaves_the_lease_usable_by_its_owner(served, producer, consumer):
    handle = producer.put(ARRAY)
    lease = consumer.acquire(handle)
    with Consumer(served.socket_path, timeout_s=TIMEOUT_S) as thief:
        with pytest.raises(OwnershipError):
            thief.release([lease], wait=True)
    usable = not lease.closed
    lease.release()
    consumer.flush()  # the owner's own release is accepted
    producer.release(handle, wait=True)
    assert usable, "the owner's lease was marked released by someone else's refused release"


def test_release_of_another_clients_handle_is_refused_as_not_owner(served, producer):
    handle = producer.put(ARRAY)
    with Producer(served.socket_path, timeout_s=TIMEOUT_S) as other:
        with pytest.raises(OwnershipError) as info:
            other.release(handle, wait=True)
        raise_reason(info, OwnershipError, Reason.NOT_OWNER)
    assert served.stat().live_objects == 1
    producer.release(handle, wait=True)


def test_commit_of_another_clients_loan_is_refused_as_not_owner(served, producer):
    loan = producer.loan(4096)
    with Producer(served.socket_path, timeout_s=TIMEOUT_S) as other:
        with pytest.raises(OwnershipError) as info:
            other.commit_many([loan], wait=True)
        raise_reason(info, OwnershipError, Reason.NOT_OWNER)
    loan.release()
    del loan


def test_acquire_of_an_uncommitted_loan_is_refused_as_wrong_state(make_daemon, shared_table):
    daemon = make_daemon(commit_wait_s=0.1, share_object_table=shared_table)
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, Consumer(
        daemon.socket_path, timeout_s=TIMEOUT_S
    ) as consumer:
        loan = producer.loan(4096)
        with pytest.raises(StateError) as info:
            consumer.acquire(loan.handle)
        raise_reason(info, StateError, Reason.WRONG_STATE)
        loan.release()
        del loan
    assert_still_serves(daemon)


def test_double_commit_is_refused_as_wrong_state(producer):
    loan = producer.loan(4096)
    loan.commit()
    with pytest.raises(StateError) as info:
        producer.commit_many([loan], wait=True)  # the client knows it committed already
    raise_reason(info, StateError, Reason.WRONG_STATE)
    loan.release()
    del loan


# A Commit RPC of a committed loan (object-table loans commit in shared memory).
@RPC_PATH
def test_double_commit_is_refused_by_the_daemon_as_wrong_state(producer):
    loan = producer.loan(4096)
    loan.commit(wait=True)
    with pytest.raises(StateError) as info:
        producer._call("Commit", pb.CommitRequest(handles=[loan.handle.shm]))
    raise_reason(info, StateError, Reason.WRONG_STATE)
    loan.release()
    del loan


def test_a_refused_pipelined_commit_raises_no_later_than_the_producers_next_release(producer):
    loan = producer.loan(4096)
    with pytest.raises(InvalidArgument) as info:
        # The hold exceeds the maximum. A Commit RPC is sent without waiting, and a release settles
        # the commits before it; a commit in the object table is refused at once.
        loan.commit(hold_ms=10**9)
        producer.release(loan.handle, wait=True)
    raise_reason(info, InvalidArgument, Reason.INVALID_ARGUMENT)
    loan.release()
    del loan


def test_a_forged_commit_token_is_refused_and_the_loan_stays_uncommitted(make_daemon):
    daemon = make_daemon(commit_wait_s=0.1, share_object_table=False)  # commit tokens are the RPC path's
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, Consumer(
        daemon.socket_path, timeout_s=TIMEOUT_S
    ) as consumer:
        loan = producer.loan(4096)
        forged = Handle(loan.handle.shm, loan.handle.dtype, loan.handle.shape, commit_token=b"x" * 16)
        with pytest.raises(HandleError) as info:
            consumer.acquire(forged)
        raise_reason(info, HandleError, Reason.BAD_HANDLE)
        with pytest.raises(StateError):
            consumer.acquire(loan.handle)  # still uncommitted: refused after the commit wait
        loan.release()
        del loan
    assert_still_serves(daemon)


def test_the_same_handle_twice_in_one_commit_is_refused_as_invalid_argument(producer):
    loan = producer.loan(4096)
    with pytest.raises(InvalidArgument) as info:
        producer.commit_many([loan, loan], wait=True)
    raise_reason(info, InvalidArgument, Reason.INVALID_ARGUMENT)
    assert not loan.committed, "a refused commit applied part of its batch"
    loan.release()
    del loan


# Lease ids of a Release RPC (object-table leases are released in shared memory).
@RPC_PATH
def test_the_same_lease_twice_in_one_release_is_refused_as_invalid_argument(producer, consumer):
    handle = producer.put(ARRAY)
    lease = consumer.acquire(handle)
    with pytest.raises(InvalidArgument) as info:
        consumer._call("Release", pb.ReleaseRequest(lease_ids=[lease.lease_id, lease.lease_id]))
    raise_reason(info, InvalidArgument, Reason.INVALID_ARGUMENT)
    lease.release()  # nothing was applied by the refused call
    producer.release(handle, wait=True)


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda p, c: p.put_many([]), id="put_many"),
        pytest.param(lambda p, c: p.loan_many([]), id="loan_many"),
        pytest.param(lambda p, c: p.commit_many([], wait=True), id="commit_many"),
        pytest.param(lambda p, c: p.release([], wait=True), id="producer_release"),
        pytest.param(lambda p, c: c.acquire_many([]), id="acquire_many"),
        pytest.param(lambda p, c: c._call("Release", pb.ReleaseRequest()), id="release_rpc"),
    ],
)
def test_empty_batch_is_refused_as_invalid_argument(producer, consumer, call):
    with pytest.raises(InvalidArgument) as info:
        call(producer, consumer)
    raise_reason(info, InvalidArgument, Reason.INVALID_ARGUMENT)


@pytest.mark.parametrize("kwargs", [
    pytest.param({}, id="nothing"),
    pytest.param({"shape": (4, 4)}, id="shape-without-dtype"),
    pytest.param({"nbytes": 16, "dtype": np.float32}, id="dtype-without-shape"),
    pytest.param({"nbytes": 8, "shape": (4,), "dtype": np.float32}, id="nbytes-not-the-shapes"),
])
def test_a_loan_spec_that_does_not_say_its_type_and_size_is_refused(producer, served, kwargs):
    with pytest.raises(InvalidArgument) as info:
        producer.loan(**kwargs)
    raise_reason(info, InvalidArgument, Reason.INVALID_ARGUMENT)
    assert served.stat().used_nbytes == 0  # refused before anything was loaned


# The limit bounds one daemon request; loans placed in the object table send none.
@RPC_PATH
def test_batch_above_the_limit_is_refused_as_invalid_argument(served, producer):
    with pytest.raises(InvalidArgument) as info:
        producer.loan_many([(1, None, None)] * 4097)
    raise_reason(info, InvalidArgument, Reason.INVALID_ARGUMENT)
    assert served.stat().used_nbytes == 0


# Object-table leases have no TTL: ttl_ms applies to the leases the daemon holds.
@RPC_PATH
def test_lease_ttl_above_the_maximum_is_refused_as_invalid_argument(served, producer, consumer):
    handle = producer.put(ARRAY)
    with pytest.raises(InvalidArgument) as info:
        consumer.acquire(handle, ttl_ms=served.config.max_lease_ttl_ms + 1)
    raise_reason(info, InvalidArgument, Reason.INVALID_ARGUMENT)
    producer.release(handle, wait=True)


def test_calls_on_a_closed_client_raise_closed_error(served):
    consumer = Consumer(served.socket_path, timeout_s=TIMEOUT_S)
    consumer.close()
    consumer.close()  # idempotent
    with pytest.raises(ClosedError) as info:
        consumer.stat()
    raise_reason(info, ClosedError, Reason.CLOSED)


# -- sessions and credentials --------------------------------------------------------------------
def _raw_stub_call(socket_path: str, metadata: tuple) -> list[tuple[grpc.StatusCode, Reason | None]]:
    channel = grpc.insecure_channel(f"unix:{socket_path}", options=GRPC_OPTIONS)
    try:
        stub = pb_grpc.DaemonStub(channel)
        codes = []
        for method, request in (("Stat", pb.StatRequest()), ("Loan", pb.LoanRequest(nbytes=[64]))):
            try:
                getattr(stub, method)(request, timeout=TIMEOUT_S, metadata=metadata)
            except grpc.RpcError as err:
                codes.append((err.code(), error_from_rpc(err).reason))
            else:
                codes.append((grpc.StatusCode.OK, None))
        return codes
    finally:
        channel.close()


def test_call_without_a_session_token_is_permission_denied(served):
    for code, reason in _raw_stub_call(served.socket_path, ()):
        assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, Reason.UNKNOWN_SESSION)
    assert served.stat().used_nbytes == 0


def test_call_with_a_forged_session_token_is_permission_denied(served):
    for code, reason in _raw_stub_call(served.socket_path, ((SESSION_METADATA_KEY, "0" * 32),)):
        assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, Reason.UNKNOWN_SESSION)
    assert served.stat().used_nbytes == 0


def test_uid_outside_the_allowlist_cannot_connect(make_daemon):
    daemon = make_daemon(allowed_uids=(12345,))
    with pytest.raises(PermissionDenied) as info:
        Consumer(daemon.socket_path, timeout_s=TIMEOUT_S)
    raise_reason(info, PermissionDenied, Reason.PERMISSION_DENIED)
    with pytest.raises(PermissionDenied):
        Producer(daemon.socket_path, timeout_s=TIMEOUT_S)
    s = daemon.stat()
    assert s.sessions_total == 0 and not s.clients
    # Still serving: the refusal did not stop the session listener (a second refusal above) and
    # gRPC still answers (without a session, as PERMISSION_DENIED).
    assert {code for code, _ in _raw_stub_call(daemon.socket_path, ())} == {grpc.StatusCode.PERMISSION_DENIED}


def test_a_client_gone_during_the_handshake_leaves_no_session_behind(served):
    import socket

    before = served.stat().sessions_total
    for i in range(20):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(TIMEOUT_S)
        sock.connect(served.socket_path + ".session")
        if i % 2:
            # asked for a session, gone before the hello
            sock.sendall(framed(pb.SessionRequest(access=pb.SESSION_ACCESS_READ_ONLY).SerializeToString()))
        sock.close()
    try:
        wait_until(lambda: served.stat().sessions_total >= before + 10, timeout_s=5, what="daemon saw the requests")
        wait_until(lambda: not served.stat().clients, timeout_s=2, what="no session left")
    except TimeoutError:
        pytest.fail(f"{len(served.stat().clients)} ghost sessions left by 20 aborted handshakes")
    with Consumer(served.socket_path, timeout_s=TIMEOUT_S) as consumer:  # and the daemon still serves
        assert consumer.stat().sessions_total >= before + 11
