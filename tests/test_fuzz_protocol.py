"""Fuzzing the protocol decoders: every input to ``decode_envelope`` and ``decode_kwargs_item``
gets a typed ``ShmTransportError`` or a valid result, never another exception, never a crash.

Budget: a few hundred examples per decoder (``FUZZ_EXAMPLES``, default 150), no deadline; the
committed corpus in ``tests/fuzz_corpus/`` is replayed on every run.
"""
from __future__ import annotations

import base64
import json
import math
import os
import pathlib

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmtransport.errors import ShmTransportError
from shmtransport.protocol.envelope import decode_envelope
from shmtransport.protocol.items import FeatureItem
from shmtransport.protocol.limits import Limits
from shmtransport.protocol.msgpack_kwargs import DecodedKwargs, decode_kwargs_item, encode_kwargs_item
from shmtransport.tensors import DTYPE_ITEMSIZE

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize="FUZZ_EXAMPLES" not in os.environ,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
CORPUS = pathlib.Path(__file__).parent / "fuzz_corpus"
SMALL_LIMITS = Limits(msgpack_max_nodes=512, msgpack_max_depth=8, max_fields=8)
DEFAULT_LIMITS = Limits()


def valid_item_bytes() -> bytes:
    return encode_kwargs_item({"pixel_values": np.arange(12, dtype=np.float32).reshape(3, 4),
                               "image_grid_thw": np.int64([[1, 2, 2]])})


def valid_envelope() -> dict:
    return {"mm_hashes": {"image": ["a" * 16]}, "mm_placeholders": {"image": [[2, 4]]},
            "kwargs_data": {"image": [base64.b64encode(valid_item_bytes()).decode()]}}


# -- the invariant, checked the same way for fuzzed and corpus inputs ------------------------------
def check_kwargs(raw: bytes, limits: Limits = DEFAULT_LIMITS) -> str:
    """Typed error or a decoded item whose every tensor's bytes match its dtype and shape."""
    try:
        out = decode_kwargs_item(raw, limits)
    except ShmTransportError as exc:
        return exc.reason.value
    assert isinstance(out, DecodedKwargs)
    assert out.tensors, "a decoded item has at least one tensor"
    for key, (dtype, shape, data) in out.tensors.items():
        assert isinstance(key, str) and dtype in DTYPE_ITEMSIZE
        assert memoryview(data).nbytes == math.prod(shape) * DTYPE_ITEMSIZE[dtype]
        # zero-copy: the tensor bytes lie inside the input
        assert memoryview(data).obj is not None
    return "ok"


def check_envelope(features, **kwargs) -> str:
    try:
        items = decode_envelope(features, **kwargs)
    except ShmTransportError as exc:
        return exc.reason.value
    assert isinstance(items, list) and all(isinstance(i, FeatureItem) for i in items)
    for it in items:
        assert it.placeholder.length >= 1
    return "ok"


# -- MessagePack kwargs -------------------------------------------------------------------------
@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes_as_kwargs_messagepack_get_a_typed_error_or_a_valid_item(raw):
    check_kwargs(raw)


@FUZZ
@given(st.data())
def test_mutated_valid_kwargs_messagepack_gets_a_typed_error_or_a_valid_item(data):
    raw = bytearray(valid_item_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "truncate", "insert", "delete", "set"]))
        pos = data.draw(st.integers(0, max(len(raw) - 1, 0)))
        if op == "flip" and raw:
            raw[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "truncate":
            del raw[pos:]
        elif op == "insert":
            raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and raw:
            del raw[pos:pos + data.draw(st.integers(1, 8))]
        elif op == "set" and raw:
            raw[pos] = data.draw(st.sampled_from([0xC1, 0xC7, 0xC9, 0xD4, 0xD8, 0xDC, 0xDD, 0xDE, 0xDF, 0x00, 0xFF]))
    check_kwargs(bytes(raw))


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 64), (1 << 64) - 1), st.floats(),
                     st.text(max_size=8), st.binary(max_size=8),
                     st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=16)))
_objects = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.dictionaries(st.one_of(st.text(max_size=6), st.integers(-3, 3)), inner, max_size=4)), max_leaves=24)
_shapes = st.lists(st.one_of(st.integers(-2, 6), st.just(1 << 40), st.booleans()), max_size=4)
_dtypes = st.one_of(st.sampled_from(sorted(DTYPE_ITEMSIZE)), st.text(max_size=6))


@st.composite
def _items(draw):
    """Structured items: the right skeleton with wrong parts (dtype, shape, payload, field)."""
    item = {}
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.one_of(st.text(min_size=0, max_size=4), st.just("x" * 300)))
        dtype = draw(_dtypes)
        shape = draw(_shapes)
        n = draw(st.integers(0, 64))
        payload = draw(st.one_of(st.just(msgpack.ExtType(3, b"\0" * n)), _scalars))
        field = draw(st.one_of(
            st.just(["batched", {"keep_on_cpu": False}]),
            st.builds(lambda bs: ["shared", {"batch_size": bs}], st.one_of(st.integers(-2, 3), _scalars)),
            st.builds(lambda d, s: ["flat", {"dim": d, "slices": s}], st.one_of(st.integers(-5, 5), _scalars),
                      st.lists(st.one_of(st.lists(st.one_of(st.none(), st.integers(-3, 3)), max_size=4),
                                         _objects), max_size=3)),
            _objects))
        elem = {"data": [dtype, shape, payload], "field": field}
        if draw(st.booleans()):
            elem = draw(st.one_of(st.just({"data": elem["data"]}), _objects, st.just(elem)))
        item[key] = elem
    return item


@FUZZ
@given(st.one_of(_objects, _items()))
def test_structured_random_messagepack_gets_a_typed_error_or_a_valid_item(obj):
    try:
        raw = msgpack.packb(obj, use_bin_type=True)
    except (ValueError, OverflowError, TypeError):
        return  # not encodable: not an input the decoder can ever see
    check_kwargs(raw)
    check_kwargs(raw, SMALL_LIMITS)


def test_deeply_nested_and_huge_node_count_messagepack_is_refused_before_decoding():
    assert check_kwargs(b"\x91" * 100_000 + b"\x00") == "invalid_argument"
    assert check_kwargs(b"\xdd\xff\xff\xff\xff") == "invalid_argument"  # array of 4 G entries, truncated
    assert check_kwargs(b"\xdf\xff\xff\xff\xff") == "invalid_argument"
    assert check_kwargs(b"\xc9\xff\xff\xff\xff\x03") == "invalid_argument"  # ext32 of 4 GiB, truncated
    assert check_kwargs(msgpack.packb({"k": {"data": ["float32", [1], msgpack.ExtType(1, b"x")],
                                             "field": ["batched", {}]}})) == "invalid_argument"  # pickle ext


# -- envelope ------------------------------------------------------------------------------------
_json = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70),
                               st.floats(allow_nan=False), st.text(max_size=10)),
                     lambda inner: st.one_of(st.lists(inner, max_size=4),
                                             st.dictionaries(st.text(max_size=12), inner, max_size=4)),
                     max_leaves=30)


@FUZZ
@given(st.one_of(_json, st.text(max_size=64), st.binary(max_size=64)))
def test_random_json_values_as_envelope_get_a_typed_error_or_valid_items(features):
    check_envelope(features)


@st.composite
def _mutated_envelopes(draw):
    env = json.loads(json.dumps(valid_envelope()))
    kind = draw(st.sampled_from(["hash", "placeholder", "kwargs", "modality", "extra_key", "lengths", "prompt"]))
    if kind == "hash":
        env["mm_hashes"]["image"][0] = draw(st.one_of(_json, st.text(max_size=600), st.just("xxh3-128:" + "0" * 32)))
    elif kind == "placeholder":
        env["mm_placeholders"]["image"][0] = draw(st.one_of(
            _json, st.lists(st.integers(-(1 << 65), 1 << 65), max_size=3),
            st.fixed_dictionaries({"offset": st.integers(-2, 1 << 65), "length": st.integers(-2, 8)},
                                  optional={"is_embed": st.one_of(_json, st.lists(st.booleans(), max_size=8)),
                                            "junk": _json})))
    elif kind == "kwargs":
        raw = bytearray(valid_item_bytes())
        if raw and draw(st.booleans()):
            raw[draw(st.integers(0, len(raw) - 1))] ^= 0xFF
        env["kwargs_data"]["image"][0] = draw(st.one_of(
            st.just(base64.b64encode(bytes(raw)).decode()), _json, st.text(max_size=40),
            st.just(base64.b64encode(bytes(raw)).decode() + "=")))
    elif kind == "modality":
        name = draw(st.one_of(st.sampled_from(["video", "audio", "Image", "", "x" * 100]), st.text(max_size=8)))
        for k in env:
            env[k] = {name: env[k]["image"]}
    elif kind == "extra_key":
        env[draw(st.text(max_size=8))] = draw(_json)
    elif kind == "lengths":
        key = draw(st.sampled_from(sorted(env)))
        env[key]["image"] = env[key]["image"] * draw(st.integers(0, 3))
    prompt = draw(st.one_of(st.none(), st.integers(0, 10)))
    return env, prompt


@FUZZ
@given(_mutated_envelopes())
def test_mutated_valid_envelopes_get_a_typed_error_or_valid_items(case):
    env, prompt = case
    check_envelope(env, prompt_len=prompt)
    check_envelope(json.dumps(env), prompt_len=prompt)


def test_the_valid_envelope_used_for_mutation_decodes():
    assert check_envelope(valid_envelope()) == "ok"
    assert check_kwargs(valid_item_bytes()) == "ok"


# -- the committed corpus ------------------------------------------------------------------------
def _corpus(kind: str) -> list[pathlib.Path]:
    return sorted((CORPUS / kind).glob("*"))


@pytest.mark.parametrize("path", _corpus("msgpack"), ids=lambda p: p.name)
def test_corpus_kwargs_input_gets_its_recorded_verdict(path):
    expected = path.name.split("__")[0]  # "<verdict>__<name>.bin"
    assert check_kwargs(path.read_bytes()) == expected


@pytest.mark.parametrize("path", _corpus("envelope"), ids=lambda p: p.name)
def test_corpus_envelope_input_gets_its_recorded_verdict(path):
    expected = path.name.split("__")[0]
    assert check_envelope(path.read_text()) == expected
