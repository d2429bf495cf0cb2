"""Issue 4: the vllm_tito.features envelope, vLLM's kwargs MessagePack, routing markers and metadata."""
from __future__ import annotations

import base64
import json

import msgpack
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from shmtransport.embedmask import EmbedMask, PlaceholderRange
from shmtransport.errors import IdentityMismatch, InvalidArgument, Reason, ResourceExhausted
from shmtransport.frontend import request as frontend
from shmtransport.identity import combine, grpc_mm_identity, item_identity, tensor_digest
from shmtransport.protocol import routing
from shmtransport.protocol.items import FeatureItem, FieldConfig
from shmtransport.protocol.limits import Limits
from shmtransport.protocol.msgpack_kwargs import decode_kwargs_item, encode_kwargs_item, preflight
from shmtransport.worker import request as worker


def test_decodes_vllm_reference_bytes():
    """The exact bytes vLLM's MsgpackEncoder emits (protocol-facts 3.3)."""
    raw = msgpack.packb({"pixel_values": {"data": ["float32", [2], msgpack.ExtType(3, np.float32([1, 2]).tobytes())],
                                          "field": ["flat", {"keep_on_cpu": False, "slices": [[0, 2, None]],
                                                             "dim": 0}]}}, use_bin_type=True)
    d = decode_kwargs_item(raw)
    dtype, shape, data = d.tensors["pixel_values"]
    assert (dtype, shape) == ("float32", (2,)) and np.frombuffer(data, np.float32).tolist() == [1, 2]
    assert d.fields["pixel_values"] == FieldConfig("flat", False, (slice(0, 2, None),), 0)
    assert encode_kwargs_item({"pixel_values": np.float32([1, 2])},
                              {"pixel_values": FieldConfig("flat", slices=(slice(0, 2),))}) == raw


def test_decoded_tensors_are_zero_copy_views_of_the_payload():
    """msgpack copies ext payloads it hands to ext_hook; the skeleton decode avoids that."""
    raw = encode_kwargs_item({"a": np.arange(300, dtype=np.int64), "b": np.ones(3, np.uint8),
                              "c": np.zeros(0, np.float32), "d": np.int16([7])})  # ext32/ext8/fixext forms
    d = decode_kwargs_item(raw)
    for key, (_, _, data) in d.tensors.items():
        assert data.obj is raw, key
    assert np.frombuffer(d.tensors["a"][2], np.int64).tolist() == list(range(300))
    assert np.frombuffer(d.tensors["d"][2], np.int16).tolist() == [7]


def test_int_float_and_list_data_decode_into_values_not_tensors():
    """vLLM's NestedTensors: field data may be an int, a float or a list (of tensors, numbers, lists)."""
    raw = encode_kwargs_item({"n": 3, "pixel_values": np.ones(2, np.float32),
                              "frames": [np.zeros(1, np.uint8), 0.5, []]})
    d = decode_kwargs_item(raw)
    assert list(d.values) == ["n", "pixel_values", "frames"] and list(d.tensors) == ["pixel_values"]
    assert d.values["n"] == 3 and d.values["frames"][1:] == [0.5, []] and d.non_tensor_keys == ["n", "frames"]
    dtype, shape, data = d.values["frames"][0]
    assert (dtype, shape) == ("uint8", (1,)) and data.obj is raw  # list tensors are zero-copy views too
    assert d.nbytes == 8 + 1 and set(d.fields) == set(d.values)


def _raw(data, field=("batched", {"keep_on_cpu": False})):
    return msgpack.packb({"k": {"data": data, "field": list(field)}}, use_bin_type=True)


@pytest.mark.parametrize("data,match", [
    ([1.5, None], "nil is not a tensor, int, float or list"), ([1, "x"], "str data"), ("x", "str data"),
    ({"a": 1}, "dict data"), (b"raw", "bytes data"), (msgpack.ExtType(3, b"\0"), "bare Ext"),
    (["float32", [1]], "a tensor must be"), ([["float32", [2], msgpack.ExtType(3, b"\0" * 7)]], "needs 8"),
    ([[["uint8", [1], 0]]], "aux-frame index"), ([["complex64", [1], msgpack.ExtType(3, b"\0" * 8)]], "dtype"),
])
def test_malformed_non_tensor_data_gets_a_typed_error(data, match):
    with pytest.raises(InvalidArgument, match=match):
        decode_kwargs_item(_raw(data))


def test_non_tensor_data_needs_flat_dim_0_and_the_depth_limit_holds():
    with pytest.raises(InvalidArgument, match="non-tensor data"):
        decode_kwargs_item(_raw([1, 2], ("flat", {"keep_on_cpu": False, "slices": [[0, 1, None]], "dim": 1})))
    assert decode_kwargs_item(
        _raw([1, 2], ("flat", {"keep_on_cpu": False, "slices": [], "dim": 0}))).values == {"k": [1, 2]}
    nested = 1
    for _ in range(40):
        nested = [nested]
    with pytest.raises(InvalidArgument, match="nesting deeper than 32"):
        decode_kwargs_item(_raw(nested))


@pytest.mark.parametrize("value", [True, None, 1 << 63, np.int64(3), "text", {"a": 1}, ("float32", (2,), b"\0")])
def test_encoder_refuses_what_the_gateway_cannot_carry(value):
    with pytest.raises(InvalidArgument):
        encode_kwargs_item({"k": value})


def _env(raw: bytes, n: int = 1) -> dict:
    return {"mm_hashes": {"image": [f"{i:016x}" for i in range(n)]},
            "mm_placeholders": {"image": [[4 * i, 2] for i in range(n)]},
            "kwargs_data": {"image": [base64.b64encode(raw).decode()] * n}}


@pytest.mark.parametrize("scheme,mode", [("xxh3-128", "inline"), ("blake3", "msgpack"), ("grpc-mm", "msgpack")])
def test_non_tensor_data_is_carried_to_the_engine_with_its_exact_bytes(scheme, mode):
    raw = encode_kwargs_item({"pixel_values": np.ones(2, np.float32), "num_crops": 2,
                              "frames": [np.int16([5]), 0.5], "sizes": []})
    built = frontend.request_from_envelope(None, _env(raw), scheme=scheme, mode=mode)
    item = built.request.batches[0].items[0]
    assert item.kwargs_msgpack == raw and not item.kwargs  # a typed Kwarg holds one tensor: the bytes travel
    with worker.open_request(None, built.request) as inputs:  # verify="always": identity recomputed
        kw = inputs.mm_kwargs["image"][0]
        assert list(kw) == ["pixel_values", "num_crops", "frames", "sizes"]
        assert kw["num_crops"] == 2 and kw["frames"][1] == 0.5 and kw["sizes"] == []
        assert kw["frames"][0].tolist() == [5] and kw["pixel_values"].tolist() == [1.0, 1.0]
        assert inputs.mm_hashes["image"] == [item.mm_hash]


def test_an_identity_not_covering_non_tensor_data_is_refused_by_the_worker():
    raw = encode_kwargs_item({"pixel_values": np.ones(2, np.float32), "num_crops": 2})
    built = frontend.request_from_envelope(None, _env(raw), mode="msgpack")
    item = built.request.batches[0].items[0]
    assert item.mm_hash != item_identity("image", {"pixel_values": np.ones(2, np.float32)})
    item.kwargs_msgpack = encode_kwargs_item({"pixel_values": np.ones(2, np.float32), "num_crops": 3})
    with pytest.raises(IdentityMismatch):
        worker.open_request(None, built.request)


def test_non_tensor_items_keep_the_inline_limits():
    raw = encode_kwargs_item({"n": 1})
    with pytest.raises(ResourceExhausted, match="max_inline_items"):
        frontend.request_from_envelope(None, _env(raw, 3), mode="inline", limits=Limits(max_inline_items=2))
    with pytest.raises(ResourceExhausted, match="max_inline_bytes"):
        frontend.build_request(None, [FeatureItem("image", {"n": 1}, PlaceholderRange(0, 2))], mode="inline",
                               limits=Limits(max_inline_bytes=len(raw) - 1))


def test_items_with_non_tensor_data_keep_one_field_layout_per_key():
    one = encode_kwargs_item({"n": 1})
    two = encode_kwargs_item({"n": 2}, {"n": FieldConfig("batched", keep_on_cpu=True)})
    env = _env(one, 2)
    env["kwargs_data"]["image"][1] = base64.b64encode(two).decode()
    built = frontend.request_from_envelope(None, env, mode="msgpack")
    with pytest.raises(InvalidArgument, match="image.n: items use different field configs"):
        worker.open_request(None, built.request)


@pytest.mark.parametrize("scheme", ["xxh3-128", "blake3"])
def test_identity_tells_non_tensor_data_apart(scheme):
    t = np.int64([1])
    distinct = [1, True, 1.0, [1], [t], t, -0.0, 0.0, 1 << 63, -(1 << 63), [], [[]], [1, [2]], [[1], 2]]
    ids = [item_identity("image", {"k": v}, scheme) for v in distinct]
    assert len(set(ids)) == len(distinct)
    same = [((1,), [1]), ((t, t), [t, t]), (("int64", (1,), t.tobytes()), t)]  # vLLM writes tuples as lists
    for a, b in same:
        assert item_identity("image", {"k": a}, scheme) == item_identity("image", {"k": b}, scheme)
    assert ids[5] == combine(scheme, "image", [("k", "int64", (1,), 8, tensor_digest(scheme, t))])  # unchanged
    for bad in ("x", None, {"a": 1}, 1 << 64, [1, "x"]):
        with pytest.raises(InvalidArgument):
            item_identity("image", {"k": bad}, scheme)


_dtypes = st.sampled_from(["bool", "uint8", "int8", "float16", "bfloat16", "uint16", "int16", "float32", "uint32",
                           "int32", "float64", "uint64", "int64"])
_tensor = st.tuples(_dtypes, st.lists(st.integers(0, 3), max_size=3), st.randoms(use_true_random=False))


def _mk(dtype, shape, rnd):
    from shmtransport.tensors import DTYPE_ITEMSIZE

    n = int(np.prod(shape, dtype=np.int64)) * DTYPE_ITEMSIZE[dtype]
    raw = bytes(rnd.getrandbits(8) for _ in range(n))
    if dtype == "bool":
        raw = bytes(b & 1 for b in raw)
    return (dtype, tuple(shape), raw)


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.text("abcxyz_", min_size=1, max_size=6), _tensor, min_size=1, max_size=4))
def test_msgpack_round_trip_and_identity(spec):
    tensors = {k: _mk(*v) for k, v in spec.items()}
    raw = encode_kwargs_item(tensors)
    assert preflight(raw) > 0
    d = decode_kwargs_item(raw)
    assert {k: (t[0], t[1], bytes(t[2])) for k, t in d.tensors.items()} == tensors
    assert item_identity("audio", d.tensors) == item_identity("audio", tensors)


def test_envelope_to_typed_request_and_identity_fused():
    img = {"pixel_values": np.arange(12, dtype=np.float32).reshape(3, 4), "image_grid_thw": np.int64([[1, 2, 2]])}
    env = {"mm_hashes": {"image": ["vllm-blake3-hash"]},
           "mm_placeholders": {"image": [{"offset": 2, "length": 4, "is_embed": [False, True, True, False]}]},
           "kwargs_data": {"image": [base64.b64encode(encode_kwargs_item(img)).decode()]}}
    built = frontend.request_from_envelope(None, json.dumps(env), prompt_len=8, mode="inline")
    item = built.request.batches[0].items[0]
    assert item.mm_hash == item_identity("image", img)  # the producer's foreign hash is not trusted
    assert item.placeholder.is_embed_nbits == 4 and item.placeholder.is_embed == bytes([0b01100000])


def test_envelope_with_our_identity_is_verified():
    img = {"x": np.zeros(3, np.uint8)}
    good = item_identity("image", img)
    env = {"mm_hashes": {"image": [good]}, "mm_placeholders": {"image": [[0, 1]]},
           "kwargs_data": {"image": [base64.b64encode(encode_kwargs_item(img)).decode()]}}
    frontend.request_from_envelope(None, env, mode="inline")
    env["mm_hashes"]["image"] = ["xxh3-128:" + "0" * 32]
    with pytest.raises(IdentityMismatch) as excinfo:
        frontend.request_from_envelope(None, env, mode="inline")
    assert excinfo.value.reason is Reason.IDENTITY_MISMATCH


def test_grpc_mm_scheme_over_the_exact_msgpack_bytes():
    raw = encode_kwargs_item({"pixel_values": np.ones(4, np.float16)})
    items = [FeatureItem("image", {}, PlaceholderRange(0, 2), kwargs_msgpack=raw)]
    req = frontend.build_request(None, items, mode="msgpack", scheme="grpc-mm", adapter="lora").request
    it = req.batches[0].items[0]
    assert it.mm_hash == grpc_mm_identity("image", raw) and it.cache_identifier == "lora:" + it.mm_hash
    with worker.open_request(None, req) as ei:
        assert ei.identities == {"image": [it.mm_hash]}
        assert ei.mm_identifiers == {"image": ["lora:" + it.mm_hash]}


# -- routing markers and metadata ------------------------------------------------------------------
def test_routing_marker_recipe():
    ident = "xxh3-128:0123456789abcdef0123456789abcdef"
    assert routing.hash_mm_identifier(ident) == xxhash.xxh3_64_intdigest(ident.encode())
    hex64 = "ab" * 32
    assert routing.hash_mm_identifier(hex64) == int(hex64[:16], 16)
    assert routing.hash_mm_identifier("") is None
    marker = routing.routing_marker(ident)
    assert marker == format(xxhash.xxh3_64_intdigest(ident.encode()), "016x") + "0" * 48 and len(marker) == 64
    assert routing.hash_mm_identifier(marker) == int(marker[:16], 16)  # the marker maps to the same u64
    assert routing.pad_value(marker) == routing.pad_value(ident)


def _items(modalities):
    return [FeatureItem(m, {"x": np.full(2, i, np.uint8)},
                        PlaceholderRange(10 * i, 3, EmbedMask.from_bools([True, False, True]) if i % 2 else None))
            for i, m in enumerate(modalities)]


def test_image_only_request_emits_legacy_flat_fields():
    req = frontend.build_request(None, _items(["image", "image"]), mode="inline").request
    meta = frontend.routing_metadata(req)
    hashes = [routing.routing_marker(it.mm_hash) for it in req.batches[0].items]  # markers, not identities
    assert meta["mm_hashes_by_modality"] == {"image": hashes} and meta["mm_hashes"] == hashes
    assert meta["mm_placeholders"] == [[0, 3], {"offset": 10, "length": 3, "is_embed": [True, False, True]}]
    assert meta["mm_placeholders_by_modality"] == {"image": meta["mm_placeholders"]}
    assert routing.forwarded_mm_uuids({"mm_hashes": hashes}) == {"image": hashes}
    assert routing.forwarded_mm_uuids({"mm_hashes": hashes}, unified_vision=True) == {"vision_chunk": hashes}
    assert "mm_hashes" not in frontend.routing_metadata(req, exact=False)  # token-only routing: no hashes


def test_mixed_request_does_not_emit_legacy_flat_fields():
    req = frontend.build_request(None, _items(["image", "video", "audio"]), mode="inline").request
    meta = frontend.routing_metadata(req)
    assert meta["mm_hashes"] == [] and meta["mm_placeholders"] == []  # as Dynamo's frontend sends them
    assert set(meta["mm_hashes_by_modality"]) == {"image", "video", "audio"}
    uuids = routing.forwarded_mm_uuids(meta, unified_vision=True)
    hashes_a = meta["mm_hashes_by_modality"]["audio"][0]
    assert set(uuids) == {"vision_chunk", "video", "audio"}
    assert routing.forwarded_mm_uuids({"mm_hashes_by_modality": {"image": [], "audio": [hashes_a]}}) == \
        {"audio": [hashes_a]}


def test_markers_set_on_request_and_checked_by_worker():
    req = frontend.build_request(None, _items(["image"]), mode="inline", with_markers=True).request
    it = req.batches[0].items[0]
    assert it.routing_marker == routing.routing_marker(it.mm_hash)
    with worker.open_request(None, req) as ei:
        assert ei.routing_markers == {"image": [it.routing_marker]}
