"""Remote tier (issue 9): NIXL reads between daemons that do not share /dev/shm, explicit fallback.

Two daemons advertise different shm namespace ids (``advertise_namespace``), which is how one machine
simulates two nodes. Daemons, producer and readers all run in spawned children with UCX on loopback
only: NIXL is never loaded in the pytest process (nixl-cu12 and grpcio-tools' in-process protoc,
which test_proto_generated runs, crash when loaded together).
"""
from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import secrets

import grpc
import numpy as np
import pytest

from shmtransport import remote
from shmtransport.client import Consumer, Producer
from shmtransport.errors import (
    HandleError,
    IdentityMismatch,
    InvalidArgument,
    PermissionDenied,
    Unavailable,
)
from shmtransport.remote.auth import SECRET_METADATA_KEY, RemoteTLS
from shmtransport.remote.daemon_ext import REMOTE_SESSION_METADATA_KEY
from shmtransport.testing import BlockingChild, run_in_child
from shmtransport.v1 import remote_pb2 as rpb
from shmtransport.v1 import remote_pb2_grpc as rpb_grpc

# Loopback only, never any other address; set in every child before its NIXL agent exists.
UCX_ENV = {"UCX_TLS": "tcp,self,sm", "UCX_NET_DEVICES": "lo"}

def _nixl_importable() -> bool:
    """Checked in a subprocess: this process must never load NIXL (nixl-cu12's bundled libraries and
    grpcio-tools' protoc crash in one process, and test_proto_generated runs protoc in-process)."""
    import subprocess
    import sys

    if os.environ.get("SHMTRANSPORT_DISABLE_NIXL") == "1":
        return False
    code = (
        "import importlib, sys\n"
        "for name in ('nixl_cu12', 'nixl'):\n"
        "    try:\n"
        "        module = importlib.import_module(name)\n"
        "    except ImportError:\n"
        "        continue\n"
        "    sys.exit(0 if hasattr(module, 'nixl_agent') else 1)\n"
        "sys.exit(1)\n"
    )
    try:
        return subprocess.run([sys.executable, "-c", code], timeout=60, capture_output=True).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


NIXL_OK = _nixl_importable()
needs_nixl = pytest.mark.skipif(not NIXL_OK,
                                reason=f"NIXL cannot be imported here ({remote.EXTRA_HINT} to run these tests)")
TIMEOUT_S = 60
MiB = 1 << 20
ARENA_NBYTES = 32 * MiB


def _child_env():
    for k, v in UCX_ENV.items():
        os.environ[k] = v


def host_two_nodes(conn, remote_kwargs: dict | None = None):
    """'Node A' and 'node B' daemons (remote extension with ``remote_kwargs``, namespaces
    test-node-a/-b) and a producer on A, in one child, so that NIXL never loads in the pytest
    process. Serves commands."""
    _child_env()
    from shmtransport import testing
    from shmtransport.remote import COUNTERS, RemoteExporter, namespace_of
    from shmtransport.remote.daemon_ext import remote_extension

    daemons, remotes = [], []  # remotes: each daemon's RemoteExtension, as on_install hands it over
    try:
        for ns in ("test-node-a", "test-node-b"):
            extension = remote_extension(**(remote_kwargs or {}), on_install=remotes.append)
            daemons.append(testing.start_daemon(arena_nbytes=ARENA_NBYTES, shm_namespace=ns, extensions=[extension]))
        a, b = daemons
        a_remote = remotes[0]
        with Producer(a.socket_path) as producer, Consumer(b.socket_path) as local_consumer:
            exporter = RemoteExporter(producer)
            handles = []
            conn.send(("ready", b.socket_path, exporter.info.endpoint, namespace_of(producer),
                       namespace_of(local_consumer)))
            while True:
                msg = conn.recv()
                cmd, *args = (msg,) if isinstance(msg, str) else msg
                if cmd == "exit":
                    break
                if cmd == "put":
                    new = producer.put_many(args[0], digest=True)
                    handles.extend(new)
                    consumer_ns = namespace_of(local_consumer)
                    conn.send([(h.to_proto().SerializeToString(),
                                exporter.tensor_data(h, consumer_ns).SerializeToString(),
                                exporter.tensor_data(h, namespace_of(producer)).WhichOneof("payload"))
                               for h in new])
                elif cmd == "put_dedicated":  # remote handles of dedicated-segment loans
                    new = producer.put_many(args[0], dedicated=True)
                    handles.extend(new)
                    conn.send([exporter.export(h).SerializeToString() for h in new])
                elif cmd == "stat":
                    conn.send((a.stat().live_leases, a_remote.live_sessions, COUNTERS.snapshot()))
                elif cmd == "settle":
                    ok = testing.wait_until(lambda: a.stat().live_leases == 0 and a_remote.live_sessions == 0,
                                            args[0], what="remote leases and sessions gone")
                    conn.send(bool(ok))
                elif cmd == "release_all":
                    producer.release(handles, wait=True)
                    handles.clear()
                    conn.send(a.stat().live_objects)
                else:
                    raise ValueError(f"unknown command {cmd!r}")
            if handles:
                producer.release(handles, wait=True)
    finally:
        leftovers = [testing.stop_daemon(d) for d in daemons]
    return leftovers


class Nodes:
    def __init__(self, remote_kwargs: dict | None = None):
        self.child = BlockingChild(host_two_nodes, remote_kwargs)
        _, self.b_socket, self.endpoint, self.ns_a, self.ns_b = self.child.recv(TIMEOUT_S)

    def ask(self, *cmd):
        self.child.send(cmd)
        return self.child.recv(TIMEOUT_S)

    def close(self):
        leftovers = self.child.finish(timeout_s=TIMEOUT_S)
        self.child.process.close()
        assert leftovers == [[], []], f"daemon segments left behind: {leftovers}"


@contextlib.contextmanager
def two_nodes(**remote_kwargs):
    n = Nodes(remote_kwargs)
    try:
        yield n
    finally:
        n.child.close() if n.child._done is not None else n.close()


@pytest.fixture
def nodes():
    with two_nodes() as n:
        yield n


def _remote_blob(td_blob: bytes) -> bytes:
    from shmtransport.v1 import features_pb2 as fpb

    return fpb.TensorData.FromString(td_blob).remote.SerializeToString()


def _make_pki() -> dict[str, bytes]:
    """A throwaway CA, a server certificate for 127.0.0.1, a client certificate, and a client
    certificate of another CA (PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def cert(subject, key, issuer, issuer_key, ca=False, usage=None, san=None):
        b = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name(issuer))
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(hours=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if usage is not None:
            b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if san is not None:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return b.sign(issuer_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)

    def key_pem(key):
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    keys = {k: ec.generate_private_key(ec.SECP256R1()) for k in ("ca", "server", "client", "rogue_ca", "rogue")}
    return {
        "ca": cert("test CA", keys["ca"], "test CA", keys["ca"], ca=True),
        "server_cert": cert("node-a", keys["server"], "test CA", keys["ca"], usage=ExtendedKeyUsageOID.SERVER_AUTH,
                            san=[x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
        "server_key": key_pem(keys["server"]),
        "client_cert": cert("reader", keys["client"], "test CA", keys["ca"], usage=ExtendedKeyUsageOID.CLIENT_AUTH),
        "client_key": key_pem(keys["client"]),
        "rogue_cert": cert("rogue", keys["rogue"], "rogue CA", keys["rogue_ca"], usage=ExtendedKeyUsageOID.CLIENT_AUTH),
        "rogue_key": key_pem(keys["rogue"]),
    }


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


def child_read_expect_errors(remote_blobs: list[bytes]) -> list[tuple[str, str, str]]:
    """Read each remote handle; the typed error each gave (class name, reason, message)."""
    _child_env()
    from shmtransport.errors import ShmTransportError
    from shmtransport.remote import RemoteReader

    out = []
    with RemoteReader(pool_slots=1, slot_nbytes=MiB, timeout_s=20) as reader:
        for blob in remote_blobs:
            try:
                reader.read(blob).release()
            except ShmTransportError as exc:
                out.append((type(exc).__name__, exc.reason.value, exc.message))
            else:
                out.append(("", "", "no error"))
    return out


def child_read_each(remote_blob: bytes, reader_kwargs: list[dict]) -> list:
    """One read of ``remote_blob`` per reader configuration: the array, or the typed error
    (class name, reason, message)."""
    _child_env()
    from shmtransport.errors import ShmTransportError
    from shmtransport.remote import RemoteReader

    out = []
    for kwargs in reader_kwargs:
        with RemoteReader(pool_slots=1, slot_nbytes=MiB, timeout_s=20, **kwargs) as reader:
            try:
                with reader.read(remote_blob) as buf:
                    out.append(np.array(buf.array))
            except ShmTransportError as exc:
                out.append((type(exc).__name__, exc.reason.value, exc.message))
    return out


def child_views_pin_receive_memory(remote_blobs: list[bytes]) -> dict:
    """One pool slot: a released buffer whose view the caller still holds is not reused."""
    _child_env()
    from shmtransport.remote import RemoteReader

    with RemoteReader(pool_slots=1, slot_nbytes=MiB) as reader:
        first = reader.read(remote_blobs[0])
        kept = first.array[2:]  # a derived view outlives the release
        first.release()
        second = reader.read(remote_blobs[1])
        out = {"second_pooled": second.pooled, "kept": np.array(kept), "second": np.array(second.array)}
        second.release()
        del kept
        third = reader.read(remote_blobs[1])
        out["third_pooled"] = third.pooled
        third.release()
        out["registrations"] = reader.stats["registrations"]
    return out


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
def test_transport_choice_is_shm_for_equal_namespaces_remote_otherwise_and_counted(monkeypatch):
    from shmtransport.remote import transport

    monkeypatch.setattr(transport, "nixl_available", lambda: True)  # no NIXL load in this process
    counters = remote.TransportCounters()
    seen = []
    counters.hooks.append(lambda t, n: seen.append((t, n)))
    assert remote.choose_transport("boot:1", "boot:1", nbytes=10, counters=counters) == "shm"
    assert remote.choose_transport("boot:1", "boot:2", nbytes=20, counters=counters) == "remote"
    assert remote.choose_transport("", "", nbytes=30, counters=counters) == "remote"  # unknown: never shm
    assert counters.snapshot() == {"shm": 1, "remote": 2, "inline": 0}
    assert seen == [("shm", 10), ("remote", 20), ("remote", 30)]


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
    assert counters.snapshot()["inline"] == 2


def test_descriptor_checks_transport_version_and_nbytes_before_any_rpc():
    from shmtransport.remote import descriptor
    from shmtransport.v1 import daemon_pb2 as pb

    t = pb.TensorHandle(shm=pb.Handle(name="s", offset=0, nbytes=16, generation=1, instance_id="i"),
                        dtype="float32", shape=[4])
    rh = descriptor.encode(t, "127.0.0.1:1", "agent", "ns")
    assert descriptor.decode(rh.SerializeToString()).tensor == t
    bad = type(rh)()
    for field, value, match in (("nbytes", 32, "nbytes"), ("transport", "rdma", "transport"),
                                ("descriptor", b"\xff\xff garbage", "descriptor")):
        bad.CopyFrom(rh)
        setattr(bad, field, value)
        with pytest.raises(InvalidArgument, match=match):
            descriptor.decode(bad)
    wrong_shape = pb.TensorHandle()
    wrong_shape.CopyFrom(t)
    wrong_shape.shape[:] = [5]
    with pytest.raises(InvalidArgument, match="bytes"):
        descriptor.decode(descriptor.encode(wrong_shape, "127.0.0.1:1", "agent", "ns"))


@needs_nixl
def test_remote_read_across_namespaces_is_byte_identical_and_digest_verified(nodes):
    assert (nodes.ns_a, nodes.ns_b) == ("test-node-a", "test-node-b")
    assert nodes.endpoint.startswith("127.0.0.1:")
    rng = np.random.default_rng(9)
    arrays = [
        rng.standard_normal((16, 8)).astype(np.float32),  # a pool slot
        rng.integers(0, 255, 3 * MiB, dtype=np.uint8),   # larger than a slot: registered for itself
        np.zeros((0, 4), dtype=np.float16),               # zero-size
    ]
    put = nodes.ask("put", arrays)
    assert [same_ns for _, _, same_ns in put] == ["shm"] * 3  # same namespace: no NIXL
    tds = [td for _, td, _ in put]
    got = run_in_child(child_resolve, nodes.b_socket, tds, MiB, timeout_s=TIMEOUT_S)
    for want, have in zip(arrays, got["arrays"]):
        assert have.dtype == want.dtype and have.shape == want.shape and np.array_equal(have, want)
    assert got["pooled"] == [True, False, True]
    assert got["counters"]["remote"] == 3 and got["namespace"] == "test-node-b"
    assert nodes.ask("settle", 5) is True
    leases, sessions, counters = nodes.ask("stat")
    assert counters["remote"] == 3 and counters["shm"] == 3
    assert nodes.ask("release_all") == 0


@needs_nixl
def test_forged_descriptor_tampered_bytes_and_gone_peer_give_typed_errors_and_release_leases(nodes):
    from shmtransport.v1 import features_pb2 as fpb
    from shmtransport.v1 import remote_pb2 as rpb

    [(_, td_blob, _)] = nodes.ask("put", [np.arange(1024, dtype=np.int32)])
    good = fpb.TensorData.FromString(td_blob).remote

    def variant(edit):
        desc = rpb.NixlDescriptor.FromString(good.descriptor)
        edit(desc)
        return fpb.RemoteTensorHandle(transport="nixl", descriptor=desc.SerializeToString(),
                                      nbytes=good.nbytes).SerializeToString()

    forged = variant(lambda d: setattr(d.tensor.shm, "generation", d.tensor.shm.generation + 1000))
    tampered = variant(lambda d: setattr(d.tensor, "digest", bytes(16)))
    gone = variant(lambda d: setattr(d, "endpoint", "127.0.0.1:1"))  # nothing listens there
    other_offset = variant(lambda d: setattr(d.tensor.shm, "offset", d.tensor.shm.offset + 4096))
    mismatch = fpb.RemoteTensorHandle()
    mismatch.CopyFrom(good)
    mismatch.nbytes += 4
    # An object-table slot where nothing was ever placed (or, without a table, any slot at all)
    empty_slot = variant(lambda d: setattr(d.tensor.shm, "slot", d.tensor.shm.slot + 1))
    results = run_in_child(child_read_expect_errors,
                           [forged, tampered, gone, other_offset, mismatch.SerializeToString(), empty_slot],
                           timeout_s=TIMEOUT_S)
    (c1, r1, _), (c2, r2, _), (c3, r3, m3), (c4, r4, _), (c5, r5, m5), (c6, r6, _) = results
    assert (c1, r1) == (HandleError.__name__, "bad_handle")
    assert (c2, r2) == (IdentityMismatch.__name__, "identity_mismatch")
    assert c3 == Unavailable.__name__ and "127.0.0.1:1" in m3
    assert c4 == HandleError.__name__
    assert (c5, r5) == (InvalidArgument.__name__, "invalid_argument") and "nbytes" in m5
    assert (c6, r6) == (HandleError.__name__, "bad_handle")
    assert nodes.ask("settle", 5) is True  # every failure path released its lease


@needs_nixl
def test_remote_peer_that_dies_mid_read_has_its_leases_reclaimed(nodes):
    [(tensor_blob, _, _)] = nodes.ask("put", [np.ones(4096, dtype=np.uint8)])
    with BlockingChild(child_acquire_and_block, nodes.endpoint, tensor_blob) as child:
        lease_ids = child.recv(timeout_s=TIMEOUT_S)
        assert len(lease_ids) == 1
        leases, sessions, _ = nodes.ask("stat")
        assert (leases, sessions) == (1, 1)
        child.kill()
    assert nodes.ask("settle", 10) is True  # the dead peer's session closed, its lease reclaimed


@needs_nixl
def test_remote_read_after_the_owning_daemon_stopped_is_unavailable():
    child = BlockingChild(host_two_nodes)
    _, _, endpoint, _, _ = child.recv(TIMEOUT_S)
    child.send(("put", [np.ones(64, dtype=np.uint8)]))
    [(_, td_blob, _)] = child.recv(TIMEOUT_S)
    assert child.finish(timeout_s=TIMEOUT_S) == [[], []]
    child.process.close()
    from shmtransport.v1 import features_pb2 as fpb

    remote_blob = fpb.TensorData.FromString(td_blob).remote.SerializeToString()
    [(cls, reason, msg)] = run_in_child(child_read_expect_errors, [remote_blob], timeout_s=TIMEOUT_S)
    assert cls == Unavailable.__name__ and endpoint in msg


@needs_nixl
def test_receive_memory_is_not_reused_while_a_view_of_a_released_buffer_lives(nodes):
    from shmtransport.v1 import features_pb2 as fpb

    arrays = [np.arange(256, dtype=np.int64), np.full(256, -1, dtype=np.int64)]
    blobs = [fpb.TensorData.FromString(td).remote.SerializeToString() for _, td, _ in nodes.ask("put", arrays)]
    got = run_in_child(child_views_pin_receive_memory, blobs, timeout_s=TIMEOUT_S)
    assert got["second_pooled"] is False and got["third_pooled"] is True
    assert np.array_equal(got["kept"], arrays[0][2:]) and np.array_equal(got["second"], arrays[1])
    assert got["registrations"] == 1  # the pool once (not counted) + one buffer for the second read
    assert nodes.ask("settle", 5) is True


@needs_nixl
def test_dedicated_segment_handle_is_refused_by_the_remote_tier_before_any_lease(nodes):
    # No digest: nothing downstream would notice arena bytes served in place of the segment's.
    [blob] = nodes.ask("put_dedicated", [np.arange(1, 4097, dtype=np.int32)])
    [(cls, reason, msg)] = run_in_child(child_read_expect_errors, [blob], timeout_s=TIMEOUT_S)
    assert (cls, reason) == (InvalidArgument.__name__, "invalid_argument") and "dedicated" in msg
    assert nodes.ask("settle", 5) is True  # refused before the lease was taken


def _unauthenticated(call, *args, **kwargs) -> None:
    with pytest.raises(grpc.RpcError) as err:
        response = call(*args, **kwargs)
        if hasattr(response, "__next__"):  # a server stream fails on its first message
            next(response)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value


@needs_nixl
def test_shared_secret_refuses_calls_without_it_and_leases_nothing():
    secret = secrets.token_urlsafe(24)
    with two_nodes(secret=secret) as n:
        [(tensor_blob, td_blob, _)] = n.ask("put", [np.arange(1024, dtype=np.int32)])
        from shmtransport.v1 import daemon_pb2 as pb

        acquire = rpb.RemoteAcquireRequest(tensors=[pb.TensorHandle.FromString(tensor_blob)])
        with grpc.insecure_channel(n.endpoint) as channel:
            stub = rpb_grpc.RemoteStub(channel)
            for auth in ((), ((SECRET_METADATA_KEY, secret[:-1] + "?"),)):
                _unauthenticated(stub.Attach, rpb.AttachRequest(peer_name="intruder"), metadata=auth, timeout=5)
                _unauthenticated(stub.Describe, rpb.DescribeRequest(), metadata=auth, timeout=5)
            assert n.ask("stat")[:2] == (0, 0)  # no session was opened
            # Even holding a session token, a call without the secret is refused.
            attach = stub.Attach(rpb.AttachRequest(peer_name="peer"), metadata=((SECRET_METADATA_KEY, secret),),
                                 timeout=TIMEOUT_S)
            try:
                token = next(attach).session_token
                for auth in ((), ((SECRET_METADATA_KEY, "x" * len(secret)),)):
                    _unauthenticated(stub.RemoteAcquire, acquire,
                                     metadata=((REMOTE_SESSION_METADATA_KEY, token),) + auth, timeout=5)
                assert n.ask("stat")[:2] == (0, 1)  # attached, nothing leased
            finally:
                attach.cancel()
        blob = _remote_blob(td_blob)
        refused, right = run_in_child(child_read_each, blob, [{}, {"secret": secret}], timeout_s=TIMEOUT_S)
        assert refused[:2] == (PermissionDenied.__name__, "permission_denied") and n.endpoint in refused[2]
        assert np.array_equal(right, np.arange(1024, dtype=np.int32))
        assert n.ask("settle", 5) is True


@needs_nixl
def test_mutual_tls_refuses_peers_without_a_client_certificate_of_its_ca():
    pki = _make_pki()
    with two_nodes(tls=RemoteTLS(pki["server_cert"], pki["server_key"], pki["ca"])) as n:
        [(_, td_blob, _)] = n.ask("put", [np.arange(512, dtype=np.int64)])
        refused = {
            "plaintext": None,
            "no client certificate": grpc.ssl_channel_credentials(root_certificates=pki["ca"]),
            "another CA's certificate": grpc.ssl_channel_credentials(pki["ca"], pki["rogue_key"], pki["rogue_cert"]),
        }
        for what, creds in refused.items():
            channel = grpc.insecure_channel(n.endpoint) if creds is None else grpc.secure_channel(n.endpoint, creds)
            with channel, pytest.raises(grpc.RpcError) as err:
                next(rpb_grpc.RemoteStub(channel).Attach(rpb.AttachRequest(peer_name="intruder"), timeout=5))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, (what, err.value)
        assert n.ask("stat")[:2] == (0, 0)
        client = RemoteTLS(pki["client_cert"], pki["client_key"], pki["ca"])
        without, good = run_in_child(child_read_each, _remote_blob(td_blob), [{}, {"tls": client}],
                                     timeout_s=TIMEOUT_S)
        assert without[0] == Unavailable.__name__
        assert np.array_equal(good, np.arange(512, dtype=np.int64))
        assert n.ask("settle", 5) is True


def test_secret_and_tls_options_are_checked_before_anything_starts():
    with pytest.raises(InvalidArgument, match="at least"):
        remote.remote_extension(secret="short")
    with pytest.raises(InvalidArgument, match="printable"):
        remote.remote_extension(secret=" padded secret value ")
    with pytest.raises(InvalidArgument, match="PEM"):
        RemoteTLS(b"not a certificate", b"-----BEGIN", b"-----BEGIN")
    with pytest.raises(InvalidArgument, match="RemoteTLS"):
        remote.remote_extension(tls=("cert", "key", "ca"))
    assert "KEY" not in repr(RemoteTLS(b"-----BEGIN C", b"-----BEGIN PRIVATE KEY", b"-----BEGIN C"))
