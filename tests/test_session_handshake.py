"""The session handshake is a protobuf contract (``SessionRequest`` -> ``SessionReply``, each framed
by a 4-byte length): what a valid request gets, and what each malformed one gets instead, with the
daemon serving on."""
from __future__ import annotations

import os
import socket

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmtransport import Consumer, Producer, objtable
from shmtransport.daemon.sessions import MAX_HANDSHAKE_NBYTES
from shmtransport.errors import Reason, ResourceExhausted
from shmtransport.v1 import daemon_pb2 as pb
from shmtransport.wire import frame_payload, framed

TIMEOUT_S = 5.0


def _handshake(socket_path: str, sent: bytes) -> tuple[pb.SessionReply | None, list[int]]:
    """Send ``sent`` raw; the framed reply (None: the daemon closed without one) and the fds passed."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(TIMEOUT_S)
        sock.connect(socket_path + ".session")
        sock.sendall(sent)
        data, fds = b"", []
        while (payload := frame_payload(data, 65536)) is None:
            chunk, new_fds, _, _ = socket.recv_fds(sock, 65536, 3)
            fds += new_fds
            if not chunk:
                return None, fds
            data += chunk
        return pb.SessionReply.FromString(payload), fds


def _request(access: int) -> bytes:
    return framed(pb.SessionRequest(access=access).SerializeToString())


@pytest.mark.parametrize("access", [pb.SESSION_ACCESS_READ_WRITE, pb.SESSION_ACCESS_READ_ONLY])
def test_a_valid_request_gets_a_hello_that_names_this_daemon_and_the_arena_fd(daemon, access):
    reply, fds = _handshake(daemon.socket_path, _request(access))
    try:
        assert reply.WhichOneof("result") == "hello"
        hello = reply.hello
        info = daemon.stat().arena
        assert (hello.instance_id, hello.segment_name, hello.arena_nbytes) == \
            (info.instance_id, info.segment_name, info.nbytes)
        assert hello.pid == os.getpid() and hello.token and hello.session_id
        assert len(fds) == (3 if hello.HasField("object_table") else 1)
        assert os.fstat(fds[0]).st_size == hello.arena_nbytes
    finally:
        for fd in fds:
            os.close(fd)


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "not_shared"])
def test_the_table_and_a_holder_bit_are_handed_out_only_where_clients_share_the_table(make_daemon, shared):
    """Every object lives in the table; clients get it (and a bit) only where it is shared, which
    needs the C kernels in the daemon. Otherwise the daemon keeps it to itself, changes it under
    its lock with the pure-Python kernels when it has no C kernels, and places every object."""
    daemon = make_daemon(share_object_table=shared)
    handed = shared and objtable.available()
    reply, fds = _handshake(daemon.socket_path, _request(pb.SESSION_ACCESS_READ_WRITE))
    try:
        hello = reply.hello
        assert hello.HasField("object_table") == hello.HasField("holder_bit") == handed
        assert len(fds) == (3 if handed else 1)
    finally:
        for fd in fds:
            os.close(fd)
    assert daemon.registry.objects.table.single_writer == (not objtable.available())
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer:
        handle = producer.put(np.arange(100, dtype=np.uint8))
        assert handle.shm.slot and daemon.stat().table_objects == 1
        owner = int(daemon.registry.objects.table.columns["owner"][handle.shm.slot - 1])
        assert (owner == objtable.PROXY_BIT) == (not handed)  # placed by the daemon, or by the producer
        producer.release(handle, wait=True)
    assert daemon.stat().live_objects == 0


@pytest.mark.parametrize("sent", [
    _request(pb.SESSION_ACCESS_UNSPECIFIED),
    framed(b"\xff\xff\xff"),  # a frame, but not a SessionRequest
    framed(b""),  # an empty message: access unset
    (MAX_HANDSHAKE_NBYTES + 1).to_bytes(4, "big"),  # announces more than the daemon reads
], ids=["access_unspecified", "not_a_message", "empty_message", "oversized_frame"])
def test_a_malformed_request_is_refused_with_invalid_argument_and_the_daemon_serves_on(daemon, sent):
    reply, fds = _handshake(daemon.socket_path, sent)
    assert fds == []
    assert reply.WhichOneof("result") == "refusal"
    assert reply.refusal.reason == Reason.INVALID_ARGUMENT.value
    with Consumer(daemon.socket_path, timeout_s=TIMEOUT_S) as consumer:
        assert consumer.stat().live_leases == 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(min_size=4, max_size=MAX_HANDSHAKE_NBYTES))  # shorter: a wait for the rest
def test_random_bytes_get_a_refusal_or_a_hello_or_a_close_never_a_dead_daemon(daemon, sent):
    reply, fds = _handshake(daemon.socket_path, sent)
    for fd in fds:
        os.close(fd)
    if reply is not None and reply.HasField("hello"):  # bytes that happen to say read-write or read-only
        assert pb.SessionRequest.FromString(frame_payload(sent, MAX_HANDSHAKE_NBYTES)).access in (
            pb.SESSION_ACCESS_READ_WRITE, pb.SESSION_ACCESS_READ_ONLY)
    elif reply is not None:
        assert reply.refusal.reason == Reason.INVALID_ARGUMENT.value
    assert daemon.stat().arena.nbytes > 0  # still serving


def test_a_refusal_reaches_the_client_as_the_typed_error_of_its_reason(make_daemon):
    daemon = make_daemon(max_sessions_per_tenant=1)
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S):
        with pytest.raises(ResourceExhausted) as refused:
            Consumer(daemon.socket_path, timeout_s=TIMEOUT_S)
    assert refused.value.reason is Reason.QUOTA_EXCEEDED
