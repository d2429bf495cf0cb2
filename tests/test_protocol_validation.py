"""Issue 4: every validation rule of the features protocol, one test each (class AND reason)."""
from __future__ import annotations

import base64

import msgpack
import numpy as np
import pytest

from shmtransport.embedmask import EmbedMask, PlaceholderRange
from shmtransport.errors import IdentityMismatch, InvalidArgument, Reason, ResourceExhausted
from shmtransport.frontend import request as frontend
from shmtransport.protocol import routing
from shmtransport.protocol.envelope import decode_envelope
from shmtransport.protocol.items import FeatureItem, FieldConfig
from shmtransport.protocol.limits import Limits
from shmtransport.protocol.msgpack_kwargs import decode_kwargs_item, encode_kwargs_item, preflight
from shmtransport.protocol.validate import validate_request
from shmtransport.v1 import features_pb2 as fpb
from shmtransport.worker import request as worker


def invalid(match: str):
    return pytest.raises(InvalidArgument, match=match)


def assert_reason(excinfo, cls, reason):
    assert type(excinfo.value) is cls
    assert excinfo.value.reason is reason


def kw_b64(tensors=None, fields=None) -> str:
    tensors = tensors or {"pixel_values": np.arange(6, dtype=np.float32).reshape(2, 3)}
    return base64.b64encode(encode_kwargs_item(tensors, fields)).decode()


def envelope(**per_modality) -> dict:
    """{modality: [(hash, placeholder, kwargs_b64), ...]} -> envelope dict."""
    per_modality = per_modality or {"image": [("h0", [0, 4], kw_b64())]}
    env = {"mm_hashes": {}, "mm_placeholders": {}, "kwargs_data": {}}
    for modality, rows in per_modality.items():
        env["mm_hashes"][modality] = [r[0] for r in rows]
        env["mm_placeholders"][modality] = [r[1] for r in rows]
        env["kwargs_data"][modality] = [r[2] for r in rows]
    return env


def rejects(env, match, cls=InvalidArgument, reason=Reason.INVALID_ARGUMENT, **kw):
    with pytest.raises(cls, match=match) as excinfo:
        decode_envelope(env, **kw)
    assert_reason(excinfo, cls, reason)


def typed_request(n_items=1, mode="inline", modality="image", **kw) -> fpb.MultimodalRequest:
    items = [FeatureItem(modality, {"pixel_values": np.full((2, 2), i, np.float32)}, PlaceholderRange(10 * i, 4))
             for i in range(n_items)]
    return frontend.build_request(None, items, mode=mode, **kw).request


def request_rejects(req, match, cls=InvalidArgument, reason=Reason.INVALID_ARGUMENT, **kw):
    with pytest.raises(cls, match=match) as excinfo:
        validate_request(req, **kw)
    assert_reason(excinfo, cls, reason)


def over_limit(call, limit: int, field: str | None) -> None:
    """``call()`` is refused as over ``limit``, naming the request ``field`` that carries it."""
    with pytest.raises(ResourceExhausted) as excinfo:
        call()
    assert_reason(excinfo, ResourceExhausted, Reason.QUOTA_EXCEEDED)
    assert (excinfo.value.limit, excinfo.value.field) == (limit, field)


# -- envelope shape --------------------------------------------------------------------------------
def test_valid_envelope_decodes():
    items = decode_envelope(envelope(image=[("h", {"offset": 0, "length": 3, "is_embed": [True, False, True]},
                                                 kw_b64())]), prompt_len=3)
    assert items[0].placeholder.is_embed == EmbedMask.from_bools([True, False, True])
    assert items[0].kwargs["pixel_values"][:2] == ("float32", (2, 3))


def test_envelope_not_an_object():
    rejects([1, 2], "must be a JSON object")


def test_envelope_unknown_key():
    env = envelope()
    env["mm_metadata"] = {}
    rejects(env, "unknown \\['mm_metadata'\\]")


def test_envelope_missing_key():
    env = envelope()
    del env["kwargs_data"]
    rejects(env, "missing \\['kwargs_data'\\]")


def test_modality_key_sets_differ():
    env = envelope()
    env["kwargs_data"]["video"] = [kw_b64()]
    rejects(env, "modality key sets differ")


def test_per_modality_list_length_mismatch():
    env = envelope()
    env["mm_hashes"]["image"].append("h1")
    rejects(env, "lengths differ")


def test_empty_modality_map():
    rejects({"mm_hashes": {}, "mm_placeholders": {}, "kwargs_data": {}}, "empty modality map")


def test_modality_name_empty():
    rejects(envelope(**{"": [("h", [0, 1], kw_b64())]}), "non-empty")


def test_modality_name_too_long():
    rejects(envelope(**{"i" * 65: [("h", [0, 1], kw_b64())]}), "longer than 64 bytes")


def test_modality_name_unknown():
    rejects(envelope(pointcloud=[("h", [0, 1], kw_b64())]), "unknown modality 'pointcloud'")


def test_hash_empty():
    rejects(envelope(image=[("", [0, 1], kw_b64())]), "mm_hash must be a non-empty str")


def test_hash_too_long():
    rejects(envelope(image=[("h" * 513, [0, 1], kw_b64())]), "longer than 512 bytes")


def test_placeholder_offset_negative():
    rejects(envelope(image=[("h", [-1, 2], kw_b64())]), "offset must not be negative")


@pytest.mark.parametrize("offset", [1.5, "3", None])
def test_placeholder_offset_not_an_integer(offset):
    rejects(envelope(image=[("h", {"offset": offset, "length": 2}, kw_b64())]), "offset must be an integer")


def test_placeholder_offset_boolean():
    rejects(envelope(image=[("h", [True, 2], kw_b64())]), "offset must be an integer, got bool")


def test_placeholder_length_zero():
    rejects(envelope(image=[("h", [0, 0], kw_b64())]), "length must be > 0")


def test_placeholder_unknown_key():
    rejects(envelope(image=[("h", {"offset": 0, "length": 1, "mask": []}, kw_b64())]), "unknown placeholder keys")


def test_placeholder_offset_plus_length_overflows():
    rejects(envelope(image=[("h", [(1 << 64) - 1, 2], kw_b64())]), "overflows u64")


def test_placeholder_beyond_prompt():
    rejects(envelope(image=[("h", [8, 4], kw_b64())]), "exceeds the prompt", prompt_len=10)


def test_placeholders_overlap_across_modalities():
    env = envelope(image=[("h0", [0, 4], kw_b64()), ("h1", [20, 4], kw_b64())], audio=[("a", [3, 2], kw_b64())])
    rejects(env, "placeholders overlap: image\\[0\\] \\[0, 4\\) and audio\\[0\\]")


def test_is_embed_count_differs_from_length():
    rejects(envelope(image=[("h", {"offset": 0, "length": 3, "is_embed": [True, False]}, kw_b64())]),
            "is_embed has 2 entries but length is 3")


def test_is_embed_non_bool_entries():
    rejects(envelope(image=[("h", {"offset": 0, "length": 2, "is_embed": [1, 0]}, kw_b64())]), "list of booleans")


def test_typed_is_embed_bit_count_differs_from_length():
    req = typed_request()
    ph = req.batches[0].items[0].placeholder
    ph.is_embed, ph.is_embed_nbits = b"\xe0", 3
    req.batches[0].ClearField("mm_placeholders")
    request_rejects(req, "is_embed has 3 bits but length is 4")


def test_raw_media_mixed_with_features_envelope():
    rejects(envelope(), "cannot be mixed", has_raw_media=True)


def test_raw_media_mixed_with_features_typed():
    req = typed_request()
    req.raw_media.add(modality=fpb.MODALITY_IMAGE, url="https://example.com/a.png")
    request_rejects(req, "cannot be mixed")


def test_routing_markers_without_features():
    rejects(None, "without preprocessed features", routing_markers=["a" * 16 + "0" * 48])


def test_routing_marker_count_differs_from_item_count():
    rejects(envelope(), "2 routing markers for 1 items", routing_markers=["a" * 16 + "0" * 48] * 2)


def test_routing_marker_not_matching_payload_frontend():
    items = decode_envelope(envelope(), routing_markers=["a" * 16 + "0" * 48])
    with pytest.raises(IdentityMismatch, match="does not match the payload") as excinfo:
        frontend.build_request(None, items, mode="inline")
    assert_reason(excinfo, IdentityMismatch, Reason.IDENTITY_MISMATCH)


def test_routing_marker_not_matching_payload_worker():
    req = typed_request(with_markers=True)
    item = req.batches[0].items[0]
    item.mm_hash = ""
    item.cache_identifier = ""
    req.batches[0].ClearField("mm_hashes")
    item.routing_marker = "b" * 16 + "0" * 48
    with pytest.raises(IdentityMismatch, match="does not match the payload") as excinfo:
        worker.open_request(None, req)
    assert_reason(excinfo, IdentityMismatch, Reason.IDENTITY_MISMATCH)


def test_routing_marker_malformed():
    req = typed_request()
    req.batches[0].items[0].routing_marker = "xyz"
    request_rejects(req, "is not 16 lowercase hex")


def test_cache_only_features_rejected_envelope():
    rejects(envelope(image=[("h", [0, 1], None)]), "cache-only references are not enabled")


def test_cache_only_features_rejected_typed():
    req = typed_request()
    req.batches[0].items[0].ClearField("kwargs")
    request_rejects(req, "cache-only reference")


def test_cache_only_features_allowed_when_enabled():
    items = decode_envelope(envelope(image=[("h", [0, 1], None)]), limits=Limits(allow_cache_only=True))
    assert items[0].kwargs == {} and items[0].mm_hash == "h"


# -- tensors ---------------------------------------------------------------------------------------
def raw_item(data, field=("batched", {"keep_on_cpu": False}), key="pixel_values") -> bytes:
    return msgpack.packb({key: {"data": data, "field": list(field)}}, use_bin_type=True)


def test_dtype_outside_vllm_list_msgpack():
    with invalid("dtype 'complex64' is not one of vLLM's 13 dtypes") as excinfo:
        decode_kwargs_item(raw_item(["complex64", [1], msgpack.ExtType(3, b"\0" * 8)]))
    assert_reason(excinfo, InvalidArgument, Reason.INVALID_ARGUMENT)


def test_dtype_outside_vllm_list_typed():
    req = typed_request()
    req.batches[0].items[0].kwargs["pixel_values"].tensor.dtype = "float8_e4m3fn"
    request_rejects(req, "dtype 'float8_e4m3fn' is not one of vLLM's 13 dtypes")


def test_rank_above_32_msgpack():
    with invalid("rank 33 exceeds 32") as excinfo:
        decode_kwargs_item(raw_item(["uint8", [1] * 33, msgpack.ExtType(3, b"\0")]))
    assert_reason(excinfo, InvalidArgument, Reason.INVALID_ARGUMENT)


def test_rank_above_32_typed():
    req = typed_request()
    t = req.batches[0].items[0].kwargs["pixel_values"].tensor
    del t.shape[:]
    t.shape.extend([1] * 31 + [4, 4])
    request_rejects(req, "rank 33 exceeds 32")


def test_byte_length_differs_from_numel_times_itemsize_msgpack():
    with invalid("7 bytes but float32\\[2\\] needs 8") as excinfo:
        decode_kwargs_item(raw_item(["float32", [2], msgpack.ExtType(3, b"\0" * 7)]))
    assert_reason(excinfo, InvalidArgument, Reason.INVALID_ARGUMENT)


def test_byte_length_differs_from_numel_times_itemsize_typed():
    req = typed_request()
    req.batches[0].items[0].kwargs["pixel_values"].tensor.inline = b"\0" * 15
    request_rejects(req, "15 inline bytes but float32\\[2, 2\\] needs 16")


def test_handle_nbytes_differs_from_manifest():
    req = typed_request()
    t = req.batches[0].items[0].kwargs["pixel_values"].tensor
    t.shm.name, t.shm.nbytes = "seg", 20
    request_rejects(req, "handle nbytes 20 != manifest float32\\[2, 2\\] \\(16 bytes\\)")


@pytest.mark.parametrize("bad", [".", "..", "a/b", "a\\b", "a\0b"])
def test_unsafe_uuid_rejected(bad):
    req = typed_request()
    req.batches[0].items[0].mm_hash = bad
    req.batches[0].ClearField("mm_hashes")
    request_rejects(req, "unsafe")


@pytest.mark.parametrize("bad", [".", "..", "a/b", "a\\b", "a\0b"])
def test_unsafe_forwarded_uuid_rejected(bad):
    with invalid("must start with 16 hex characters") as excinfo:  # Dynamo's worker rule
        routing.forwarded_mm_uuids({"mm_hashes_by_modality": {"image": [bad]}})
    assert_reason(excinfo, InvalidArgument, Reason.INVALID_ARGUMENT)


# -- MessagePack preflight -------------------------------------------------------------------------
def msgpack_rejects(raw, match, **limits):
    with invalid(match) as excinfo:
        decode_kwargs_item(raw, Limits(**limits))
    assert_reason(excinfo, InvalidArgument, Reason.INVALID_ARGUMENT)


def test_msgpack_depth_above_32():
    nested = 0
    for _ in range(33):
        nested = [nested]
    msgpack_rejects(msgpack.packb(nested), "nesting deeper than 32")
    deep_ok = 0
    for _ in range(32):
        deep_ok = [deep_ok]
    preflight(msgpack.packb(deep_ok))  # exactly 32 passes the preflight


def test_msgpack_more_than_65536_nodes():
    msgpack_rejects(msgpack.packb([0] * 65_536), "more than 65536 nodes")
    assert preflight(msgpack.packb([0] * 65_535)) == 65_536


def test_msgpack_trailing_bytes():
    msgpack_rejects(encode_kwargs_item({"x": np.zeros(2, np.uint8)}) + b"\xc0", "1 trailing bytes")


def test_msgpack_reserved_marker_c1():
    msgpack_rejects(b"\x91\xc1", "reserved marker 0xC1")


def test_msgpack_truncated():
    msgpack_rejects(encode_kwargs_item({"x": np.zeros(4, np.uint8)})[:-2], "truncated")


def test_msgpack_ext_type_must_be_3():
    msgpack_rejects(raw_item(["uint8", [1], msgpack.ExtType(1, b"\0")]), "ext type 1 is not allowed")


def test_msgpack_aux_frame_index_rejected():
    msgpack_rejects(raw_item(["uint8", [4], 0]), "aux-frame index")


def test_msgpack_field_without_data():
    msgpack_rejects(raw_item(None), "carries no data")


def test_msgpack_empty_item():
    msgpack_rejects(msgpack.packb({}), "1..256 fields")


def test_msgpack_never_unpickles():
    import pickle

    msgpack_rejects(raw_item(["uint8", [1], msgpack.ExtType(2, pickle.dumps(object))]), "pickle is never accepted")


# -- field metadata (vLLM validate_mm_field_metadata) -----------------------------------------------
def test_flat_slice_step_zero():
    msgpack_rejects(raw_item(["uint8", [2], msgpack.ExtType(3, b"\0\0")],
                             ("flat", {"keep_on_cpu": False, "slices": [[0, 2, 0]], "dim": 0})), "step must not be 0")


def test_flat_dim_outside_rank():
    msgpack_rejects(raw_item(["uint8", [2], msgpack.ExtType(3, b"\0\0")],
                             ("flat", {"keep_on_cpu": False, "slices": [[0, 2, None]], "dim": 1})), "outside")


def test_shared_batch_size_differs_from_occurrences():
    items = [FeatureItem("image", {"x": np.zeros(2, np.uint8)}, PlaceholderRange(4 * i, 2),
                         {"x": FieldConfig("shared", batch_size=3)}) for i in range(2)]
    req = frontend.build_request(None, items, mode="inline").request
    request_rejects(req, "shared batch_size 3 != 2 items")


def test_flat_slice_count_differs_from_occurrences():
    items = [FeatureItem("image", {"x": np.zeros(2, np.uint8)}, PlaceholderRange(0, 2),
                         {"x": FieldConfig("flat", slices=(slice(0, 2), slice(2, 4)))})]
    req = frontend.build_request(None, items, mode="msgpack").request
    request_rejects(req, "flat has 2 slices for 1 items")


def test_field_configs_differ_across_items():
    items = [FeatureItem("image", {"x": np.zeros(2, np.uint8)}, PlaceholderRange(4 * i, 2),
                         {"x": FieldConfig("batched", keep_on_cpu=bool(i))}) for i in range(2)]
    req = frontend.build_request(None, items, mode="inline").request
    request_rejects(req, "different field configs")


# -- limits ----------------------------------------------------------------------------------------
def test_inline_item_count_limit():
    env = envelope(image=[(f"h{i}", [2 * i, 1], kw_b64()) for i in range(65)])
    over_limit(lambda: decode_envelope(env), 64, None)  # the envelope's fields are JSON keys, not a request's


def test_inline_typed_item_count_limit():
    req = typed_request(n_items=64)
    validate_request(req)
    extra = req.batches[0].items.add()
    extra.CopyFrom(req.batches[0].items[0])
    extra.placeholder.offset = 1000
    req.batches[0].ClearField("mm_hashes")
    req.batches[0].ClearField("mm_placeholders")
    over_limit(lambda: validate_request(req), 64, "batches[0].items[64]")


def test_inline_aggregate_bytes_limit_16_mib():
    req = typed_request()
    t = req.batches[0].items[0].kwargs["pixel_values"].tensor
    del t.shape[:]
    t.shape.extend([(16 << 20) // 4 + 1])
    t.inline = bytes(16 * (1 << 20) + 4)
    over_limit(lambda: validate_request(req), 16 << 20, "batches[0].items[0].kwargs")


def test_inline_envelope_bytes_limit():
    big = kw_b64({"x": np.zeros(600, np.uint8)})
    env = envelope(image=[("h0", [0, 1], big), ("h1", [1, 1], big)])
    over_limit(lambda: decode_envelope(env, limits=Limits(max_inline_bytes=1000)), 1000, None)


def test_shm_path_has_no_16_mib_cap_and_its_own_byte_limit():
    req = typed_request()
    t = req.batches[0].items[0].kwargs["pixel_values"].tensor
    del t.shape[:]
    t.shape.extend([64 << 20])
    t.shm.name, t.shm.nbytes = "seg", 256 << 20  # float32[64 Mi] = 256 MiB through shm: accepted
    validate_request(req)
    over_limit(lambda: validate_request(req, limits=Limits(max_shm_bytes=1 << 20)), 1 << 20,
               "batches[0].items[0].kwargs")


def test_shm_item_count_limit_configurable():
    req = typed_request(n_items=3)
    over_limit(lambda: validate_request(req, limits=Limits(max_items=2)), 2, "batches[0].items")


# -- typed request structure -----------------------------------------------------------------------
def test_typed_modality_unspecified():
    req = typed_request()
    req.batches[0].modality = fpb.MODALITY_UNSPECIFIED
    request_rejects(req, "modality must be IMAGE, VIDEO or AUDIO")


def test_typed_two_batches_of_one_modality():
    req = typed_request()
    req.batches.add().CopyFrom(req.batches[0])
    request_rejects(req, "one batch per modality")


def test_typed_mm_hash_of_another_scheme():
    req = typed_request()
    req.batches[0].items[0].mm_hash = "blake3:" + "0" * 64
    req.batches[0].ClearField("mm_hashes")
    request_rejects(req, "not a xxh3-128 identity")


def test_typed_cache_identifier_not_derived_from_mm_hash():
    req = typed_request(adapter="lora1")
    item = req.batches[0].items[0]
    assert item.cache_identifier == "lora1:" + item.mm_hash
    item.cache_identifier = "lora2:" + item.mm_hash
    request_rejects(req, "cache_identifier")


def test_typed_overlap_across_batches():
    items = [FeatureItem("image", {"x": np.zeros(1, np.uint8)}, PlaceholderRange(0, 4)),
             FeatureItem("video", {"x": np.zeros(1, np.uint8)}, PlaceholderRange(8, 4))]
    req = frontend.build_request(None, items, mode="inline").request
    req.batches[1].items[0].placeholder.offset = 2
    req.batches[1].ClearField("mm_placeholders")
    request_rejects(req, "placeholders overlap")


def test_typed_beyond_prompt():
    req = typed_request(prompt_len=4)
    validate_request(req)
    request_rejects(req, "exceeds the prompt", prompt_len=3)


def test_remote_transport_not_served():
    req = typed_request()
    req.batches[0].items[0].kwargs["pixel_values"].tensor.remote.transport = "nixl"
    request_rejects(req, "remote tensor transport 'nixl' is not served")
