"""Fuzzing every daemon RPC handler and handle resolution through a raw gRPC channel that carries a
valid session token: random protobuf bytes and random field values (forged names, offsets,
generations, sizes, object-table slots, lease ids, commit tokens, grants, piggybacked releases).

Invariants, per input: the answer is OK or a typed status (``<reason>: ...`` with the reason's own
code; never ``internal``, which is an unexpected exception in a handler) - bytes that do not even
parse as the request message may get gRPC's own refusal; an OK Loan names bytes inside the arena of
the requested size; an OK Grant names arena bytes and table slots that exist; an OK Acquire names
live allocations (or object-table slots, then held with the daemon's proxy bit) of the right
generation, offset and size; the daemon still answers Stat after every input and serves a good
round trip at the end; another session's objects, of the RPC registry or the object table, are
never committed, released or freed by the fuzzing session.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import socket

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmtransport.client import Consumer, Handle, Producer
from shmtransport.errors import REASON_KEY, Reason, ShmTransportError, status_for
from shmtransport.objtable import COMMITTED, HELD, LOANED, OUTSIDE_ARENA, PROXY_BIT
from shmtransport.v1 import daemon_pb2 as pb
from shmtransport.wire import GRPC_OPTIONS, SESSION_METADATA_KEY, frame_payload, framed

TIMEOUT_S = 5.0
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "120"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize="FUZZ_EXAMPLES" not in os.environ,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])
CORPUS = pathlib.Path(__file__).parent / "fuzz_corpus" / "rpc"
ARENA = 1 << 20
# Objects committed by sessions that then close are handed off: short, so that they are gone by teardown.
HANDOFF_WINDOW_MS = 100
REQUESTS = {"Info": pb.InfoRequest, "Loan": pb.LoanRequest, "Grant": pb.GrantRequest, "Commit": pb.CommitRequest,
            "Acquire": pb.AcquireRequest, "Release": pb.ReleaseRequest, "Stat": pb.StatRequest}
RESPONSES = {"Info": pb.ArenaInfo, "Loan": pb.LoanResponse, "Grant": pb.GrantResponse, "Commit": pb.CommitResponse,
             "Acquire": pb.AcquireResponse, "Release": pb.ReleaseResponse, "Stat": pb.StatResponse}
U64 = (1 << 64) - 1
U32 = (1 << 32) - 1


class RawSession:
    """The session handshake done by hand, and raw-bytes unary calls with its token."""

    def __init__(self, socket_path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(TIMEOUT_S)
        self.sock.connect(socket_path + ".session")
        self.sock.sendall(framed(pb.SessionRequest(access=pb.SESSION_ACCESS_READ_WRITE).SerializeToString()))
        data, fds = b"", []
        while (payload := frame_payload(data, 65536)) is None:
            chunk, new_fds, _, _ = socket.recv_fds(self.sock, 65536, 2)
            assert chunk, "the daemon closed the session socket during the handshake"
            data += chunk
            fds += new_fds
        for fd in fds:  # the arena's and the table's fds: these calls never touch their bytes
            os.close(fd)
        self.hello = pb.SessionReply.FromString(payload).hello
        self.channel = grpc.insecure_channel(f"unix:{socket_path}", options=GRPC_OPTIONS)
        self.metadata = ((SESSION_METADATA_KEY, self.hello.token),)

    def raw(self, method: str, payload: bytes) -> tuple[grpc.StatusCode, tuple[str, str], bytes | None]:
        """(code, refusal, body); a refusal is the reason its trailing metadata carries and its message."""
        call = self.channel.unary_unary(f"/shmtransport.v1.Daemon/{method}")  # bytes in, bytes out
        try:
            return grpc.StatusCode.OK, ("", ""), call(payload, timeout=TIMEOUT_S, metadata=self.metadata)
        except grpc.RpcError as err:
            carried = dict(err.trailing_metadata() or ())
            return err.code(), (carried.get(REASON_KEY, ""), err.details() or ""), None

    def call(self, method: str, request):
        code, details, body = self.raw(method, request.SerializeToString())
        if code is not grpc.StatusCode.OK:
            raise AssertionError(f"{method} failed: {code} {details}")
        return RESPONSES[method].FromString(body)

    def close(self) -> None:
        self.channel.close()
        self.sock.close()


def check_answer(daemon, method: str, payload: bytes, code, details: tuple[str, str], body) -> str:
    """The per-input invariant; returns the verdict (``ok`` or the reason)."""
    try:
        request = REQUESTS[method].FromString(payload)
    except Exception:  # noqa: BLE001 - protobuf's DecodeError: gRPC itself refuses the bytes
        assert code is not grpc.StatusCode.OK or method in ("Info", "Stat"), (method, code)
        return "unparsable"
    if code is not grpc.StatusCode.OK:
        try:
            reason = Reason(details[0])
        except ValueError:
            raise AssertionError(f"{method}: untyped refusal {code} {details!r}") from None
        assert reason is not Reason.INTERNAL, f"{method}: handler raised an unexpected exception: {details!r}"
        assert status_for(ShmTransportError("", reason))[0] == code, (reason, code)  # the reason's own code
        return reason.value
    response = RESPONSES[method].FromString(body)
    registry = daemon.registry
    if method == "Loan":
        assert len(response.handles) == len(request.nbytes) == len(response.commit_tokens)
        for h, n in zip(response.handles, request.nbytes):
            assert h.nbytes == n >= 1
            if h.name == daemon.segment_names[0]:
                assert h.offset + h.nbytes <= ARENA, f"a loan outside the arena: {h}"
    elif method == "Grant":
        if response.grant_id:
            assert response.nbytes >= request.nbytes and response.offset + response.nbytes <= ARENA, response
            assert response.nslots >= 1  # as asked, or the longest run of free slots
            assert response.first_slot + response.nslots <= registry.objects.nslots
    elif method == "Acquire":
        assert len(response.lease_ids) == len(request.handles)
        for h in request.handles:
            # Held with the daemon's proxy bit: the slot holds exactly this object.
            slot = registry.objects.table.columns[h.slot - 1].copy()  # no view of the mapping left behind
            holders = int(registry.objects.table.holders[h.slot - 1])
            assert (slot["generation"], slot["nbytes"]) == (h.generation, h.nbytes), h
            assert slot["state"] in (COMMITTED, HELD) and holders >> PROXY_BIT & 1
            if h.name == daemon.segment_names[0]:
                assert slot["offset"] == h.offset and h.offset + h.nbytes <= ARENA, h
            else:  # a dedicated segment's
                assert slot["offset"] == OUTSIDE_ARENA and h.offset == 0, h
    return "ok"


@pytest.fixture(scope="module", autouse=True)
def _grpc_deserialization_state():
    """The first request gRPC's server cannot deserialize opens one process-wide poller pair
    (eventpoll + eventfd) that stays for the life of the process (measured: the same 2 fds after 1
    or 50 such requests): create it before the per-test fd check takes its snapshot."""
    from shmtransport import testing

    testing.warm_up_process_state()
    daemon = testing.start_daemon(arena_nbytes=1 << 20)
    try:
        session = RawSession(daemon.socket_path)
        session.raw("Loan", b"\xff\xff")
        session.close()
    finally:
        testing.stop_daemon(daemon)
    testing.daemons.keep_alive(daemon)
    yield


@pytest.fixture
def fuzz_daemon(make_daemon):
    daemon = make_daemon(arena_nbytes=ARENA, max_alloc_wait_ms=20, commit_wait_s=0.02, quota_leases=1000,
                         handoff_window_ms=HANDOFF_WINDOW_MS)
    yield daemon
    # still serving: a good round trip on fresh clients, bytes verified
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as p, Consumer(daemon.socket_path, timeout_s=TIMEOUT_S) as c:
        h = p.put(np.arange(1000, dtype=np.float32), digest=True)
        lease = c.acquire(h)
        lease.verify()
        c.release([lease], wait=True)
        p.release(h, wait=True)


def assert_untouched(daemon, loan: pb.Handle, committed: pb.Handle, owner_bit: int | None) -> None:
    """The victim's loan is still its uncommitted loan, and its committed object still holds its
    producer reference: its bit in the object table, or (``owner_bit`` None: objects the daemon
    placed for it) the daemon's proxy bit and the daemon's record of that reference."""
    table = daemon.registry.objects.table.columns.copy()  # no view of the mapping left behind
    holders = daemon.registry.objects.table.holders.copy()
    bit = PROXY_BIT if owner_bit is None else owner_bit
    for h in (loan, committed):
        slot = table[h.slot - 1]
        assert slot["generation"] == h.generation, f"victim's object in slot {h.slot} was freed"
        assert int(holders[h.slot - 1]) >> bit & 1, f"victim's reference in slot {h.slot} was released"
    assert table[loan.slot - 1]["state"] == LOANED, "victim's loan was committed by someone else"
    if owner_bit is None:
        listed = {obj.slot: obj for obj in daemon.registry.list_objects().objects}
        assert listed[committed.slot].producer_held, "victim's producer reference was released by someone else"


@dataclasses.dataclass
class Sessions:
    attacker: RawSession
    seeds: list  # handles of the victims' objects and of the attacker's own
    tokens: list  # commit tokens of the RPC loans among them
    table_seeds: list  # the object-table victim's (of the registry under the pure-Python backend)


@pytest.fixture
def sessions(fuzz_daemon):
    """The attacker and what it may forge from: a raw victim session holds a loan and a committed
    object of the RPC registry, a Producer a loan and a committed object of the object table
    (under the C backend; of the registry otherwise)."""
    attacker, victim = RawSession(fuzz_daemon.socket_path), RawSession(fuzz_daemon.socket_path)
    table_victim = Producer(fuzz_daemon.socket_path, timeout_s=TIMEOUT_S)
    loaned = victim.call("Loan", pb.LoanRequest(nbytes=[4096, 64]))
    victim.call("Commit", pb.CommitRequest(handles=[loaned.handles[1]]))
    table_loan = table_victim.loan(4096)
    table_committed = table_victim.put(np.arange(16, dtype=np.uint8))
    own = attacker.call("Loan", pb.LoanRequest(nbytes=[100, 65536, 1]))
    attacker.call("Commit", pb.CommitRequest(handles=[own.handles[0]]))
    table_seeds = [table_loan.handle.shm, table_committed.shm]
    yield Sessions(attacker, list(loaned.handles) + list(own.handles) + table_seeds,
                   list(own.commit_tokens) + list(loaned.commit_tokens), table_seeds)
    # the victims' objects were neither committed, released nor freed by the attacker
    assert_untouched(fuzz_daemon, *loaned.handles, None)
    assert_untouched(fuzz_daemon, table_loan.handle.shm, table_committed.shm, table_victim._conn.holder_bit)
    attacker.close()
    victim.close()
    table_loan.release()
    table_victim.release(table_committed)
    table_victim.close()


def _handles(seeds):
    def mutate(seed: pb.Handle, **changes) -> pb.Handle:
        h = pb.Handle()
        h.CopyFrom(seed)
        for k, v in changes.items():
            setattr(h, k, v)
        return h

    seed = st.sampled_from(seeds)
    return st.one_of(
        seed,
        st.builds(lambda s, g: mutate(s, generation=g), seed, st.one_of(st.integers(0, 64), st.just(U64))),
        st.builds(lambda s, o: mutate(s, offset=o), seed,
                  st.one_of(st.integers(0, ARENA + 1), st.just(U64), st.just(U64 - 63), st.integers(0, 64))),
        st.builds(lambda s, n: mutate(s, nbytes=n), seed,
                  st.one_of(st.integers(0, ARENA + 1), st.just(U64), st.just(U64 - 99))),
        st.builds(lambda s, n: mutate(s, name=n), seed,
                  st.one_of(st.text(max_size=40), st.just("../../etc/passwd"), st.just("x"))),
        st.builds(lambda s, i: mutate(s, instance_id=i), seed, st.text(max_size=14)),
        st.builds(lambda s, o: mutate(s, owner_id=o), seed, st.text(max_size=16)),
        st.builds(lambda s, i: mutate(s, slot=i), seed, st.one_of(st.integers(0, 70), st.just(U32))),
        st.builds(pb.Handle, name=st.text(max_size=8), offset=st.integers(0, U64), nbytes=st.integers(0, U64),
                  owner_id=st.text(max_size=8), generation=st.integers(0, U64), instance_id=st.text(max_size=8),
                  slot=st.integers(0, U32)),
    )


def _release(seeds):
    return st.builds(lambda hs, ls: pb.ReleaseRequest(handles=hs, lease_ids=ls),
                     st.lists(_handles(seeds), max_size=3), st.lists(st.integers(0, U64), max_size=3))


def _requests(seeds, tokens):
    rel = st.one_of(st.none(), _release(seeds))

    def with_release(msg, r):
        if r is not None:
            msg.release.CopyFrom(r)
        return msg

    return st.one_of(
        st.tuples(st.just("Loan"), st.builds(
            lambda n, w, r: with_release(pb.LoanRequest(nbytes=n, wait_ms=w), r),
            st.lists(st.one_of(st.integers(0, 70000), st.integers(0, U64), st.just(ARENA), st.just(ARENA + 1)),
                     max_size=4), st.integers(0, 30), rel)),
        st.tuples(st.just("Grant"), st.builds(
            lambda n, s, w, back: pb.GrantRequest(nbytes=n, nslots=s, wait_ms=w, give_back=back),
            st.one_of(st.integers(0, ARENA + 1), st.just(U64)), st.one_of(st.integers(0, 200), st.just(U32)),
            st.integers(0, 30), st.lists(st.one_of(st.integers(0, 8), st.just(U64)), max_size=3))),
        st.tuples(st.just("Commit"), st.builds(
            lambda hs, hold, r: with_release(pb.CommitRequest(handles=hs, hold_ms=hold), r),
            st.lists(_handles(seeds), max_size=3), st.one_of(st.integers(0, 50), st.just(U32)), rel)),
        st.tuples(st.just("Acquire"), st.builds(
            lambda hs, ttl, tk, r: with_release(pb.AcquireRequest(handles=hs, ttl_ms=ttl, commit_tokens=tk), r),
            st.lists(_handles(seeds), max_size=3), st.one_of(st.integers(0, 100), st.just(U32)),
            st.lists(st.one_of(st.sampled_from(tokens), st.binary(max_size=20), st.just(b"")), max_size=3), rel)),
        st.tuples(st.just("Release"), _release(seeds)),
        st.tuples(st.just("Stat"), st.just(pb.StatRequest())),
        st.tuples(st.just("Info"), st.just(pb.InfoRequest())),
    )


def test_random_field_values_in_every_rpc_get_typed_answers_and_never_touch_another_sessions_objects(
        fuzz_daemon, sessions):
    attacker = sessions.attacker
    verdicts: dict = {}

    @FUZZ
    @given(_requests(sessions.seeds, sessions.tokens))
    def run(case):
        method, request = case
        payload = request.SerializeToString()
        code, details, body = attacker.raw(method, payload)
        verdict = check_answer(fuzz_daemon, method, payload, code, details, body)
        verdicts[(method, verdict)] = verdicts.get((method, verdict), 0) + 1
        assert attacker.raw("Stat", b"")[0] is grpc.StatusCode.OK, "the daemon stopped answering"

    run()
    assert any(v == "ok" for _, v in verdicts), verdicts  # the fuzzer reached the success paths too
    assert any(v != "ok" for _, v in verdicts), verdicts
    # The leases the fuzzer took stay the attacker's until it goes: past their TTL they are
    # quarantined (its views could still read them), not freed.
    attacker.close()


def test_mutated_object_table_handles_in_the_daemons_acquire_get_typed_answers_or_exactly_their_object(
        fuzz_daemon, sessions):
    """The daemon's proxy path, as clients without a holder bit take it: Acquire of the table
    victim's handles with one field forged, from a session that never mapped the table."""
    attacker = sessions.attacker
    verdicts = set()

    @FUZZ
    @given(_handles(sessions.table_seeds))
    def run(handle):
        payload = pb.AcquireRequest(handles=[handle]).SerializeToString()
        code, details, body = attacker.raw("Acquire", payload)
        verdicts.add(check_answer(fuzz_daemon, "Acquire", payload, code, details, body))
        if code is grpc.StatusCode.OK:
            lease_ids = pb.AcquireResponse.FromString(body).lease_ids
            attacker.call("Release", pb.ReleaseRequest(lease_ids=lease_ids))
        assert attacker.raw("Stat", b"")[0] is grpc.StatusCode.OK, "the daemon stopped answering"

    run()
    assert "ok" in verdicts and len(verdicts) > 1, verdicts  # it reached both the holds and the refusals


def test_random_protobuf_bytes_to_every_rpc_get_typed_answers_or_a_grpc_refusal(fuzz_daemon, sessions):
    attacker = sessions.attacker

    @FUZZ
    @given(st.sampled_from(sorted(REQUESTS)), st.binary(max_size=200))
    def run(method, payload):
        code, details, body = attacker.raw(method, payload)
        check_answer(fuzz_daemon, method, payload, code, details, body)
        assert attacker.raw("Stat", b"")[0] is grpc.StatusCode.OK

    run()


def test_forged_handles_through_the_client_give_typed_errors_or_exactly_the_named_bytes(fuzz_daemon):
    """Handle resolution end to end: Consumer.acquire of a forged handle (in the object table, under
    the C backend) and the daemon's Acquire of it (for a slot handle its proxy hold, as clients
    without a holder bit get it) raise a typed error, or (when the forgery happens to name a live
    committed object exactly) return that object's bytes."""
    with Producer(fuzz_daemon.socket_path, timeout_s=TIMEOUT_S) as p, \
            Consumer(fuzz_daemon.socket_path, timeout_s=TIMEOUT_S) as c:
        arrays = [np.full(n, i + 1, np.uint8) for i, n in enumerate((1, 100, 4096, 70000))]
        real = p.put_many(arrays, digest=True)
        content = {(h.shm.slot, h.shm.offset, h.shm.generation): a for h, a in zip(real, arrays)}

        def acquire_through_the_daemon(shm: pb.Handle) -> np.ndarray:
            [lease_id] = c._call("Acquire", pb.AcquireRequest(handles=[shm])).lease_ids
            try:
                return np.array(np.frombuffer(c._conn.memory(shm), np.uint8))
            finally:
                c._call("Release", pb.ReleaseRequest(lease_ids=[lease_id]))

        forgeries = st.one_of(
            st.tuples(st.sampled_from(["offset", "generation", "nbytes"]), st.integers(0, U64)),
            st.tuples(st.just("slot"), st.one_of(st.integers(0, len(real) + 1), st.integers(0, U32))),
            st.tuples(st.sampled_from(["name", "instance_id"]), st.integers(0, U64).map(str)),
        )

        @FUZZ
        @given(st.sampled_from(real), forgeries, st.booleans())
        def run(h, forgery, through_the_daemon):
            shm = pb.Handle()
            shm.CopyFrom(h.shm)
            setattr(shm, *forgery)
            forged = Handle(shm, "uint8", (shm.nbytes,), digest=h.digest)
            try:
                if through_the_daemon:
                    got, lease = acquire_through_the_daemon(shm), None
                else:
                    lease = c.acquire(forged)
                    got = lease.array
            except ShmTransportError as exc:
                assert exc.reason is not Reason.INTERNAL, exc
                return
            try:
                expected = content.get((shm.slot, shm.offset, shm.generation))
                assert expected is not None and expected.nbytes == shm.nbytes, f"acquired a forged handle {shm}"
                assert np.array_equal(got, expected)
                if lease is not None:
                    lease.verify()
            finally:
                if lease is not None:
                    del got
                    c.release([lease], wait=True)

        run()
        p.release(real, wait=True)


# -- the committed corpus ------------------------------------------------------------------------
@pytest.mark.parametrize("path", sorted(CORPUS.glob("*.bin")), ids=lambda p: p.name)
def test_corpus_rpc_input_gets_a_typed_answer_and_the_daemon_keeps_serving(fuzz_daemon, sessions, path):
    """``<Method>__<name>.bin``: raw request bytes; seed handles of the session are not needed."""
    method = path.name.split("__")[0]
    attacker = sessions.attacker
    payload = path.read_bytes()
    code, details, body = attacker.raw(method, payload)
    check_answer(fuzz_daemon, method, payload, code, details, body)
    assert attacker.raw("Stat", b"")[0] is grpc.StatusCode.OK
