"""The error boundary (``shmtransport.error_boundary``): real gRPC servers on real Unix sockets.

A servicer raises each kind of failure through the interceptor, unary and server-streaming, sync
and asyncio: a typed error arrives as the same class with its reason, field and limit (carried in
trailing metadata, the details are the message alone); a bug is logged and answered INTERNAL, and
the server keeps serving; ``context.abort`` passes through untouched. A status without our reason
(a plain server, the transport) maps by its code. The client reconnects on a reason, not a text.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import tempfile
import threading

import grpc
import numpy as np
import pytest

from shmtransport.client import Producer
from shmtransport.error_boundary import UNEXPECTED_MESSAGE, AioErrorBoundary, ErrorBoundary
from shmtransport.errors import (
    REASON_KEY,
    DeadlineExceeded,
    HandleError,
    InternalError,
    PermissionDenied,
    Reason,
    ResourceExhausted,
    Unavailable,
    error_from_rpc,
)
from shmtransport.v1 import daemon_pb2 as pb
from shmtransport.v1 import daemon_pb2_grpc as pb_grpc
from shmtransport.wire import GRPC_OPTIONS, SESSION_METADATA_KEY

TIMEOUT_S = 10.0
SERVICE = "test.Boundary"
OWN_KEY = "x-test-own"  # trailing metadata a handler sets itself: kept next to the error's


def _typed() -> ResourceExhausted:
    return ResourceExhausted("3 items, at most 2", Reason.QUOTA_EXCEEDED, field="batches[0].items", limit=2)


class _Bug(Exception):
    """What a servicer raises by mistake."""


def _act(kind: bytes, context):
    """What a handler does for the request ``kind`` (raw bytes, no protos needed)."""
    if kind == b"typed":
        context.set_trailing_metadata(((OWN_KEY, "kept"),))
        raise _typed()
    if kind == b"bug":
        raise _Bug("a servicer bug")
    if kind == b"abort":
        context.abort(grpc.StatusCode.ALREADY_EXISTS, "aborted by the handler")
    return b"ok"


def _unary(request, context):
    return _act(request, context)


def _stream(request, context):
    yield b"first"
    yield _act(request, context)


def _handlers(unary, stream) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(SERVICE, {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.unary_stream_rpc_method_handler(stream),
    })


@pytest.fixture
def socket_dir():
    with tempfile.TemporaryDirectory(prefix="shmt-eb-", dir="/tmp") as path:  # short: sun_path is 108 bytes
        yield path


def _serve(path: str, interceptors) -> grpc.Server:
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=2), interceptors=interceptors)
    server.add_generic_rpc_handlers((_handlers(_unary, _stream),))
    assert server.add_insecure_port(f"unix:{path}") == 1
    server.start()
    return server


@pytest.fixture
def served(socket_dir):
    """(channel, server) of a sync server behind the ErrorBoundary."""
    server = _serve(f"{socket_dir}/b.sock", [ErrorBoundary()])
    channel = grpc.insecure_channel(f"unix:{socket_dir}/b.sock")
    yield channel
    channel.close()
    server.stop(None).wait(TIMEOUT_S)


@pytest.fixture
def plain(socket_dir):
    """A channel to a plain gRPC server: no boundary, so no reason of ours on its statuses."""
    server = _serve(f"{socket_dir}/p.sock", [])
    channel = grpc.insecure_channel(f"unix:{socket_dir}/p.sock")
    yield channel
    channel.close()
    server.stop(None).wait(TIMEOUT_S)


def _unary_call(channel, kind: bytes):
    return channel.unary_unary(f"/{SERVICE}/Unary")(kind, timeout=TIMEOUT_S)


def _stream_call(channel, kind: bytes) -> tuple[list[bytes], grpc.RpcError | None]:
    """The messages received before the stream ended, and its error (None if it ended OK)."""
    got = []
    try:
        for message in channel.unary_stream(f"/{SERVICE}/Stream")(kind, timeout=TIMEOUT_S):
            got.append(message)
    except grpc.RpcError as err:
        return got, err
    return got, None


def _failure(channel, kind: bytes, streaming: bool) -> grpc.RpcError:
    if not streaming:
        with pytest.raises(grpc.RpcError) as info:
            _unary_call(channel, kind)
        return info.value
    got, err = _stream_call(channel, kind)
    assert got == [b"first"] and err is not None  # what was sent before the failure arrived
    return err


def _assert_typed(err: grpc.RpcError) -> None:
    assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.details() == "3 items, at most 2"  # the message alone: the reason is in the metadata
    metadata = dict(err.trailing_metadata())
    assert metadata[REASON_KEY] == Reason.QUOTA_EXCEEDED.value
    assert metadata[OWN_KEY] == "kept"  # the handler's own trailing metadata survives the error
    exc = error_from_rpc(err)
    assert type(exc) is ResourceExhausted
    assert (exc.reason, exc.field, exc.limit, exc.message) == (
        Reason.QUOTA_EXCEEDED, "batches[0].items", 2, "3 items, at most 2")


def _assert_bug(err: grpc.RpcError) -> None:
    assert (err.code(), err.details()) == (grpc.StatusCode.INTERNAL, UNEXPECTED_MESSAGE)
    exc = error_from_rpc(err)
    assert type(exc) is InternalError and exc.reason is Reason.INTERNAL


def _assert_aborted(err: grpc.RpcError) -> None:
    assert (err.code(), err.details()) == (grpc.StatusCode.ALREADY_EXISTS, "aborted by the handler")
    assert REASON_KEY not in dict(err.trailing_metadata() or ())


def _bug_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "shmtransport.error_boundary" and r.exc_info
            and r.exc_info[0] is _Bug]


# -- the sync boundary -----------------------------------------------------------------------------
@pytest.mark.parametrize("streaming", [False, True], ids=["unary", "stream"])
def test_a_typed_error_arrives_with_its_class_reason_field_and_limit(served, streaming):
    _assert_typed(_failure(served, b"typed", streaming))


@pytest.mark.parametrize("streaming", [False, True], ids=["unary", "stream"])
def test_a_bug_is_logged_answered_internal_and_the_server_keeps_serving(served, streaming, caplog):
    caplog.set_level(logging.ERROR, logger="shmtransport.error_boundary")
    _assert_bug(_failure(served, b"bug", streaming))
    assert [r.levelno for r in _bug_records(caplog)] == [logging.ERROR]
    assert "a servicer bug" in caplog.text  # the traceback is in the server's log, not in the answer
    caplog.clear()  # its traceback holds the server's call state (and fds) alive
    for _ in range(3):  # still serving, both kinds of call
        assert _unary_call(served, b"ok") == b"ok"
        assert _stream_call(served, b"ok") == ([b"first", b"ok"], None)


@pytest.mark.parametrize("streaming", [False, True], ids=["unary", "stream"])
def test_context_abort_passes_through_untouched_and_is_not_logged(served, streaming, caplog):
    caplog.set_level(logging.DEBUG, logger="shmtransport.error_boundary")
    _assert_aborted(_failure(served, b"abort", streaming))
    assert not [r for r in caplog.records if r.name == "shmtransport.error_boundary"]
    exc = error_from_rpc(_failure(served, b"abort", streaming))
    assert type(exc) is InternalError and exc.message == "aborted by the handler"  # no row for ALREADY_EXISTS


def test_an_unknown_method_stays_unimplemented(served):
    with pytest.raises(grpc.RpcError) as info:
        served.unary_unary(f"/{SERVICE}/Missing")(b"", timeout=TIMEOUT_S)
    assert info.value.code() is grpc.StatusCode.UNIMPLEMENTED


# -- the asyncio boundary --------------------------------------------------------------------------
async def _aio_unary(request, context):
    if request == b"abort":
        await context.abort(grpc.StatusCode.ALREADY_EXISTS, "aborted by the handler")
    return _act(request, context)


async def _aio_stream(request, context):
    yield b"first"
    yield await _aio_unary(request, context)


async def _aio_failures(path: str) -> dict:
    """Each kind through an aio server behind the AioErrorBoundary, then one OK call of each."""
    server = grpc.aio.server(interceptors=[AioErrorBoundary()])
    server.add_generic_rpc_handlers((_handlers(_aio_unary, _aio_stream),))
    assert server.add_insecure_port(f"unix:{path}") == 1
    await server.start()
    failures: dict = {}
    try:
        async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
            unary = channel.unary_unary(f"/{SERVICE}/Unary")
            stream = channel.unary_stream(f"/{SERVICE}/Stream")
            for kind in (b"typed", b"bug", b"abort"):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await unary(kind, timeout=TIMEOUT_S)
                failures[kind, False] = info.value
                got = []
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for message in stream(kind, timeout=TIMEOUT_S):
                        got.append(message)
                assert got == [b"first"]
                failures[kind, True] = info.value
            failures["ok"] = (await unary(b"ok", timeout=TIMEOUT_S),
                              [m async for m in stream(b"ok", timeout=TIMEOUT_S)])
    finally:
        await server.stop(None)
    return failures


def test_the_aio_boundary_answers_each_kind_as_the_sync_one_does(socket_dir, caplog):
    caplog.set_level(logging.ERROR, logger="shmtransport.error_boundary")
    failures = asyncio.run(asyncio.wait_for(_aio_failures(f"{socket_dir}/a.sock"), TIMEOUT_S * 3))
    for streaming in (False, True):
        _assert_typed(failures[b"typed", streaming])
        _assert_bug(failures[b"bug", streaming])
        _assert_aborted(failures[b"abort", streaming])
    assert len(_bug_records(caplog)) == 2
    caplog.clear()  # their tracebacks hold the server's call state (and fds) alive
    assert failures["ok"] == (b"ok", [b"first", b"ok"])  # still serving after the bugs


# -- statuses without our reason -------------------------------------------------------------------
def test_a_plain_servers_statuses_map_by_their_code(plain, caplog):
    with pytest.raises(grpc.RpcError) as info:
        _unary_call(plain, b"bug")  # grpc's own answer to an exception: UNKNOWN
    exc = error_from_rpc(info.value)
    assert type(exc) is InternalError and exc.reason is Reason.INTERNAL
    with pytest.raises(grpc.RpcError) as info:
        _unary_call(plain, b"typed")  # no boundary: the reason never left the server
    assert info.value.code() is grpc.StatusCode.UNKNOWN
    assert type(error_from_rpc(info.value)) is InternalError
    caplog.clear()  # grpc logged both with tracebacks, which hold the server's call state (and fds) alive


def test_a_bare_permission_denied_is_not_an_unknown_session_and_a_mismatched_reason_is_ignored(socket_dir):
    def refuse(request, context):
        if request == b"mismatch":  # a reason whose status code is another one (a proxy rewrote it)
            context.set_trailing_metadata(((REASON_KEY, Reason.UNKNOWN_SESSION.value),))
            context.abort(grpc.StatusCode.NOT_FOUND, "not here")
        if request == b"unknown":  # a reason this client does not know (a newer server)
            context.set_trailing_metadata(((REASON_KEY, "reason_of_the_future"),))
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "missing or unknown session token")

    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=1))
    server.add_generic_rpc_handlers((_handlers(refuse, _stream),))
    server.add_insecure_port(f"unix:{socket_dir}/r.sock")
    server.start()
    try:
        with grpc.insecure_channel(f"unix:{socket_dir}/r.sock") as channel:
            for kind, cls, reason in ((b"bare", PermissionDenied, Reason.PERMISSION_DENIED),
                                      (b"unknown", PermissionDenied, Reason.PERMISSION_DENIED),
                                      (b"mismatch", HandleError, Reason.BAD_HANDLE)):
                with pytest.raises(grpc.RpcError) as info:
                    _unary_call(channel, kind)
                exc = error_from_rpc(info.value)
                assert (type(exc), exc.reason, exc.field, exc.limit) == (cls, reason, None, None), kind
    finally:
        server.stop(None).wait(TIMEOUT_S)


def test_transport_failures_map_to_unavailable_and_deadline_exceeded(socket_dir):
    with grpc.insecure_channel(f"unix:{socket_dir}/nobody.sock") as channel:
        with pytest.raises(grpc.RpcError) as info:
            _unary_call(channel, b"ok")
    exc = error_from_rpc(info.value)
    assert type(exc) is Unavailable and exc.reason is Reason.DAEMON_UNAVAILABLE

    release = threading.Event()

    def stuck(request, context):
        release.wait(TIMEOUT_S)
        return b"late"

    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=1), interceptors=[ErrorBoundary()])
    server.add_generic_rpc_handlers((_handlers(stuck, _stream),))
    server.add_insecure_port(f"unix:{socket_dir}/s.sock")
    server.start()
    try:
        with grpc.insecure_channel(f"unix:{socket_dir}/s.sock") as channel:
            with pytest.raises(grpc.RpcError) as info:
                channel.unary_unary(f"/{SERVICE}/Unary")(b"", timeout=0.2)
        exc = error_from_rpc(info.value)
        assert type(exc) is DeadlineExceeded and exc.reason is Reason.DEADLINE_EXCEEDED
    finally:
        release.set()
        server.stop(None).wait(TIMEOUT_S)


# -- the daemon and its client ---------------------------------------------------------------------
def test_the_daemon_refuses_an_unknown_session_token_with_its_reason(daemon):
    with grpc.insecure_channel(f"unix:{daemon.socket_path}", options=GRPC_OPTIONS) as channel:
        stub = pb_grpc.DaemonStub(channel)
        for metadata in ((), ((SESSION_METADATA_KEY, "0" * 32),)):  # missing, forged
            with pytest.raises(grpc.RpcError) as info:
                stub.Stat(pb.StatRequest(), timeout=TIMEOUT_S, metadata=metadata)
            exc = error_from_rpc(info.value)
            assert type(exc) is PermissionDenied and exc.reason is Reason.UNKNOWN_SESSION
            assert info.value.details() == exc.message  # no reason prefix in the text


def test_a_session_the_daemon_no_longer_knows_makes_the_next_call_reconnect(make_daemon):
    daemon = make_daemon(share_object_table=False)  # every put is a Loan RPC, nothing in shared memory alone
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer:
        first = producer.session_id
        daemon.registry.close_session(first)  # the daemon forgets it while its socket is still open
        with pytest.raises(PermissionDenied) as info:
            producer.put(np.arange(10))
        assert info.value.reason is Reason.UNKNOWN_SESSION
        handle = producer.put(np.arange(10))  # the next call: a new session, not the same refusal
        assert producer.session_id != first
        producer.release(handle, wait=True)
    del info


def test_the_reconnect_decision_is_the_reasons_not_the_messages(daemon, socket_dir):
    """A refusal whose text says "session" keeps the session; UNKNOWN_SESSION drops it."""
    refusals = [PermissionDenied("this session may not read that segment"),
                PermissionDenied("missing or unknown session token", Reason.UNKNOWN_SESSION)]

    def refuse(request, context):
        raise refusals[int(request)]

    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=1), interceptors=[ErrorBoundary()])
    server.add_generic_rpc_handlers((_handlers(refuse, _stream),))
    server.add_insecure_port(f"unix:{socket_dir}/t.sock")
    server.start()
    try:
        with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, \
                grpc.insecure_channel(f"unix:{socket_dir}/t.sock") as channel:
            session = producer.session_id
            for i, refusal in enumerate(refusals):
                with pytest.raises(grpc.RpcError) as info:
                    _unary_call(channel, str(i).encode())
                exc = producer._conn.typed(info.value)  # the client's decision on a real status
                assert (exc.reason, exc.message) == (refusal.reason, refusal.message)
                assert producer._conn.alive() is (refusal.reason is Reason.PERMISSION_DENIED)
                assert (producer.session_id == session) is (refusal.reason is Reason.PERMISSION_DENIED)
            assert producer.stat().used_nbytes == 0  # the new session serves
    finally:
        server.stop(None).wait(TIMEOUT_S)
