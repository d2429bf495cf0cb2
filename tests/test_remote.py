"""Remote tier (issue 9): NIXL reads between daemons that do not share /dev/shm, explicit fallback.

Two in-process daemons advertise different shm namespace ids (``advertise_namespace``), which is how
one machine simulates two nodes; readers run in spawned children with UCX on loopback only.
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

from shmtransport import remote
from shmtransport.client import Consumer, Producer
from shmtransport.errors import HandleError, IdentityMismatch, InvalidArgument, Unavailable
from shmtransport.testing import BlockingChild, run_in_child, wait_until

# Loopback only, never any other address; set before any NIXL agent exists in this process.
UCX_ENV = {"UCX_TLS": "tcp,self,sm", "UCX_NET_DEVICES": "lo"}
for _k, _v in UCX_ENV.items():
    os.environ.setdefault(_k, _v)

needs_nixl = pytest.mark.skipif(
    not remote.nixl_available(), reason=f"NIXL cannot be imported here ({remote.EXTRA_HINT} to run these tests)"
)
TIMEOUT_S = 60
MiB = 1 << 20


def _child_env():
    for k, v in UCX_ENV.items():
        os.environ[k] = v


def _make_pair(make_daemon):
    from shmtransport.remote.daemon_ext import remote_extension

    a = make_daemon(extensions=[remote_extension(advertise_namespace="test-node-a")])
    b = make_daemon(extensions=[remote_extension(advertise_namespace="test-node-b")])
    return a, b


def _put(producer, arrays):
    return producer.put_many(arrays, hash=True)


def _live_leases(daemon) -> int:
    return daemon.stat().live_leases


# -- children ------------------------------------------------------------------------------------
def child_resolve(consumer_socket: str, blobs: list[bytes], slot_nbytes: int) -> dict:
    """Worker on 'node B': resolve every TensorData through its reader; bytes + counters back."""
    _child_env()
    from shmtransport.remote import COUNTERS, RemoteReader, namespace_of, resolve
    from shmtransport.v1 import features_pb2 as fpb

    out = {"arrays": [], "pooled": []}
    with Consumer(consumer_socket, timeout_s=TIMEOUT_S) as consumer, \
            RemoteReader(pool_slots=2, slot_nbytes=slot_nbytes, timeout_s=TIMEOUT_S) as reader:
        out["namespace"] = namespace_of(consumer)
        tds = [fpb.TensorData.FromString(b) for b in blobs]
        for td in tds:
            with resolve(td, consumer=consumer, reader=reader) as buf:
                out["arrays"].append(np.array(buf.array))
                out["pooled"].append(buf.pooled)
        out["counters"] = COUNTERS.snapshot()
        out["stats"] = dict(reader.stats)
    return out


def child_read_expect_error(remote_blob: bytes) -> tuple[str, str, str]:
    """Read one remote handle; return the typed error (class name, reason, message)."""
    _child_env()
    from shmtransport.remote import RemoteReader
    from shmtransport.errors import ShmTransportError

    with RemoteReader(pool_slots=1, slot_nbytes=MiB, timeout_s=20) as reader:
        try:
            buf = reader.read(remote_blob)
        except ShmTransportError as exc:
            return type(exc).__name__, exc.reason.value, exc.message
        buf.release()
        return "", "", "no error"


def child_acquire_and_block(conn, endpoint: str, tensor_blob: bytes):
    """Attach and lease, never release (a reader that dies mid-read)."""
    _child_env()
    from shmtransport.remote.reader import RemoteReader
    from shmtransport.v1 import daemon_pb2 as pb
    from shmtransport.v1 import remote_pb2 as rpb

    reader = RemoteReader(pool_slots=1, slot_nbytes=MiB)
    peer = reader._peer(endpoint)
    tensor = pb.TensorHandle.FromString(tensor_blob)
    response = peer.rpc("RemoteAcquire", rpb.RemoteAcquireRequest(tensors=[tensor]), 20)
    conn.send(list(response.lease_ids))
    conn.recv()  # killed here


# -- tests ---------------------------------------------------------------------------------------
def test_transport_choice_is_shm_for_equal_namespaces_remote_otherwise_and_counted():
    counters = remote.TransportCounters()
    seen = []
    counters.hooks.append(lambda t, n: seen.append((t, n)))
    assert remote.choose_transport("boot:1", "boot:1", nbytes=10, counters=counters) == "shm"
    if remote.nixl_available():
        assert remote.choose_transport("boot:1", "boot:2", nbytes=20, counters=counters) == "remote"
        assert counters.snapshot() == {"shm": 1, "remote": 1, "inline": 0}
        assert seen == [("shm", 10), ("remote", 20)]


def test_without_nixl_remote_fails_typed_naming_the_extra_and_inline_only_when_allowed(monkeypatch):
    from shmtransport.remote import resolve
    from shmtransport.v1 import features_pb2 as fpb

    monkeypatch.setenv("SHMTRANSPORT_DISABLE_NIXL", "1")
    counters = remote.TransportCounters()
    with pytest.raises(remote.NixlUnavailable, match=r"pip install shmtransport\[nixl\]"):
        remote.choose_transport("a", "b", counters=counters)
    assert remote.choose_transport("a", "b", allow_inline=True, counters=counters) == "inline"
    assert counters.snapshot() == {"shm": 0, "remote": 0, "inline": 1}
    td = fpb.TensorData(shape=[2], dtype="uint8", remote=fpb.RemoteTensorHandle(transport="nixl", nbytes=2))
    with pytest.raises(remote.NixlUnavailable, match=r"shmtransport\[nixl\]"):
        resolve(td, counters=counters)
    inline = fpb.TensorData(shape=[2], dtype="uint8", inline=b"\x01\x02")
    with pytest.raises(InvalidArgument, match="allow_inline"):
        resolve(inline, counters=counters)
    assert resolve(inline, allow_inline=True, counters=counters).tolist() == [1, 2]


def test_descriptor_checks_transport_version_and_nbytes_before_any_rpc():
    from shmtransport.remote import descriptor
    from shmtransport.v1 import daemon_pb2 as pb

    t = pb.TensorHandle(shm=pb.Handle(name="s", offset=0, nbytes=16, generation=1, instance_id="i"),
                        dtype="float32", shape=[4])
    rh = descriptor.encode(t, "127.0.0.1:1", "agent", "ns")
    assert descriptor.decode(rh.SerializeToString()).tensor == t
    bad = type(rh)(); bad.CopyFrom(rh); bad.nbytes = 32
    with pytest.raises(InvalidArgument, match="nbytes"):
        descriptor.decode(bad)
    bad.CopyFrom(rh); bad.transport = "rdma"
    with pytest.raises(InvalidArgument, match="transport"):
        descriptor.decode(bad)
    bad.CopyFrom(rh); bad.descriptor = b"\xff\xff garbage"
    with pytest.raises(InvalidArgument):
        descriptor.decode(bad)


@needs_nixl
def test_remote_read_across_namespaces_is_byte_identical_and_digest_verified(make_daemon):
    from shmtransport.remote import COUNTERS, RemoteExporter, namespace_of

    a, b = _make_pair(make_daemon)
    rng = np.random.default_rng(9)
    arrays = [
        rng.standard_normal((16, 8)).astype(np.float32),          # pooled slot
        rng.integers(0, 255, 3 * MiB, dtype=np.uint8),           # larger than a slot: dynamic
        np.zeros((0, 4), dtype=np.float16),                        # zero-size
    ]
    COUNTERS.reset()
    with Producer(a.socket_path) as producer, Consumer(b.socket_path) as local_consumer:
        assert namespace_of(producer) == "test-node-a" and namespace_of(local_consumer) == "test-node-b"
        exporter = RemoteExporter(producer)
        assert exporter.info.endpoint.startswith("127.0.0.1:")
        handles = _put(producer, arrays)
        tds = [exporter.tensor_data(h, namespace_of(local_consumer)) for h in handles]
        assert [td.WhichOneof("payload") for td in tds] == ["remote"] * 3
        assert COUNTERS.snapshot()["remote"] == 3
        got = run_in_child(child_resolve, b.socket_path, [td.SerializeToString() for td in tds], MiB,
                           timeout_s=TIMEOUT_S)
        for want, have in zip(arrays, got["arrays"]):
            assert have.dtype == want.dtype and have.shape == want.shape and np.array_equal(have, want)
        assert got["pooled"] == [True, False, True]
        assert got["counters"]["remote"] == 3 and got["namespace"] == "test-node-b"
        # Same namespace: shm, no NIXL.
        same = exporter.tensor_data(handles[0], namespace_of(producer))
        assert same.WhichOneof("payload") == "shm"
        producer.release(handles, wait=True)
    wait_until(lambda: _live_leases(a) == 0, 5, what="remote leases released after the reads")
    assert a.remote.live_sessions == 0


@needs_nixl
def test_forged_descriptor_nbytes_mismatch_tampered_bytes_and_gone_peer_give_typed_errors(make_daemon):
    from shmtransport.remote import RemoteExporter, descriptor
    from shmtransport.v1 import remote_pb2 as rpb

    a, _ = _make_pair(make_daemon)
    with Producer(a.socket_path) as producer:
        exporter = RemoteExporter(producer)
        [h] = _put(producer, [np.arange(1024, dtype=np.int32)])
        good = exporter.export(h)

        forged_desc = rpb.NixlDescriptor.FromString(good.descriptor)
        forged_desc.tensor.shm.generation += 1000
        forged = type(good)(transport="nixl", descriptor=forged_desc.SerializeToString(), nbytes=good.nbytes)
        cls, reason, _ = run_in_child(child_read_expect_error, forged.SerializeToString(), timeout_s=TIMEOUT_S)
        assert cls == HandleError.__name__ and reason == "bad_handle"

        mismatch = type(good)(); mismatch.CopyFrom(good); mismatch.nbytes += 4
        with pytest.raises(InvalidArgument, match="nbytes"):
            descriptor.decode(mismatch)

        wrong_digest = rpb.NixlDescriptor.FromString(good.descriptor)
        wrong_digest.tensor.digest = bytes(16)
        tampered = type(good)(transport="nixl", descriptor=wrong_digest.SerializeToString(), nbytes=good.nbytes)
        cls, reason, _ = run_in_child(child_read_expect_error, tampered.SerializeToString(), timeout_s=TIMEOUT_S)
        assert cls == IdentityMismatch.__name__
        wait_until(lambda: _live_leases(a) == 0, 5, what="leases released after a failed verification")

        gone = rpb.NixlDescriptor.FromString(good.descriptor)
        gone.endpoint = "127.0.0.1:1"  # nothing listens there
        gone_handle = type(good)(transport="nixl", descriptor=gone.SerializeToString(), nbytes=good.nbytes)
        cls, reason, msg = run_in_child(child_read_expect_error, gone_handle.SerializeToString(), timeout_s=TIMEOUT_S)
        assert cls == Unavailable.__name__ and "127.0.0.1:1" in msg
        producer.release([h], wait=True)


@needs_nixl
def test_remote_peer_that_dies_mid_read_has_its_leases_reclaimed(make_daemon):
    from shmtransport.remote import RemoteExporter

    a, _ = _make_pair(make_daemon)
    with Producer(a.socket_path) as producer:
        exporter = RemoteExporter(producer)
        [h] = _put(producer, [np.ones(4096, dtype=np.uint8)])
        with BlockingChild(child_acquire_and_block, exporter.info.endpoint, h.to_proto().SerializeToString()) as child:
            lease_ids = child.recv(timeout_s=TIMEOUT_S)
            assert len(lease_ids) == 1
            assert _live_leases(a) == 1 and a.remote.live_sessions == 1
            child.kill()
        wait_until(lambda: _live_leases(a) == 0 and a.remote.live_sessions == 0, 10,
                   what="the dead peer's session closed and its lease reclaimed")
        producer.release([h], wait=True)
