"""Content identity: golden vectors for every scheme, reproduced by both kernel backends, plus the
properties of ``docs/design.md``, Identity (domain separation: key/dtype/shape always count).

Regenerate the golden file (only when the identity definition changes on purpose, which also
changes its version string): ``python tests/test_identity.py --regen``. Its ``grpc_mm`` vectors are
bytes from vLLM's real ``MsgpackEncoder`` (never our own encoder); the random-item conformance is
tests/test_conformance_vllm.py.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import struct
import sys

import msgpack
import numpy as np
import pytest
import xxhash

from shmtransport import _purepy, identity
from shmtransport.errors import InvalidArgument
from shmtransport.protocol.items import FieldConfig
from shmtransport.protocol.msgpack_kwargs import encode_kwargs_item

GOLDEN = pathlib.Path(__file__).parent / "golden" / "identity_vectors.json"
C = _purepy.TREE_CHUNK_NBYTES
TENSOR_SCHEMES = [name for name, s in identity.SCHEMES.items() if not s.over_msgpack]  # two-level


def _backends():
    out = [pytest.param(_purepy, id="python")]
    if os.environ.get("SHMTRANSPORT_BACKEND", "auto").strip().lower() == "c":
        from shmtransport import _native

        out.append(pytest.param(_native, id="c"))
    else:
        try:
            from shmtransport import _native

            out.append(pytest.param(_native, id="c"))
        except ImportError:
            pass
    return out


@pytest.fixture(params=_backends())
def backend(request, monkeypatch):
    monkeypatch.setattr(identity, "kernels", request.param)
    return request.param


def seeded_bytes(seed: int, nbytes: int) -> bytes:
    """Deterministic bytes independent of numpy's RNG: SHA-256 in counter mode."""
    blocks = (nbytes + 31) // 32
    return b"".join(hashlib.sha256(struct.pack("<QQ", seed, i)).digest() for i in range(blocks))[:nbytes]


def _tensor_bytes(spec: dict) -> bytes:
    return bytes.fromhex(spec["hex"]) if "hex" in spec else seeded_bytes(spec["seed"], spec["nbytes"])


def _item_tensors(item: dict) -> dict:
    return {t["key"]: (t["dtype"], tuple(t["shape"]), _tensor_bytes(t)) for t in item["tensors"]}


def _grpc_cases() -> list[tuple[str, str, dict, dict]]:
    """(name, modality, kwargs in item order, fields) of the grpc-mm golden vectors."""
    f32 = np.arange(12, dtype="<f4").reshape(4, 3)
    return [
        ("pixel_values_flat_float32", "image", {"pixel_values": np.array([1.0, 2.0], "<f4")},
         {"pixel_values": FieldConfig("flat", slices=(slice(0, 2),))}),  # protocol-facts 3.3
        ("shared_float32_zeros", "image", {"x": np.zeros(1, "<f4")}, {"x": FieldConfig("shared", batch_size=1)}),
        ("unsorted_keys_flat_and_batched", "image", {"pixel_values": f32, "image_grid_thw": np.int64([[1, 2, 2]])},
         {"pixel_values": FieldConfig("flat", True, ((slice(None), slice(0, 3)),), 1)}),
        ("int_float_and_tensor_list", "audio", {"feats": [np.ones(2, "<f2"), np.zeros(3, "<f2")], "n": 3,
                                                "scale": 0.5}, {"n": FieldConfig("shared", batch_size=2)}),
        ("empty_map_video", "video", {}, {}),
    ]


def vllm_kwargs_msgpack(kwargs: dict, fields: dict) -> bytes:
    """vLLM's own bytes for an item: ``MsgpackEncoder(size_threshold=2**62).encode(item)`` (gRPC form)."""
    import torch

    pytest.importorskip("vllm")
    from vllm.multimodal import inputs as mm
    from vllm.v1.serial_utils import MsgpackEncoder

    def data(v):
        return torch.from_numpy(v) if isinstance(v, np.ndarray) else [data(x) for x in v] if isinstance(v, list) else v

    def field(fc: FieldConfig):
        if fc.kind == "flat":
            return mm.MultiModalFlatField(slices=list(fc.slices), dim=fc.dim, keep_on_cpu=fc.keep_on_cpu)
        if fc.kind == "shared":
            return mm.MultiModalSharedField(batch_size=fc.batch_size, keep_on_cpu=fc.keep_on_cpu)
        return mm.MultiModalBatchedField(keep_on_cpu=fc.keep_on_cpu)

    item = mm.MultiModalKwargsItem({k: mm.MultiModalFieldElem(data(v), field(fields.get(k) or FieldConfig()))
                                    for k, v in kwargs.items()})
    (raw,) = MsgpackEncoder(size_threshold=2**62).encode(item)
    return bytes(raw)


def pixel_values_msgpack() -> bytes:
    """protocol-facts 3.3: vLLM's MsgpackEncoder bytes of a 2-element float32 flat pixel_values item."""
    _, _, kwargs, fields = _grpc_cases()[0]
    return vllm_kwargs_msgpack(kwargs, fields)


def _golden_items() -> list[dict]:
    f32 = np.arange(6, dtype="<f4").reshape(2, 3)
    bf16_as_u16 = np.array([0x3F80, 0x4000, 0xBF80, 0x7FC0], dtype="<u2")  # 1.0, 2.0, -1.0, nan
    return [
        {"name": "single_float32", "modality": "image",
         "tensors": [{"key": "pixel_values", "dtype": "float32", "shape": [2, 3], "hex": f32.tobytes().hex()}]},
        {"name": "multiple_keys", "modality": "image",
         "tensors": [
             {"key": "pixel_values", "dtype": "float32", "shape": [1, 2, 2],
              "hex": np.array([0.5, -1.5, 3.25, 8.0], "<f4").tobytes().hex()},
             {"key": "image_grid_thw", "dtype": "int64", "shape": [1, 3],
              "hex": np.array([[1, 2, 2]], "<i8").tobytes().hex()},
             {"key": "attention_mask", "dtype": "bool", "shape": [5], "hex": "0100010101"}]},
        {"name": "bfloat16_as_uint16_bytes", "modality": "video",
         "tensors": [{"key": "pixel_values_videos", "dtype": "bfloat16", "shape": [4],
                      "hex": bf16_as_u16.tobytes().hex()}]},
        {"name": "same_bytes_as_uint16", "modality": "video",
         "tensors": [{"key": "pixel_values_videos", "dtype": "uint16", "shape": [4],
                      "hex": bf16_as_u16.tobytes().hex()}]},
        {"name": "zero_size_tensor", "modality": "audio",
         "tensors": [{"key": "input_features", "dtype": "float16", "shape": [0, 3], "hex": ""},
                     {"key": "feature_lens", "dtype": "int32", "shape": [1], "hex": "00000000"}]},
        {"name": "scalar_rank0", "modality": "image",
         "tensors": [{"key": "num_crops", "dtype": "int64", "shape": [], "hex": "0300000000000000"}]},
        {"name": "larger_than_tree_chunk", "modality": "image",
         "tensors": [{"key": "pixel_values", "dtype": "uint8", "shape": [C + 12345], "seed": 7,
                      "nbytes": C + 12345},
                     {"key": "image_sizes", "dtype": "int64", "shape": [2],
                      "hex": np.array([448, 448], "<i8").tobytes().hex()}]},
    ]


def generate_golden() -> dict:
    items = []
    for item in _golden_items():
        tensors = _item_tensors(item)
        item["tensor_digests"] = {s: {k: identity.tensor_digest(s, v[2]).hex() for k, v in tensors.items()}
                                  for s in TENSOR_SCHEMES}
        item["identity"] = {s: identity.item_identity(item["modality"], tensors, scheme=s)
                            for s in TENSOR_SCHEMES}
        items.append(item)
    grpc = []
    for name, modality, kwargs, fields in _grpc_cases():
        raw = vllm_kwargs_msgpack(kwargs, fields)
        grpc.append({"name": name, "modality": modality, "kwargs_msgpack_hex": raw.hex(),
                     "identity": identity.grpc_mm_identity(modality, raw)})
    return {"format": "shmtransport identity golden vectors v1", "tree_chunk_nbytes": C,
            "seeded_bytes": "concat(sha256(u64le(seed) || u64le(i)) for i = 0..)[:nbytes]",
            "items": items, "grpc_mm": grpc}


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


# ---------------------------------------------------------------------------------------------
# Golden vectors
# ---------------------------------------------------------------------------------------------
def test_golden_file_covers_every_scheme(golden):
    schemes = {s for item in golden["items"] for s in item["identity"]}
    assert schemes == set(TENSOR_SCHEMES)
    assert golden["grpc_mm"] and set(identity.SCHEMES) == schemes | {"grpc-mm"}
    assert golden["tree_chunk_nbytes"] == C


def test_every_backend_reproduces_the_golden_identities(golden, backend):
    for item in golden["items"]:
        tensors = _item_tensors(item)
        for scheme, expected in item["identity"].items():
            assert identity.item_identity(item["modality"], tensors, scheme=scheme) == expected, item["name"]
            for key, (_, _, data) in tensors.items():
                assert identity.tensor_digest(scheme, data).hex() == item["tensor_digests"][scheme][key]


def test_golden_identities_from_numpy_arrays_equal_those_from_raw_bytes(golden, backend):
    for item in golden["items"]:
        if any(t["dtype"] == "bfloat16" for t in item["tensors"]):
            continue
        arrays = {t["key"]: np.frombuffer(_tensor_bytes(t), dtype=np.dtype(t["dtype"]).newbyteorder("<"))
                  .reshape(t["shape"]) for t in item["tensors"]}
        for scheme, expected in item["identity"].items():
            assert identity.item_identity(item["modality"], arrays, scheme=scheme) == expected


def test_golden_grpc_mm_identities(golden):
    for case in golden["grpc_mm"]:
        raw = bytes.fromhex(case["kwargs_msgpack_hex"])
        assert identity.grpc_mm_identity(case["modality"], raw) == case["identity"]


def test_our_encoder_reproduces_vllms_golden_grpc_bytes_and_identities(golden):
    cases = {c["name"]: c for c in golden["grpc_mm"]}
    assert set(cases) == {name for name, *_ in _grpc_cases()}
    for name, modality, kwargs, fields in _grpc_cases():
        ours = encode_kwargs_item(kwargs, fields)
        assert ours.hex() == cases[name]["kwargs_msgpack_hex"], name
        assert identity.grpc_mm_identity(modality, ours) == cases[name]["identity"]


def test_large_golden_item_uses_tree_mode(golden):
    item = next(i for i in golden["items"] if i["name"] == "larger_than_tree_chunk")
    data = _tensor_bytes(item["tensors"][0])
    assert len(data) > C
    assert item["tensor_digests"]["xxh3-128"]["pixel_values"] != xxhash.xxh3_128(data).hexdigest()


def test_golden_file_is_up_to_date():
    assert json.loads(GOLDEN.read_text()) == json.loads(json.dumps(generate_golden()))


# ---------------------------------------------------------------------------------------------
# The recipes, recomputed independently
# ---------------------------------------------------------------------------------------------
def test_grpc_mm_identity_matches_the_vllm_recipe_on_vllms_msgpack_payload():
    raw = pixel_values_msgpack()
    # the payload really is the map of protocol-facts 3.3
    decoded = msgpack.unpackb(raw, raw=False)
    assert decoded["pixel_values"]["data"][0] == "float32"
    assert decoded["pixel_values"]["data"][2] == msgpack.ExtType(3, struct.pack("<ff", 1.0, 2.0))
    assert decoded["pixel_values"]["field"][0] == "flat"
    modality = b"image"
    expected = hashlib.sha256(b"vllm.grpc.preprocessed-mm.v1" + struct.pack(">Q", len(modality)) + modality
                              + struct.pack(">Q", len(raw)) + raw).hexdigest()
    assert identity.grpc_mm_identity("image", raw) == "grpc-mm:" + expected
    assert identity.grpc_mm_identity("image", bytearray(raw)) == "grpc-mm:" + expected
    assert identity.grpc_mm_identity("video", raw) != "grpc-mm:" + expected


def test_combine_hashes_the_documented_framed_stream(backend):
    a = np.arange(6, dtype="<f4").reshape(2, 3)
    b = np.array([7], dtype="<i8")

    def framed(s: str) -> bytes:
        return struct.pack("<Q", len(s.encode())) + s.encode()

    for scheme, h in (("xxh3-128", lambda x: xxhash.xxh3_128(x).digest()),
                      ("blake3", lambda x: __import__("blake3").blake3(x).digest())):
        stream = b"shmtransport.identity.v1\0" + framed(scheme) + framed("image") + struct.pack("<Q", 2)
        for key, arr, dt in (("a_key", a, "float32"), ("b_key", b, "int64")):  # sorted key order
            stream += framed(key) + framed(dt) + struct.pack("<Q", arr.ndim)
            stream += b"".join(struct.pack("<Q", d) for d in arr.shape) + struct.pack("<Q", arr.nbytes)
            stream += h(arr.tobytes())
        expected = f"{scheme}:{h(stream).hex()}"
        assert identity.item_identity("image", {"b_key": b, "a_key": a}, scheme=scheme) == expected
        assert identity.item_identity("image", {"a_key": a, "b_key": b}, scheme=scheme) == expected


# ---------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", ["xxh3-128", "blake3"])
def test_items_differing_only_in_key_dtype_shape_or_modality_never_share_an_identity(scheme, backend):
    raw = np.arange(8, dtype=np.uint8)
    ids = {
        identity.item_identity("image", {"x": raw}, scheme),
        identity.item_identity("image", {"y": raw}, scheme),
        identity.item_identity("image", {"x": raw.view(np.int8)}, scheme),
        identity.item_identity("image", {"x": raw.reshape(2, 4)}, scheme),
        identity.item_identity("image", {"x": raw.reshape(4, 2)}, scheme),
        identity.item_identity("image", {"x": raw.view("<u2")}, scheme),
        identity.item_identity("video", {"x": raw}, scheme),
        identity.item_identity("image", {"x": raw[:4], "y": raw[4:]}, scheme),
        identity.item_identity("image", {"x": raw[:4], "z": raw[4:]}, scheme),
    }
    assert len(ids) == 9


def test_identity_is_independent_of_memory_layout(backend):
    arr = np.arange(24, dtype=np.float32).reshape(4, 6)
    fortran = np.asfortranarray(arr)
    assert identity.item_identity("image", {"p": arr}) == identity.item_identity("image", {"p": fortran})


def test_scheme_prefix_and_digest_lengths(backend):
    arr = np.zeros(3, np.float32)
    assert identity.item_identity("image", {"p": arr}).startswith("xxh3-128:")
    assert len(identity.item_identity("image", {"p": arr}).split(":")[1]) == 32
    assert len(identity.item_identity("image", {"p": arr}, "blake3").split(":")[1]) == 64
    assert tuple(identity.SCHEMES) == ("xxh3-128", "blake3", "grpc-mm")


def test_tensor_digest_of_xxh3_scheme_is_the_tree_digest(backend):
    data = seeded_bytes(3, 2 * C + 1)
    assert identity.tensor_digest("xxh3-128", data) == _purepy.tree_digest(data)
    assert identity.tensor_digest("xxh3-128", data, threads=1) == _purepy.tree_digest(data)
    assert identity.tensor_digest("blake3", data, threads=2) == identity.tensor_digest("blake3", data)


def test_torch_tensors_including_bfloat16_are_hashed_as_their_bytes(golden):
    torch = pytest.importorskip("torch")
    item = next(i for i in golden["items"] if i["name"] == "bfloat16_as_uint16_bytes")
    u16 = np.frombuffer(bytes.fromhex(item["tensors"][0]["hex"]), "<u2").astype(np.int32)
    t = torch.tensor(u16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    assert identity.dtype_name(t) == "bfloat16"
    assert identity.item_identity("video", {"pixel_values_videos": t}) == item["identity"]["xxh3-128"]


# ---------------------------------------------------------------------------------------------
# dtypes, cache identifiers, UUIDs, validation
# ---------------------------------------------------------------------------------------------
def test_dtype_names_are_vllms_and_only_the_thirteen_are_allowed():
    assert len(identity.DTYPE_ITEMSIZE) == 13
    for name, size in identity.DTYPE_ITEMSIZE.items():
        assert identity.dtype_name(name) == name
        assert identity.dtype_name("torch." + name) == name
        if name != "bfloat16":
            assert identity.dtype_name(np.dtype(name)) == name
            assert np.dtype(name).itemsize == size
    assert identity.dtype_name(np.zeros(2, bool)) == "bool"
    for bad in ("float8_e4m3fn", "complex64", "object", "int4", np.dtype("complex64"), np.dtype("U3"),
                np.dtype(">f4"), 3):
        with pytest.raises(InvalidArgument):
            identity.dtype_name(bad)


def test_cache_identifier_prefixes_the_adapter_only_when_given():
    assert identity.cache_identifier("xxh3-128:ab") == "xxh3-128:ab"
    assert identity.cache_identifier("xxh3-128:ab", None) == "xxh3-128:ab"
    assert identity.cache_identifier("xxh3-128:ab", "") == "xxh3-128:ab"
    assert identity.cache_identifier("xxh3-128:ab", "lora1") == "lora1:xxh3-128:ab"


@pytest.mark.parametrize("bad", ["", ".", "..", "a/b", "/", "a\\b", "\\", "a\0b", None, 5, b"abc"])
def test_validate_uuid_rejects_unsafe_identifiers(bad):
    with pytest.raises(InvalidArgument, match="uuid"):
        identity.validate_uuid(bad)


def test_identities_we_produce_pass_uuid_validation(backend):
    arr = np.arange(5, dtype=np.int32)
    for scheme in TENSOR_SCHEMES:
        ident = identity.item_identity("image", {"k": arr}, scheme)
        assert identity.validate_uuid(ident) == ident
        assert identity.validate_uuid(identity.cache_identifier(ident, "adapter"))
    assert identity.validate_uuid(identity.grpc_mm_identity("image", pixel_values_msgpack()))


def test_invalid_arguments_raise_invalid_argument_naming_the_argument():
    arr = np.zeros(2, np.float32)
    digest = bytes(16)
    cases = [
        (lambda: identity.item_identity("", {"k": arr}), "modality"),
        (lambda: identity.item_identity("image", {"k": arr}, scheme="md5"), "scheme"),
        (lambda: identity.item_identity("image", {"k": arr}, scheme="grpc-mm"), "grpc_mm_identity"),
        (lambda: identity.item_identity("image", [arr]), "tensors"),
        (lambda: identity.item_identity("image", {"k": [1, "two"]}), "tensors"),  # [1, 2] is vLLM data
        (lambda: identity.combine("xxh3-128", "image", [("k", identity.NESTED, (2,), 0, digest)]), "no shape"),
        (lambda: identity.combine("xxh3-128", "image", [("k", identity.NESTED, (), 8, digest)]), "nbytes"),
        (lambda: identity.item_identity("image", {"k": np.zeros(2, np.complex64)}), "dtype"),
        (lambda: identity.item_identity("image", {"": arr}), "key"),
        (lambda: identity.combine("xxh3-128", "image", [("k", "float32", (2,), 7, digest)]), "nbytes"),
        (lambda: identity.combine("xxh3-128", "image", [("k", "float32", (2,), 8, bytes(15))]), "digest"),
        (lambda: identity.combine("blake3", "image", [("k", "float32", (2,), 8, digest)]), "digest"),
        (lambda: identity.combine("xxh3-128", "image", [("k", "float32", (-2,), 8, digest)]), "shape"),
        (lambda: identity.combine("xxh3-128", "image", [("k", "float32", (2,), 8, digest)] * 2), "twice"),
        (lambda: identity.combine("xxh3-128", "image", [("k", "float32")]), "entries"),
        (lambda: identity.tensor_digest("xxh3-128", np.zeros(8, np.uint8)[::2]), "contiguous"),
        (lambda: identity.tensor_digest("blake3", np.zeros(8, np.uint8)[::2]), "contiguous"),
        (lambda: identity.tensor_digest("xxh3-128", b"x", threads=0), "threads"),
        (lambda: identity.grpc_mm_identity("image", "text"), "kwargs_msgpack"),
        (lambda: identity.grpc_mm_identity("", b"x"), "modality"),
    ]
    for call, word in cases:
        with pytest.raises(InvalidArgument, match=word):
            call()


if __name__ == "__main__":
    if sys.argv[1:] == ["--regen"]:
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(generate_golden(), indent=1) + "\n")
        print(f"wrote {GOLDEN}")
