"""Issue 4: features.proto wire compatibility with smg-grpc-proto, and proto round trips."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmtransport.embedmask import EmbedMask, PlaceholderRange
from shmtransport.frontend import request as frontend
from shmtransport.protocol.items import FeatureItem, FieldConfig
from shmtransport.protocol.validate import validate_request
from shmtransport.v1 import daemon_pb2 as dpb
from shmtransport.v1 import features_pb2 as fpb

smg = pytest.importorskip("smg_grpc_proto.generated.vllm_engine_pb2")
smg_common = pytest.importorskip("smg_grpc_proto.generated.common_pb2")


def test_modality_numbers_match_smg_common():
    for name in ("IMAGE", "AUDIO", "VIDEO"):
        assert fpb.Modality.Value(f"MODALITY_{name}") == smg_common.Modality.Value(name)
    assert fpb.MODALITY_UNSPECIFIED == smg_common.MODALITY_UNSPECIFIED


def test_tensor_data_shm_ours_parsed_by_smg():
    ours = fpb.TensorData(shape=[2, 3], dtype="bfloat16", digest=b"d" * 16, commit_token=b"t",
                          shm=dpb.Handle(name="seg", offset=64, nbytes=12, owner_id="o", generation=9, instance_id="i"))
    theirs = smg.TensorData.FromString(ours.SerializeToString())
    assert theirs.WhichOneof("payload") == "shm"
    assert (list(theirs.shape), theirs.dtype) == ([2, 3], "bfloat16")
    assert (theirs.shm.name, theirs.shm.offset, theirs.shm.nbytes, theirs.shm.owner_id) == ("seg", 64, 12, "o")
    assert fpb.TensorData.FromString(theirs.SerializeToString()) == ours  # unknown fields survive


def test_tensor_data_inline_and_remote_smg_parsed_by_ours():
    inline = smg.TensorData(shape=[4], dtype="float32", inline=b"\0" * 16)
    ours = fpb.TensorData.FromString(inline.SerializeToString())
    assert ours.WhichOneof("payload") == "inline" and ours.inline == b"\0" * 16 and list(ours.shape) == [4]
    remote = smg.TensorData(shape=[1], dtype="uint8")
    remote.remote.transport, remote.remote.descriptor, remote.remote.nbytes = "nixl", b"desc", 1
    ours = fpb.TensorData.FromString(remote.SerializeToString())
    assert (ours.remote.transport, ours.remote.descriptor, ours.remote.nbytes) == ("nixl", b"desc", 1)
    shm = smg.TensorData(shape=[8], dtype="uint8")
    shm.shm.name, shm.shm.offset, shm.shm.nbytes, shm.shm.owner_id = "s", 1, 8, "p"
    ours = fpb.TensorData.FromString(shm.SerializeToString())
    assert (ours.shm.name, ours.shm.offset, ours.shm.nbytes, ours.shm.owner_id) == ("s", 1, 8, "p")


def test_placeholder_range_compatible_both_ways():
    ours = fpb.PlaceholderRange(offset=7, length=5, is_embed=b"\xa8", is_embed_nbits=5)
    theirs = smg.PlaceholderRange.FromString(ours.SerializeToString())
    assert (theirs.offset, theirs.length) == (7, 5)
    back = fpb.PlaceholderRange.FromString(smg.PlaceholderRange(offset=3, length=2).SerializeToString())
    assert (back.offset, back.length, back.HasField("is_embed_nbits")) == (3, 2, False)


def _built_inputs() -> fpb.MultimodalInputs:
    items = [FeatureItem("video", {"pixel_values_videos": np.ones((2, 2), np.float32), "video_grid_thw":
                                   np.array([[1, 2, 2]], np.int64)}, PlaceholderRange(3, 4),
                         {"video_grid_thw": FieldConfig("batched", keep_on_cpu=True)}),
             FeatureItem("video", {"pixel_values_videos": np.zeros((2, 2), np.float32), "video_grid_thw":
                                   np.array([[1, 1, 4]], np.int64)},
                         PlaceholderRange(10, 3, EmbedMask.from_bools([False, True, True])),
                         {"video_grid_thw": FieldConfig("batched", keep_on_cpu=True)})]
    return frontend.build_request(None, items, mode="inline").request.batches[0]


def test_multimodal_inputs_ours_parsed_by_smg():
    ours = _built_inputs()
    theirs = smg.MultimodalInputs.FromString(ours.SerializeToString())
    assert theirs.modality == smg_common.VIDEO
    assert list(theirs.mm_hashes) == [it.mm_hash for it in ours.items]
    assert [(p.offset, p.length) for p in theirs.mm_placeholders] == [(3, 4), (10, 3)]
    assert set(theirs.batched_keys) == {"pixel_values_videos", "video_grid_thw"}
    assert list(theirs.keep_on_cpu_keys) == ["video_grid_thw"]
    # and back: our additions (items, scheme) ride along as unknown fields in SMG's message
    back = fpb.MultimodalInputs.FromString(theirs.SerializeToString())
    assert back == ours
    validate_request(fpb.MultimodalRequest(batches=[back]))


def test_multimodal_inputs_smg_parsed_by_ours():
    theirs = smg.MultimodalInputs(im_token_id=151655, mm_hashes=["a", "b"], batched_keys=["pixel_values"],
                                  keep_on_cpu_keys=["image_grid_thw"], modality=smg_common.IMAGE,
                                  encoder_input_key="patches")
    theirs.pixel_values.shape.extend([2, 3])
    theirs.pixel_values.dtype = "float32"
    theirs.pixel_values.inline = b"\0" * 24
    theirs.model_specific_tensors["image_grid_thw"].dtype = "int64"
    theirs.flat_keys["pixel_values"] = "patches_per_image"
    theirs.mm_placeholders.add(offset=1, length=2)
    ours = fpb.MultimodalInputs.FromString(theirs.SerializeToString())
    assert ours.modality == fpb.MODALITY_IMAGE and ours.im_token_id == 151655
    assert ours.encoder_input_key == "patches" and list(ours.mm_hashes) == ["a", "b"]
    assert ours.pixel_values.inline == b"\0" * 24 and list(ours.pixel_values.shape) == [2, 3]
    assert ours.model_specific_tensors["image_grid_thw"].dtype == "int64"
    assert dict(ours.flat_keys) == {"pixel_values": "patches_per_image"}
    assert smg.MultimodalInputs.FromString(ours.SerializeToString()) == theirs


def _sig(f):
    """(number, wire type, repeated, message / enum type name) of a field."""
    nested = f.message_type or f.enum_type
    return f.number, f.type, f.is_repeated, nested.name if nested else None


def test_encoder_input_key_field_number_matches_smg():
    assert fpb.MultimodalInputs.DESCRIPTOR.fields_by_name["encoder_input_key"].number == \
        smg.MultimodalInputs.DESCRIPTOR.fields_by_name["encoder_input_key"].number == 11
    for name, field in smg.MultimodalInputs.DESCRIPTOR.fields_by_name.items():
        mine = fpb.MultimodalInputs.DESCRIPTOR.fields_by_name[name]
        assert _sig(mine) == _sig(field), name
    ours_new = [f.number for f in fpb.MultimodalInputs.DESCRIPTOR.fields
                if f.name not in smg.MultimodalInputs.DESCRIPTOR.fields_by_name]
    assert min(ours_new) >= 16


# -- round trips -------------------------------------------------------------------------------------
_slices = st.builds(slice, st.none() | st.integers(-5, 5), st.none() | st.integers(-5, 5),
                    st.none() | st.integers(1, 3))
_fields = st.one_of(
    st.builds(FieldConfig, st.just("batched"), st.booleans()),
    st.builds(lambda k, b: FieldConfig("shared", k, batch_size=b), st.booleans(), st.integers(1, 9)),
    st.builds(lambda k, s, d: FieldConfig("flat", k, tuple(s), d), st.booleans(),
              st.lists(_slices | st.lists(_slices, min_size=1, max_size=3).map(tuple), max_size=4),
              st.integers(-2, 2)),
)


@settings(max_examples=60, deadline=None)
@given(_fields)
def test_field_layout_round_trip(field):
    msg = field.to_proto()
    assert FieldConfig.from_proto(fpb.FieldLayout.FromString(msg.SerializeToString())) == field


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["image", "video", "audio"]), st.integers(1, 6),
                          st.none() | st.lists(st.booleans(), min_size=6, max_size=6),
                          st.sampled_from(["inline", "msgpack"])), min_size=1, max_size=5))
def test_request_round_trip(spec):
    items, offset = [], 0
    for i, (modality, length, mask, _) in enumerate(spec):
        em = EmbedMask.from_bools(mask[:length]) if mask is not None else None
        items.append(FeatureItem(modality, {"k": np.full(length, i, np.int16)}, PlaceholderRange(offset, length, em)))
        offset += length
    req = frontend.build_request(None, items, mode=spec[0][3], prompt_len=offset).request
    again = fpb.MultimodalRequest.FromString(req.SerializeToString())
    assert again == req
    checked = validate_request(again)
    got = {(m, it.placeholder) for m, it in checked.items}
    assert got == {(it.modality, it.placeholder) for it in items}
