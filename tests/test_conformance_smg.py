"""Conformance of the SMG bridge with SMG's REAL reader (smg-grpc-servicer, the stock vLLM gRPC
worker): random requests go through ``smg.to_smg`` / ``smg.to_smg_shm``, the message is parsed by
smg_grpc_proto, passed through the Generate pre-checks (``mm_keys`` / ``mm_salt``) and rebuilt by
``VllmEngineServicer._build_preprocessed_mm_inputs`` (no engine: it reads only the model dtype);
the per-item tensors SMG builds must equal ours exactly. What SMG cannot read must be refused
with ``Unrepresentable`` before anything is put in shared memory."""
from __future__ import annotations

import importlib
import os
import types

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2
from smg_grpc_servicer import mm_shm
from smg_grpc_servicer.tensor_wire import PROTO_DTYPE_MAP, tensor_from_parts
from smg_grpc_servicer.vllm.mm_keys import batches_missing_pixels, describes_media_twice, mm_batches
from smg_grpc_servicer.vllm.mm_salt import has_preprocessed_mm_payload
from smg_grpc_servicer.vllm.servicer import VllmEngineServicer
from vllm.multimodal.inputs import MultiModalBatchedField, MultiModalFlatField, MultiModalSharedField

from shmtransport.bridges import Unrepresentable, smg
from shmtransport.client import Consumer, Producer
from shmtransport.embedmask import PlaceholderRange
from shmtransport.frontend import request as frontend
from shmtransport.protocol.items import FeatureItem, FieldConfig, modality_from_pb
from shmtransport.v1 import generate_pb2 as gpb

FLOATS = ("float32", "bfloat16", "float16")
INTS = ("uint8", "int64", "uint32")
FIELD_TYPE = {"batched": MultiModalBatchedField, "flat": MultiModalFlatField, "shared": MultiModalSharedField}
SMG_MODALITY = {"image": common_pb2.IMAGE, "video": common_pb2.VIDEO}
PRIMARY = {"image": "pixel_values", "video": "pixel_values_videos"}


# -- building our requests ---------------------------------------------------------------------
def make_tensor(dtype: str, shape, rng):
    if dtype in FLOATS:
        t = torch.from_numpy(np.asarray(rng.standard_normal(shape), dtype=np.float32))
        return t.to(getattr(torch, dtype))
    hi = {"uint8": 1 << 8, "uint32": 1 << 32, "int64": 1 << 62}[dtype]
    lo = -hi if dtype == "int64" else 0
    return torch.from_numpy(np.asarray(rng.integers(lo, hi, shape, dtype=getattr(np, dtype))))


def gen(mm):
    r = gpb.GenerateRequest(request_id="r", token_ids=gpb.TokenIds(ids=list(range(64))))
    r.multimodal.CopyFrom(mm)
    return r


@st.composite
def field_specs(draw, modality: str, n: int, float_dtype: str):
    """(key, kind, dtype, keep_on_cpu, per-item shapes, flat dim) of one modality's kwargs."""
    names = [PRIMARY[modality]] if draw(st.integers(0, 4)) else []  # sometimes no pixels at all
    names += [f"{modality}_k{i}" for i in range(draw(st.integers(0 if names else 1, 2)))]
    specs = []
    for key in names:
        kind = draw(st.sampled_from(("batched", "flat", "shared")))
        dtype = draw(st.sampled_from((float_dtype,) + INTS))
        dim = 0
        if kind == "flat":
            tail = tuple(draw(st.lists(st.integers(1, 4), max_size=2)))
            lengths = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))  # ragged, some maybe empty
            lengths[draw(st.integers(0, n - 1))] += 1  # but not all: SMG cannot rebuild an empty tensor
            shapes = [(m, *tail) for m in lengths]
            dim = draw(st.sampled_from((0, -1 - len(tail))))  # -rank is dim 0 too
        else:
            tail = tuple(draw(st.lists(st.integers(1, 4), min_size=kind == "shared", max_size=3)))
            shapes = [tail] * n  # batched: leading 1s included (they must survive)
        cpu = kind != "shared" and draw(st.booleans())  # SMG drops keep_on_cpu of shared fields (refused)
        specs.append((key, kind, dtype, cpu, shapes, dim))
    return specs


@st.composite
def requests(draw):
    """(our items, model dtype, identity scheme): 1-3 items per modality, image / video / both."""
    float_dtype = draw(st.sampled_from(FLOATS))  # SMG casts floats to the model dtype: use it
    modalities = draw(st.sampled_from((("image",), ("video",), ("image", "video"), ("video", "image"))))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    items, offset = [], 0
    for modality in modalities:
        n = draw(st.integers(1, 3))
        specs = draw(field_specs(modality, n, float_dtype))
        shared = {key: make_tensor(dtype, shapes[0], rng) for key, kind, dtype, _, shapes, _ in specs
                  if kind == "shared"}
        for j in range(n):
            kwargs, fields = {}, {}
            for key, kind, dtype, cpu, shapes, dim in specs:
                kwargs[key] = shared[key].clone() if kind == "shared" else make_tensor(dtype, shapes[j], rng)
                if kind == "flat":
                    ends = np.cumsum([0] + [s[0] for s in shapes])
                    fields[key] = FieldConfig("flat", cpu, tuple(slice(int(a), int(b)) for a, b in
                                                                 zip(ends, ends[1:])), dim)
                else:
                    fields[key] = FieldConfig(kind, cpu, batch_size=n if kind == "shared" else 0)
            length = draw(st.integers(1, 3))
            items.append(FeatureItem(modality, kwargs, PlaceholderRange(offset, length), fields))
            offset += length + draw(st.integers(0, 2))
    return items, getattr(torch, float_dtype), draw(st.sampled_from(("blake3", "xxh3-128")))


# -- SMG's reader --------------------------------------------------------------------------------
def smg_read(msg, model_dtype):
    """What SMG's Generate does with our message, up to the vLLM MultiModalInput it builds."""
    req = vllm_engine_pb2.GenerateRequest.FromString(msg.SerializeToString())
    batches = [b for b in mm_batches(req) if has_preprocessed_mm_payload(b)]
    assert len(batches) == len(mm_batches(req)) and not describes_media_twice(req)
    assert not batches_missing_pixels(batches)  # else refused without kv_transfer_params
    fake = types.SimpleNamespace(engine=types.SimpleNamespace(model_config=types.SimpleNamespace(dtype=model_dtype)))
    return req, VllmEngineServicer._build_preprocessed_mm_inputs(fake, req.tokenized, batches)


def batch_of(req, modality):
    (b,) = [b for b in mm_batches(req) if b.modality == SMG_MODALITY[modality]]
    return b


def assert_smg_rebuilds(items, req, mm, hashes):
    """SMG's items == ours: same keys (plus the flat sizes keys), tensors equal in shape, dtype and
    values, field kind / keep_on_cpu as declared; hashes and placeholders in order."""
    by_modality: dict[str, list] = {}
    for it in items:
        by_modality.setdefault(it.modality, []).append(it)
    assert set(mm["mm_kwargs"]) == set(by_modality)
    for modality, ours in by_modality.items():
        b = batch_of(req, modality)
        sizes_keys = set(b.flat_keys.values())
        theirs = mm["mm_kwargs"][modality]
        assert len(theirs) == len(ours)
        for mine, got in zip(ours, theirs):
            assert set(got) == set(mine.kwargs) | sizes_keys
            for key, want in mine.kwargs.items():
                e = got[key]
                assert e.data.dtype == want.dtype and e.data.shape == want.shape, (modality, key)
                assert torch.equal(e.data, want), (modality, key)
                field = mine.field(key)
                assert type(e.field) is FIELD_TYPE[field.kind] and e.field.keep_on_cpu == field.keep_on_cpu
                if field.kind == "flat":
                    assert e.field.dim == 0
            for key, name in b.flat_keys.items():
                ours_key = "pixel_values_videos" if modality == "video" and key == "pixel_values" else key
                assert got[name].data.dtype == torch.int64
                assert int(got[name].data) == mine.kwargs[ours_key].shape[0]
        placeholders = mm["mm_placeholders"][modality]
        assert [(p.offset, p.length, p.is_embed) for p in placeholders] == \
            [(it.placeholder.offset, it.placeholder.length, None) for it in ours]
    assert mm["mm_hashes"] == hashes


def our_hashes(built, scheme):
    if scheme != "blake3":
        return {}  # sent with drop_identities: SMG hashes itself
    return {modality_from_pb(b.modality): [it.mm_hash.removeprefix("blake3:") for it in b.items]
            for b in built.request.batches}


# -- properties -------------------------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(requests())
def test_smg_rebuilds_our_items_inline(case):
    items, model_dtype, scheme = case
    built = frontend.build_request(None, items, mode="inline", scheme=scheme)
    msg = smg.to_smg(gen(built.request), drop_identities=scheme != "blake3")
    req, mm = smg_read(msg, model_dtype)
    assert_smg_rebuilds(items, req, mm, our_hashes(built, scheme))


@pytest.fixture
def stock_unlink(monkeypatch):
    """SMG's reader as deployed: TOKENSPEED_UNLINK_MM_SHM_AFTER_READ at its default, unlink."""
    monkeypatch.setenv("TOKENSPEED_UNLINK_MM_SHM_AFTER_READ", "1")
    importlib.reload(mm_shm)  # the flag is read at import
    assert mm_shm.UNLINK_MM_SHM_AFTER_READ
    yield
    monkeypatch.undo()
    importlib.reload(mm_shm)


def tensor_datas(req):
    for b in mm_batches(req):
        yield b.pixel_values
        yield from b.model_specific_tensors.values()


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=requests())
def test_smg_rebuilds_our_items_from_dedicated_segments(daemon, stock_unlink, case):
    items, model_dtype, scheme = case
    drop = scheme != "blake3"
    with Producer(daemon.socket_path, timeout_s=10) as producer, Consumer(daemon.socket_path, timeout_s=10) as consumer:
        with frontend.build_request(producer, items, mode="shm", scheme=scheme) as built:
            inline_req, inline_mm = smg_read(smg.to_smg(gen(built.request), consumer, drop_identities=drop),
                                             model_dtype)
            with smg.to_smg_shm(gen(built.request), consumer, producer, drop_identities=drop) as res:
                tds = list(tensor_datas(res.request))
                names = [td.shm.name for td in tds]
                assert all(td.WhichOneof("payload") == "shm" and td.shm.offset == 0 for td in tds)
                assert len(set(names)) == len(tds) == len(res.handles)  # one segment per tensor
                assert all(mm_shm.validated_shm_name(n) == n and n in daemon.segment_names for n in names)
                req, mm = smg_read(res.request, model_dtype)  # preads, then unlinks each segment
                assert not any(os.path.exists(os.path.join("/dev/shm", n)) for n in names)
    assert_smg_rebuilds(items, req, mm, our_hashes(built, scheme))
    # the shm path is the inline path with another payload transport
    assert [(td.dtype, list(td.shape)) for td in tensor_datas(req)] == \
        [(td.dtype, list(td.shape)) for td in tensor_datas(inline_req)]
    assert_smg_rebuilds(items, inline_req, inline_mm, our_hashes(built, scheme))


# -- the examples of the findings, named ---------------------------------------------------------
def qwen_image(rows, offset, seed, slices=None):
    rng = np.random.default_rng(seed)
    return FeatureItem("image", {"pixel_values": make_tensor("float32", (rows, 8), rng),
                                 "image_grid_thw": torch.tensor([1, 1, rows])},
                       PlaceholderRange(offset, 2),
                       {"pixel_values": FieldConfig("flat", slices=slices or (slice(0, rows),)),
                        "image_grid_thw": FieldConfig("batched", keep_on_cpu=True)})


def test_ragged_images_use_flat_keys_with_patches_per_image():
    slices = (slice(0, 4), slice(4, 10))
    items = [qwen_image(4, 0, 1, slices), qwen_image(6, 3, 2, slices)]
    built = frontend.build_request(None, items, mode="inline", scheme="blake3")
    req, mm = smg_read(smg.to_smg(gen(built.request)), torch.float32)
    b = req.mm_inputs
    assert dict(b.flat_keys) == {"pixel_values": "patches_per_image"} and list(b.pixel_values.shape) == [10, 8]
    assert "image_grid_thw" in b.batched_keys and b.model_specific_tensors["patches_per_image"].dtype == "int64"
    assert_smg_rebuilds(items, req, mm, our_hashes(built, "blake3"))


def test_batched_leading_dim_of_one_survives():
    items = [FeatureItem("image", {"pixel_values": torch.ones(1, 3)}, PlaceholderRange(0, 2))]
    built = frontend.build_request(None, items, mode="inline", scheme="blake3")
    req, mm = smg_read(smg.to_smg(gen(built.request)), torch.float32)
    assert mm["mm_kwargs"]["image"][0]["pixel_values"].data.shape == (1, 3)
    assert_smg_rebuilds(items, req, mm, our_hashes(built, "blake3"))


def test_video_pixels_travel_in_pixel_values():
    items = [FeatureItem("video", {"pixel_values_videos": torch.ones(4, 3), "video_grid_thw": torch.tensor([2, 1, 2])},
                         PlaceholderRange(0, 2))]
    built = frontend.build_request(None, items, mode="inline", scheme="blake3")
    req, mm = smg_read(smg.to_smg(gen(built.request)), torch.float32)
    assert req.mm_inputs.HasField("pixel_values") and "pixel_values_videos" not in req.mm_inputs.model_specific_tensors
    assert_smg_rebuilds(items, req, mm, our_hashes(built, "blake3"))


def test_sizes_tensors_never_shadow_a_kwarg():
    slices = (slice(0, 4), slice(4, 10))
    items = [qwen_image(4, 0, 1, slices), qwen_image(6, 3, 2, slices)]
    for it in items:  # a kwarg already named like the sizes tensor, and a second flat key
        it.kwargs.update(patches_per_image=torch.ones(2), extra=torch.ones(1, 2))
        it.fields.update(extra=FieldConfig("flat", slices=(slice(0, 1), slice(1, 2))))
    built = frontend.build_request(None, items, mode="inline", scheme="blake3")
    req, mm = smg_read(smg.to_smg(gen(built.request)), torch.float32)
    assert dict(req.mm_inputs.flat_keys) == {"pixel_values": "patches_per_image_", "extra": "patches_per_image_1"}
    assert_smg_rebuilds(items, req, mm, our_hashes(built, "blake3"))


def test_floats_are_cast_to_the_model_dtype_by_smg():
    items = [qwen_image(4, 0, 1)]
    built = frontend.build_request(None, items, mode="inline", scheme="blake3")
    _, mm = smg_read(smg.to_smg(gen(built.request)), torch.bfloat16)
    got = mm["mm_kwargs"]["image"][0]
    assert torch.equal(got["pixel_values"].data, items[0].kwargs["pixel_values"].to(torch.bfloat16))
    assert got["image_grid_thw"].data.dtype == torch.int64


def test_our_dtypes_are_smgs():
    assert set(smg.SMG_DTYPES) == set(PROTO_DTYPE_MAP)


# -- what SMG cannot read is refused ------------------------------------------------------------------
class RecordingProducer:
    """Stands in for a Producer: a refusal must come before any put."""

    def __init__(self):
        self.puts = []

    def put(self, tensor, **kw):
        self.puts.append(tensor)
        raise AssertionError("a tensor was put before the refusal")

    def release(self, handles):
        pass


def item(modality="image", kwargs=None, offset=0, **fields):
    kwargs = {"pixel_values": torch.ones(2, 3)} if kwargs is None else kwargs
    return FeatureItem(modality, kwargs, PlaceholderRange(offset, 2), fields)


FLAT2 = FieldConfig("flat", slices=(slice(0, 2), slice(2, 4)))
UNSUPPORTED_DTYPES = ("bool", "int8", "uint16", "int16", "int32", "float64", "uint64")

REFUSED = {
    "audio": ([item("audio", {"input_features": torch.ones(2, 3)})], r"audio items.*modality_name"),
    "ragged batched": ([item(kwargs={"pixel_values": torch.ones(4, 8)}),
                        item(kwargs={"pixel_values": torch.ones(6, 8)}, offset=3)],
                       r"batched items of different shapes"),
    "flat along dim 1": ([item(pixel_values=FieldConfig("flat", slices=(slice(0, 3),), dim=1))], r"flat along dim 1"),
    "flat differing beyond dim 0": (
        [item(kwargs={"pixel_values": torch.ones(2, 3)}, pixel_values=FLAT2),
         item(kwargs={"pixel_values": torch.ones(2, 4)}, offset=3, pixel_values=FLAT2)], r"differing beyond dim 0"),
    "shared differing": (
        [item(kwargs={"pixel_values": torch.ones(2, 3)}, pixel_values=FieldConfig("shared", batch_size=2)),
         item(kwargs={"pixel_values": torch.zeros(2, 3)}, offset=3, pixel_values=FieldConfig("shared", batch_size=2))],
        r"shared field that differs"),
    "shared on cpu": ([item(pixel_values=FieldConfig("shared", keep_on_cpu=True, batch_size=1))],
                      r"shared field kept on CPU.*without keep_on_cpu"),
    "shared 0-d": ([item(kwargs={"pixel_values": torch.tensor(1.0)}, pixel_values=FieldConfig("shared", batch_size=1))],
                   r"tensor of shape \[\].*0-d or empty"),
    "empty": ([item(kwargs={"pixel_values": torch.ones(0, 3)})], r"tensor of shape \[1, 0, 3\]"),
    "video pixel_values": ([item("video", {"pixel_values": torch.ones(2, 3)})], r"video.pixel_values.*renames"),
    "key in two modalities": ([item(kwargs={"pixel_values": torch.ones(2, 3), "grid": torch.ones(3)}),
                               item("video", {"pixel_values_videos": torch.ones(2, 3), "grid": torch.ones(3)},
                                    offset=3)],
                              r"\['grid'\] in several modalities"),
    "different keys": ([item(), item(kwargs={"pixel_values": torch.ones(2, 3), "x": torch.ones(1)}, offset=3)],
                       r"different kwargs keys"),
    "different dtypes": ([item(), item(kwargs={"pixel_values": torch.ones(2, 3, dtype=torch.float16)}, offset=3)],
                         r"items of different dtypes"),
    **{f"dtype {d}": ([item(kwargs={"pixel_values": torch.ones(2, 3), "x": torch.ones(2, dtype=getattr(torch, d))})],
                      rf"image.x dtype {d}.*TensorData takes") for d in UNSUPPORTED_DTYPES},
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_with_a_reason_before_anything_is_put(case):
    items, needle = REFUSED[case]
    built = frontend.build_request(None, items, mode="inline", scheme="blake3")
    with pytest.raises(Unrepresentable, match=needle) as exc:
        smg.to_smg(gen(built.request))
    assert "cannot be represented by SMG" in str(exc.value) and str(exc.value).endswith(")")
    producer = RecordingProducer()
    with pytest.raises(Unrepresentable, match=needle):
        smg.to_smg_shm(gen(built.request), None, producer)
    assert producer.puts == []


@pytest.mark.parametrize("dtype", UNSUPPORTED_DTYPES)
def test_refused_dtypes_are_refused_by_smgs_reader(dtype):
    """The dtypes the bridge refuses are the ones SMG's own tensor decoding refuses."""
    with pytest.raises(ValueError, match="Unsupported proto tensor dtype"):
        tensor_from_parts(b"\0" * 8, [1], dtype)
