"""The C reader and writer of the ``TensorHandle`` wire form (``handle_wire``) against protobuf's:
what the C reader accepts, protobuf reads the same from and writes back byte for byte; what
protobuf writes, the C reader accepts (within its subset) and the C writer writes identically.
Random messages and random bytes (mutations of real encodings, truncations, noise). The wire
functions need the C kernels; without them ``handle_wire`` answers None and protobuf parses."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmtransport import handle_wire
from shmtransport.handle import Handle
from shmtransport.tensors import DTYPE_ITEMSIZE
from shmtransport.v1 import daemon_pb2 as pb

pytestmark = pytest.mark.skipif(handle_wire.lib is None, reason="the wire reader and writer are C kernels")

U64 = st.integers(0, 2**64 - 1)
ASCII = st.text(st.characters(max_codepoint=127), max_size=300)
DTYPES = st.sampled_from(sorted(DTYPE_ITEMSIZE)) | ASCII


@st.composite
def messages(draw: st.DrawFn, ascii_only: bool = True) -> pb.TensorHandle:
    text = ASCII if ascii_only else st.text(max_size=20)
    shm = pb.Handle(name=draw(text), offset=draw(U64), nbytes=draw(U64), owner_id=draw(text),
                    generation=draw(U64), instance_id=draw(text), slot=draw(st.integers(0, 2**32 - 1)))
    return pb.TensorHandle(shm=shm, dtype=draw(DTYPES if ascii_only else text),
                           shape=draw(st.lists(U64, max_size=32)), digest=draw(st.binary(max_size=32)),
                           commit_token=draw(st.binary(max_size=24)))


def _fields_of(msg: pb.TensorHandle) -> handle_wire.WireFields:
    s = msg.shm
    where = handle_wire.Where(s.name, s.offset, s.nbytes, s.owner_id, s.generation, s.instance_id, s.slot)
    return handle_wire.WireFields(where, msg.dtype, tuple(msg.shape), msg.digest, msg.commit_token)


def _write(f: handle_wire.WireFields) -> bytes | None:
    w = f.where
    return handle_wire.write(w.name.encode(), w.offset, w.nbytes, w.owner_id.encode(), w.generation,
                             w.instance_id.encode(), w.slot, f.dtype.encode(), f.shape, f.digest, f.commit_token)


@settings(max_examples=250, deadline=None)
@given(messages())
def test_what_protobuf_writes_the_c_reader_reads_and_the_c_writer_writes_alike(msg: pb.TensorHandle) -> None:
    data = msg.SerializeToString()
    assert handle_wire.parse(data) == _fields_of(msg)
    assert _write(_fields_of(msg)) == data


def _mutations(data: bytes) -> st.SearchStrategy[bytes]:
    n = len(data)
    return st.one_of(
        st.integers(0, n).map(lambda i: data[:i]),
        st.tuples(st.integers(0, max(n - 1, 0)), st.integers(0, 255)).map(
            lambda p: data[:p[0]] + bytes([p[1]]) + data[p[0] + 1:]),
        st.tuples(st.integers(0, n), st.binary(min_size=1, max_size=4)).map(lambda p: data[:p[0]] + p[1] + data[p[0]:]),
        st.tuples(st.integers(0, n), st.integers(1, 4)).map(lambda p: data[:p[0]] + data[p[0] + p[1]:]),
    )


def _protobuf_reads_the_same(data: bytes) -> None:
    fields = handle_wire.parse(data)
    if fields is None:
        return  # protobuf decides, whatever it decides
    msg = pb.TensorHandle.FromString(data)  # must not raise: the C reader accepted it
    assert _fields_of(msg) == fields
    assert msg.SerializeToString() == data  # exactly what protobuf writes: a cached wire form is canonical


@settings(max_examples=500, deadline=None)
@given(st.data())
def test_what_the_c_reader_accepts_protobuf_reads_alike_and_writes_back_unchanged(data: st.DataObject) -> None:
    original = data.draw(messages(ascii_only=False)).SerializeToString()
    _protobuf_reads_the_same(data.draw(_mutations(original)))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_noise_is_read_alike_or_left_to_protobuf(data: bytes) -> None:
    _protobuf_reads_the_same(data)


@pytest.mark.parametrize("data", [
    pb.TensorHandle(shm=pb.Handle(name="é")).SerializeToString(),  # a string of more than ASCII
    pb.TensorHandle(shape=list(range(33))).SerializeToString(),  # more dims than the C reader keeps
    bytes.fromhex("0a00") * 2,  # shm twice: protobuf merges
    bytes.fromhex("1a0102") + bytes.fromhex("0a00"),  # fields out of order
    bytes.fromhex("1801"),  # shape unpacked
    bytes.fromhex("0a021000"),  # an explicit zero
    bytes.fromhex("0a03108000"),  # a varint longer than it needs
    bytes.fromhex("0a00f80100"),  # an unknown field
])
def test_valid_forms_outside_the_subset_go_to_protobuf_and_read_the_same(data: bytes) -> None:
    assert handle_wire.parse(data) is None
    msg = pb.TensorHandle.FromString(data)
    handle = Handle.from_bytes(data)
    assert (handle.shm, handle.dtype, handle.shape) == (msg.shm, msg.dtype, tuple(msg.shape))


def test_the_c_kernels_know_the_dtypes_tensors_knows_and_no_other() -> None:
    assert {name: handle_wire.dtype_itemsize(name) for name in DTYPE_ITEMSIZE} == DTYPE_ITEMSIZE
    for other in ("", "float", "float322", "Float32", "bfloat", "complex64", "float32\x00"):
        assert handle_wire.dtype_itemsize(other) == 0


def test_a_handle_read_from_the_wire_builds_its_message_only_when_asked_and_writes_the_same_bytes() -> None:
    shm = pb.Handle(name="shmt-x", offset=4096, nbytes=24, owner_id="s", generation=3, instance_id="i", slot=7)
    wire = Handle(shm, "float32", (2, 3), digest=b"d" * 16).to_bytes()
    handle = Handle.from_bytes(wire)
    assert handle._shm is None and handle.to_bytes() == wire
    assert (handle.nbytes, handle.dtype, handle.shape, handle.digest) == (24, "float32", (2, 3), b"d" * 16)
    assert handle.shm == shm and handle == Handle.from_proto(pb.TensorHandle.FromString(wire))
    signed = handle.with_digest(b"e" * 16)
    assert signed.digest == b"e" * 16 and handle.digest == b"d" * 16 and signed.shm == shm
    with pytest.raises(AttributeError):
        handle.digest = b""  # type: ignore[misc]
