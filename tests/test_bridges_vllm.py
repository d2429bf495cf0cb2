"""Bridge to vLLM's own gRPC schema (package vllm): round trips, grpc-mm identity, limits, zero = unset."""
from __future__ import annotations

import numpy as np
import pytest

from shmtransport.bridges import Unrepresentable, vllm_grpc
from shmtransport.client import Consumer, Producer
from shmtransport.embedmask import EmbedMask, PlaceholderRange
from shmtransport.errors import InvalidArgument, ResourceExhausted
from shmtransport.frontend import request as frontend
from shmtransport.identity import grpc_mm_identity
from shmtransport.protocol.capabilities import ServerInfoServicer, same_shm_namespace, server_info
from shmtransport.protocol.folding import fold
from shmtransport.protocol.items import FeatureItem
from shmtransport.protocol.limits import Limits
from shmtransport.protocol.msgpack_kwargs import decode_kwargs_item, encode_kwargs_item
from shmtransport.protocol.sampling import project_sampling
from shmtransport.v1 import features_pb2 as fpb
from shmtransport.v1 import generate_pb2 as gpb
from shmtransport.v1 import vllm_inference_pb2 as vpb


def items():
    rng = np.random.default_rng(3)
    return [FeatureItem("image", {"pixel_values": rng.standard_normal((4, 6), dtype=np.float32),
                                  "image_grid_thw": np.int64([[1, 2, 2]])},
                        PlaceholderRange(1, 5, EmbedMask.from_bools([False, True, True, True, False]))),
            FeatureItem("audio", {"input_features": rng.standard_normal((8,), dtype=np.float32)},
                        PlaceholderRange(8, 3))]


def gen_request(mm: fpb.MultimodalRequest | None = None, **sampling) -> gpb.GenerateRequest:
    r = gpb.GenerateRequest(request_id="req-1", model="m", token_ids=gpb.TokenIds(ids=list(range(1, 13))))
    if mm is not None:
        r.multimodal.CopyFrom(mm)
    for k, v in sampling.items():
        setattr(r.sampling, k, v)
    return r


def wire(msg):
    return vpb.GenerateRequest.FromString(msg.SerializeToString())


def test_grpc_mm_identity_and_exact_producer_bytes():
    built = frontend.build_request(None, items(), scheme="grpc-mm", mode="msgpack")
    out = wire(vllm_grpc.to_vllm_grpc(gen_request(built.request)))
    sent = {b.items[0].kwargs_msgpack for b in built.request.batches}
    assert [m.modality for m in out.media] == [vpb.MODALITY_IMAGE, vpb.MODALITY_AUDIO]  # offset order
    for m, name in zip(out.media, ("image", "audio")):
        f = m.features
        assert f.kwargs in sent
        assert f.identifier == f.mm_hash == grpc_mm_identity(name, f.kwargs)
        assert f.identifier.startswith("grpc-mm:")
    assert list(out.media[0].features.is_embed) == [False, True, True, True, False]
    assert (out.media[0].features.offset, out.media[0].features.length) == (1, 5)
    assert list(out.media[1].features.is_embed) == []  # dense


def test_shm_features_reinlined_as_msgpack(daemon):
    with Producer(daemon.socket_path, timeout_s=10) as producer, Consumer(daemon.socket_path, timeout_s=10) as consumer:
        with frontend.build_request(producer, items(), mode="shm") as built:
            out = wire(vllm_grpc.to_vllm_grpc(gen_request(built.request), consumer))
    img = out.media[0].features
    decoded = decode_kwargs_item(img.kwargs)
    dtype, shape, data = decoded.tensors["pixel_values"]
    assert (dtype, shape) == ("float32", (4, 6))
    np.testing.assert_array_equal(np.frombuffer(data, np.float32).reshape(4, 6), items()[0].kwargs["pixel_values"])
    # a proto map carries no key order: the worker reads shm kwargs sorted, and re-inlines them so
    assert img.kwargs == encode_kwargs_item(dict(sorted(items()[0].kwargs.items())))
    assert img.identifier == img.mm_hash == grpc_mm_identity("image", img.kwargs)


def test_round_trip_request():
    built = frontend.build_request(None, items(), scheme="grpc-mm", mode="msgpack")
    r = gen_request(built.request, temperature=0.5, top_p=0.75, top_k=20, min_p=0.125, seed=-3,
                    presence_penalty=0.5, frequency_penalty=0.0, repetition_penalty=1.0, logprobs=-1,
                    prompt_logprobs=2)
    r.sampling.logit_bias[9] = -5.0
    r.stopping.max_tokens, r.stopping.min_tokens, r.stopping.ignore_eos = 32, 3, True
    r.stopping.stop.append("END")
    r.stopping.stop_token_ids.append(2)
    r.stopping.include_stop_str_in_output = True
    r.response.skip_special_tokens = False
    r.lora_name, r.cache_salt, r.priority = "adapter-a", "salt", 5
    v = wire(vllm_grpc.to_vllm_grpc(r))
    assert v.response.output_candidates.all and v.response.prompt_candidates.top_n == 2
    assert v.sampling.HasField("seed") and v.sampling.seed == -3 and v.kv.cache_salt == "salt"
    back = vllm_grpc.from_vllm_grpc(v)
    a, b = project_sampling(r).kwargs, project_sampling(back).kwargs
    # explicit zero penalty reads back as omitted: both mean "no penalty" to vLLM
    a.pop("frequency_penalty")
    assert a == b
    assert (back.lora_name, back.cache_salt, back.priority) == ("adapter-a", "salt", 5)
    assert list(back.token_ids.ids) == list(r.token_ids.ids)
    for ours, theirs in zip(built.request.batches, back.multimodal.batches):
        assert ours.modality == theirs.modality
        for x, y in zip(ours.items, theirs.items):
            assert x.kwargs_msgpack == y.kwargs_msgpack and x.mm_hash == y.mm_hash
            assert x.placeholder == y.placeholder
            assert y.cache_identifier == f"adapter-a:{x.mm_hash}"


def test_omitted_controls_stay_unset_on_the_wire():
    v = wire(vllm_grpc.to_vllm_grpc(gen_request()))
    assert not v.HasField("temperature") and not v.sampling.HasField("seed")
    assert (v.sampling.top_k, v.sampling.top_p, v.sampling.min_p, v.stopping.max_new_tokens) == (0, 0, 0, 0)
    assert not v.response.HasField("skip_special_tokens") and not v.response.output_logprobs
    assert v.response.output_token_ids
    assert project_sampling(vllm_grpc.from_vllm_grpc(v)).kwargs == {}


@pytest.mark.parametrize("section,field,value,needle", [
    ("sampling", "top_k", -1, "top_k=-1"), ("sampling", "top_k", 0, "top_k=0"),
    ("sampling", "min_p", 0.0, "min_p=0"),
    ("response", "spaces_between_special_tokens", True, "spaces_between_special_tokens"),
    ("response", "return_sampling_mask", True, "return_sampling_mask"),
])
def test_unrepresentable_controls_rejected(section, field, value, needle):
    r = gen_request()
    setattr(getattr(r, section), field, value)
    with pytest.raises(Unrepresentable, match=needle):
        vllm_grpc.to_vllm_grpc(r)


def test_text_prompt_rejected():
    with pytest.raises(InvalidArgument, match="text prompt"):
        vllm_grpc.to_vllm_grpc(gpb.GenerateRequest(text="hi"))


def test_limit_64_features():
    many = [FeatureItem("image", {"x": np.full((1,), i, np.float32)}, PlaceholderRange(i, 1)) for i in range(65)]
    built = frontend.build_request(None, many, scheme="grpc-mm", mode="msgpack",
                                   limits=Limits(max_inline_items=100))
    r = gen_request(built.request)
    r.token_ids.ids.extend(range(70))
    with pytest.raises(ResourceExhausted, match="max_features=64"):
        vllm_grpc.to_vllm_grpc(r)


def test_limit_16_mib_aggregate():
    big = [FeatureItem("image", {"x": np.zeros((9 << 20) // 4, np.float32)}, PlaceholderRange(i, 1))
           for i in range(2)]
    built = frontend.build_request(None, big, scheme="grpc-mm", mode="msgpack",
                                   limits=Limits(max_inline_bytes=64 << 20))
    with pytest.raises(ResourceExhausted, match="max_kwargs_bytes=16777216"):
        vllm_grpc.to_vllm_grpc(gen_request(built.request))


def test_limit_applies_to_reencoded_shm_payloads(daemon, monkeypatch):
    monkeypatch.setattr(vllm_grpc, "MAX_KWARGS_BYTES", 100)
    with Producer(daemon.socket_path, timeout_s=10) as producer, Consumer(daemon.socket_path, timeout_s=10) as consumer:
        with frontend.build_request(producer, items(), mode="shm") as built:
            with pytest.raises(ResourceExhausted, match="max_kwargs_bytes"):
                vllm_grpc.to_vllm_grpc(gen_request(built.request), consumer)


def test_raw_media_passes_through_and_mixing_rejected():
    mm = fpb.MultimodalRequest()
    mm.raw_media.add(modality=fpb.MODALITY_IMAGE, url="https://example.com/a.png", uuid="u1")
    v = wire(vllm_grpc.to_vllm_grpc(gen_request(mm)))
    assert v.media[0].url == "https://example.com/a.png" and v.media[0].modality == vpb.MODALITY_IMAGE
    built = frontend.build_request(None, items(), scheme="grpc-mm", mode="msgpack")
    mm.batches.extend(built.request.batches)
    with pytest.raises(InvalidArgument, match="cannot be mixed"):
        vllm_grpc.to_vllm_grpc(gen_request(mm))


def test_responses_fold():
    r1 = vpb.GenerateResponse(prompt_info=vpb.PromptInfo(num_prompt_tokens=12),
                              outputs=vpb.SequenceOutput(num_tokens=2, token_ids=[4, 5], logprobs=[-0.5, -1.0]))
    r2 = vpb.GenerateResponse(outputs=vpb.SequenceOutput(
        num_tokens=1, token_ids=[2], logprobs=[-0.25],
        finish_info=vpb.FinishInfo(num_output_tokens=3, reason=vpb.FinishInfo.STOP, eos_token_id=2)))
    out = fold(vllm_grpc.chunks_from_vllm(vpb.GenerateResponse.FromString(x.SerializeToString()) for x in (r1, r2)))
    assert list(out.token_ids) == [4, 5, 2] and out.num_prompt_tokens == 12
    assert out.finish_reason == gpb.FINISH_REASON_STOP and out.matched_stop.eos_token_id == 2
    bad = vpb.GenerateResponse(outputs=vpb.SequenceOutput(
        num_tokens=1, token_ids=[2], finish_info=vpb.FinishInfo(num_output_tokens=1)))
    with pytest.raises(InvalidArgument, match="NOT_FINISHED"):
        fold(vllm_grpc.chunks_from_vllm([bad]))


def test_server_info_capabilities():
    info = gpb.ServerInfo.FromString(server_info(native_generate=True).SerializeToString())
    boot, _, dev = info.shm_namespace_id.rpartition(":")
    assert boot and dev.isdigit() and same_shm_namespace(info)
    assert set(info.identity_schemes) == {"xxh3-128", "blake3", "grpc-mm"}
    assert info.supports_dedicated_segments and set(info.bridges) == {"smg", "vllm-grpc"}
    assert info.supports_native_generate and info.max_inline_items == 64 and info.max_inline_bytes == 16 << 20
    assert not same_shm_namespace(gpb.ServerInfo(shm_namespace_id="other:1"))
    assert ServerInfoServicer().GetServerInfo(gpb.ServerInfoRequest(), None).shm_namespace_id == info.shm_namespace_id
