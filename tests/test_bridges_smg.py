"""Bridge to SMG / `vllm serve --grpc`: parsed back with the real smg_grpc_proto classes and read
with SMG's real tensor decoding (``smg_grpc_servicer.vllm.mm_tensors``, inline and /dev/shm). The
item-by-item conformance with SMG's reader is in test_conformance_smg.py."""
from __future__ import annotations

import importlib
import os

import numpy as np
import pytest
import torch
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2
from smg_grpc_servicer import mm_shm
from smg_grpc_servicer.vllm.mm_tensors import tensor_from_proto

from shmtransport.bridges import Unrepresentable, smg
from shmtransport.client import Consumer, Producer
from shmtransport.embedmask import EmbedMask, PlaceholderRange
from shmtransport.errors import InvalidArgument
from shmtransport.frontend import request as frontend
from shmtransport.protocol.items import FeatureItem, FieldConfig
from shmtransport.testing import settle_daemon
from shmtransport.v1 import generate_pb2 as gpb


def img(seed, offset, length=4, mask=None):
    rng = np.random.default_rng(seed)
    return FeatureItem("image", {"pixel_values": rng.standard_normal((2, 3), dtype=np.float32),
                                 "image_grid_thw": np.int64([[1, 1, 2]])},
                       PlaceholderRange(offset, length, None if mask is None else EmbedMask.from_bools(mask)),
                       {"image_grid_thw": FieldConfig("batched", keep_on_cpu=True)})


def video(seed, offset):
    rng = np.random.default_rng(seed)
    return FeatureItem("video", {"pixel_values_videos": rng.standard_normal((4, 3), dtype=np.float32),
                                 "video_grid_thw": np.int64([[2, 1, 2]])}, PlaceholderRange(offset, 4))


def gen(mm=None, **sampling):
    r = gpb.GenerateRequest(request_id="r", token_ids=gpb.TokenIds(ids=list(range(20))))
    if mm is not None:
        r.multimodal.CopyFrom(mm)
    for k, v in sampling.items():
        setattr(r.sampling, k, v)
    return r


def parse(msg):
    return vllm_engine_pb2.GenerateRequest.FromString(msg.SerializeToString())


def tensor(td):
    return tensor_from_proto(td).numpy()  # SMG's own decoding (inline or shm)


def test_sampling_and_defaults():
    r = gen(temperature=0.0, top_k=5, top_p=0.5, min_p=0.25, seed=7, logprobs=-1, repetition_penalty=1.0)
    r.stopping.max_tokens = 9
    r.stopping.stop.append("x")
    out = parse(smg.to_smg(r))
    s = out.sampling_params
    assert list(out.tokenized.input_ids) == list(range(20))
    assert s.HasField("temperature") and s.temperature == 0.0 and s.top_k == 5 and s.top_p == 0.5
    assert s.min_p == 0.25 and s.seed == 7 and s.logprobs == -1 and s.max_tokens == 9 and list(s.stop) == ["x"]
    assert s.skip_special_tokens and s.spaces_between_special_tokens and s.n == 1
    omitted = parse(smg.to_smg(gen())).sampling_params
    assert not omitted.HasField("temperature") and not omitted.HasField("max_tokens")
    assert not omitted.HasField("logprobs") and not omitted.HasField("seed")


@pytest.mark.parametrize("field,value,needle", [("top_k", -1, "top_k=-1"), ("top_k", 0, "top_k=0"),
                                                ("min_p", 0.0, "min_p=0"), ("seed", 1 << 40, "seed")])
def test_unrepresentable_sampling(field, value, needle):
    with pytest.raises(Unrepresentable, match=needle):
        smg.to_smg(gen(**{field: value}))


@pytest.mark.parametrize("field,value", [("lora_name", "a"), ("cache_salt", "s"), ("priority", 1)])
def test_unrepresentable_request_fields(field, value):
    r = gen()
    setattr(r, field, value)
    with pytest.raises(Unrepresentable, match=field):
        smg.to_smg(r)


def test_text_prompt_rejected():
    with pytest.raises(InvalidArgument, match="text prompt"):
        smg.to_smg(gpb.GenerateRequest(text="hi"))


def test_features_batched_per_modality_from_shm(daemon):
    items = [img(1, 1), img(2, 6), video(3, 12)]
    with Producer(daemon.socket_path, timeout_s=10) as producer, Consumer(daemon.socket_path, timeout_s=10) as consumer:
        with frontend.build_request(producer, items, mode="shm", scheme="blake3") as built:
            out = parse(smg.to_smg(gen(built.request), consumer))
    mi = out.mm_inputs
    assert mi.modality == common_pb2.IMAGE
    # batched: stacked, SMG hands item i batch[i]
    np.testing.assert_array_equal(tensor(mi.pixel_values), np.stack([items[0].kwargs["pixel_values"],
                                                                     items[1].kwargs["pixel_values"]]))
    np.testing.assert_array_equal(tensor(mi.model_specific_tensors["image_grid_thw"]), np.int64([[[1, 1, 2]]] * 2))
    assert set(mi.batched_keys) == {"pixel_values", "image_grid_thw"}
    assert list(mi.keep_on_cpu_keys) == ["image_grid_thw"] and not mi.flat_keys and not mi.HasField("encoder_input_key")
    assert [(p.offset, p.length) for p in mi.mm_placeholders] == [(1, 4), (6, 4)]
    ours = [it.mm_hash for it in built.request.batches[0].items]
    assert list(mi.mm_hashes) == [h.split(":", 1)[1] for h in ours] and len(mi.mm_hashes[0]) == 64
    (vid,) = out.extra_mm_inputs
    assert vid.modality == common_pb2.VIDEO
    # video pixels ride in pixel_values: SMG renames them to pixel_values_videos
    assert set(vid.model_specific_tensors) == {"video_grid_thw"}
    np.testing.assert_array_equal(tensor(vid.pixel_values), items[2].kwargs["pixel_values_videos"][None])
    assert set(vid.batched_keys) == {"pixel_values", "video_grid_thw"}


def test_identity_rules():
    built = frontend.build_request(None, [img(1, 1)], mode="inline")  # xxh3-128 identities
    with pytest.raises(Unrepresentable, match="identity 'xxh3-128'"):
        smg.to_smg(gen(built.request))
    out = parse(smg.to_smg(gen(built.request), drop_identities=True))
    assert list(out.mm_inputs.mm_hashes) == [] and len(out.mm_inputs.mm_placeholders) == 1


def test_non_tensor_data_is_refused_as_unrepresentable():
    """vLLM's non-tensor data (ints, floats, lists) reaches the bridge; SMG's TensorData cannot hold it."""
    item = FeatureItem("image", {"pixel_values": np.ones((1, 4), np.float32), "num_crops": 2}, PlaceholderRange(0, 1))
    built = frontend.build_request(None, [item], mode="inline", scheme="blake3")
    with pytest.raises(Unrepresentable, match="image.num_crops \\(int, float or list data\\)"):
        smg.to_smg(gen(built.request))


def test_is_embed_mask_rejected():
    built = frontend.build_request(None, [img(1, 1, 4, [True, False, True, True])], mode="inline", scheme="blake3")
    with pytest.raises(Unrepresentable, match="is_embed"):
        smg.to_smg(gen(built.request))


def flat_img(seed, offset, rows, slices):
    rng = np.random.default_rng(seed)
    return FeatureItem("image", {"pixel_values": rng.standard_normal((rows, 3), dtype=np.float32),
                                 "image_grid_thw": np.int64([1, 1, rows])}, PlaceholderRange(offset, 4),
                       {"pixel_values": FieldConfig("flat", slices=slices, dim=0)})


def test_flat_field_goes_to_flat_keys_with_item_lengths():
    slices = (slice(0, 2), slice(2, 7))
    items = [flat_img(1, 1, 2, slices), flat_img(2, 6, 5, slices)]
    built = frontend.build_request(None, items, mode="inline", scheme="blake3")
    mi = parse(smg.to_smg(gen(built.request))).mm_inputs
    assert dict(mi.flat_keys) == {"pixel_values": "patches_per_image"}
    np.testing.assert_array_equal(tensor(mi.pixel_values), np.concatenate([it.kwargs["pixel_values"] for it in items]))
    assert tensor(mi.model_specific_tensors["patches_per_image"]).tolist() == [2, 5]
    assert set(mi.batched_keys) == {"patches_per_image", "image_grid_thw"}


def test_refusal_puts_nothing_in_shared_memory(daemon):
    it = img(1, 1)
    it.kwargs = dict(it.kwargs, mask=np.ones(4, dtype=np.int32))
    built = frontend.build_request(None, [it], mode="inline", scheme="blake3")
    with Producer(daemon.socket_path, timeout_s=10) as producer:
        with pytest.raises(Unrepresentable, match=r"image.mask dtype int32: cannot be represented by SMG"):
            smg.to_smg_shm(gen(built.request), None, producer)
    assert daemon.stat().live_objects == 0


@pytest.fixture
def stock_unlink(monkeypatch):
    """SMG's shm reader with TOKENSPEED_UNLINK_MM_SHM_AFTER_READ at its stock default (unlink)."""
    monkeypatch.setenv("TOKENSPEED_UNLINK_MM_SHM_AFTER_READ", "1")
    importlib.reload(mm_shm)  # read at import
    assert mm_shm.UNLINK_MM_SHM_AFTER_READ
    yield
    monkeypatch.undo()
    importlib.reload(mm_shm)


def test_shm_handles_in_dedicated_segments_read_by_smgs_reader(daemon, stock_unlink):
    items = [img(1, 1), img(2, 6)]
    with Producer(daemon.socket_path, timeout_s=10) as producer, Consumer(daemon.socket_path, timeout_s=10) as consumer:
        with frontend.build_request(producer, items, mode="shm", scheme="blake3") as built:
            inline = parse(smg.to_smg(gen(built.request), consumer)).mm_inputs
            with smg.to_smg_shm(gen(built.request), consumer, producer) as res:
                out = parse(res.request)
                pv = out.mm_inputs.pixel_values
                grid = out.mm_inputs.model_specific_tensors["image_grid_thw"]
                assert pv.WhichOneof("payload") == "shm" and pv.shm.offset == 0
                names = {pv.shm.name, grid.shm.name}
                assert len(names) == 2 and all(n in daemon.segment_names for n in names)
                assert all(mm_shm.validated_shm_name(n) == n for n in names)
                got_pv, got_grid = tensor_from_proto(pv), tensor_from_proto(grid)  # preads, unlinks
                assert not any(os.path.exists(os.path.join("/dev/shm", n)) for n in names)
    assert torch.equal(got_pv, tensor_from_proto(inline.pixel_values))
    assert torch.equal(got_grid, tensor_from_proto(inline.model_specific_tensors["image_grid_thw"]))
    want = np.stack([items[0].kwargs["pixel_values"], items[1].kwargs["pixel_values"]])
    np.testing.assert_array_equal(got_pv.numpy(), want)
    assert settle_daemon(daemon, max_objects=0).live_objects == 0
