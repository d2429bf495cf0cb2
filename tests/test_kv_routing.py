"""KV-routing identity: the frontend's projection and the worker's view give the same block hashes."""
from __future__ import annotations

import logging
import struct

import numpy as np
import xxhash

from shmtransport.client import Consumer, Producer
from shmtransport.embedmask import EmbedMask, PlaceholderRange
from shmtransport.frontend import request as frontend
from shmtransport.protocol import routing
from shmtransport.protocol.items import FeatureItem
from shmtransport.protocol.kv_routing import (
    XXH3_SEED,
    RoutingItem,
    block_hashes,
    items_from_engine_inputs,
    items_from_request,
    routing_identity,
    salt_seed,
    sequence_hashes,
)
from shmtransport.worker import request as worker

IMG, AUD, TXT = 32000, 32001, 7
BS = 4


def image(seed, offset, length, mask=None, modality="image"):
    rng = np.random.default_rng(seed)
    return FeatureItem(modality, {"x": rng.standard_normal((2, 3), dtype=np.float32)},
                       PlaceholderRange(offset, length, None if mask is None else EmbedMask.from_bools(mask)))


def prompt(n, spans):
    t = [TXT + (i % 5) for i in range(n)]
    for off, ln, tok in spans:
        t[off:off + ln] = [tok] * ln
    return t


def both_views(items, tokens, mode="inline", producer=None, consumer=None, **kw):
    built = frontend.build_request(producer, items, mode=mode, prompt_len=len(tokens))
    try:
        front = routing_identity(tokens, items_from_request(built.request), block_size=BS, **kw)
        with worker.open_request(consumer, built.request) as inputs:
            back = routing_identity(tokens, items_from_engine_inputs(inputs), block_size=BS, **kw)
    finally:
        built.release()
    return built.request, front, back


def pads(request):
    return [routing.pad_value(it.mm_hash) for b in request.batches for it in b.items]


def test_dense_layout():
    tokens = prompt(16, [(2, 8, IMG)])
    req, front, back = both_views([image(1, 2, 8)], tokens)
    assert front.multimodal and front.block_hashes == back.block_hashes and front.tokens == back.tokens
    (pad,) = pads(req)
    assert front.tokens == tokens[:2] + [pad] * 8 + tokens[10:]
    assert 1_000_000 <= pad < 1_000_000 + (1 << 30)
    # differs from the token-only hashes (the image identity is in the key)
    assert front.block_hashes[1] != block_hashes(tokens, BS)[1]
    assert front.block_hashes[0] != block_hashes(tokens, BS)[0]


def test_sparse_is_embed_layout_keeps_non_embed_tokens():
    mask = [False, True, True, False, True, True, True, False]
    tokens = prompt(16, [(4, 8, IMG)])
    tokens[4], tokens[7], tokens[11] = 11, 12, 13  # e.g. <start>, <row break>, <end>
    req, front, back = both_views([image(2, 4, 8, mask)], tokens)
    assert front.multimodal and front.block_hashes == back.block_hashes
    (pad,) = pads(req)
    expect = list(tokens)
    for i, m in enumerate(mask):
        if m:
            expect[4 + i] = pad
    assert front.tokens == expect


def test_adjacent_multi_image_same_identity():
    tokens = prompt(16, [(2, 4, IMG), (6, 4, IMG)])
    items = [image(3, 2, 4), image(3, 6, 4)]  # the same image twice, back to back
    req, front, back = both_views(items, tokens)
    assert front.multimodal and front.block_hashes == back.block_hashes
    assert pads(req)[0] == pads(req)[1]


def test_adjacent_multi_image_different_identities_fall_back(caplog):
    tokens = prompt(16, [(2, 4, IMG), (6, 4, IMG)])
    with caplog.at_level(logging.INFO, logger="shmtransport.protocol.kv_routing"):
        _, front, back = both_views([image(4, 2, 4), image(5, 6, 4)], tokens)
    assert not front.multimodal and "adjacent" in front.fallback_reason
    assert front.tokens == tokens and front.block_hashes == block_hashes(tokens, BS, XXH3_SEED)
    assert back.block_hashes == front.block_hashes
    assert "adjacent" in caplog.text


def test_separated_multi_image_and_mixed_modalities():
    tokens = prompt(24, [(1, 4, IMG), (8, 4, IMG), (14, 6, AUD)])
    items = [image(6, 1, 4), image(7, 8, 4), image(8, 14, 6, modality="audio")]
    req, front, back = both_views(items, tokens)
    assert front.multimodal and front.block_hashes == back.block_hashes
    assert len(set(pads(req))) == 3
    p = pads(req)
    assert front.tokens[1:5] == [p[0]] * 4 and front.tokens[8:12] == [p[1]] * 4 and front.tokens[14:20] == [p[2]] * 6


def test_worker_view_over_shared_memory(daemon):
    tokens = prompt(20, [(3, 6, IMG), (12, 5, IMG)])
    mask = [True, True, False, True, True]
    with Producer(daemon.socket_path, timeout_s=10) as producer, Consumer(daemon.socket_path, timeout_s=10) as consumer:
        _, front, back = both_views([image(9, 3, 6), image(10, 12, 5, mask)], tokens, mode="shm",
                                    producer=producer, consumer=consumer, cache_namespace="ns", lora_name="a")
    assert front.multimodal and front.block_hashes == back.block_hashes
    assert front.sequence_hashes == back.sequence_hashes


def test_maskless_nonuniform_span_falls_back():
    tokens = prompt(16, [(2, 8, IMG)])
    tokens[5] = 99
    _, front, back = both_views([image(11, 2, 8)], tokens)
    assert not front.multimodal and "require is_embed" in front.fallback_reason
    assert front.tokens == tokens and back.block_hashes == front.block_hashes


def test_other_ambiguous_layouts_fall_back():
    m = RoutingItem("image", 2, 4, None, "xxh3-128:" + "ab" * 16)
    tokens = [IMG] * 8
    assert routing_identity(tokens, [m, RoutingItem("image", 4, 2, None, m.mm_hash)]).fallback_reason.startswith(
        "overlapping")
    assert "outside" in routing_identity(tokens, [RoutingItem("image", 6, 4, None, m.mm_hash)]).fallback_reason
    assert "no identity" in routing_identity(tokens, [RoutingItem("image", 2, 4, None, "")]).fallback_reason


def test_hash_recipe_and_seed():
    tokens = list(range(10))
    blocks = block_hashes(tokens, 4)
    assert len(blocks) == 2  # partial tail block not hashed
    assert blocks[0] == xxhash.xxh3_64_intdigest(struct.pack("<4I", 0, 1, 2, 3), seed=XXH3_SEED)
    seq = sequence_hashes(blocks)
    assert seq[0] == blocks[0]
    assert seq[1] == xxhash.xxh3_64_intdigest(struct.pack("<QQ", blocks[0], blocks[1]), seed=XXH3_SEED)
    # empty = absent; a namespace and a LoRA of the same name salt differently
    # (the values themselves are checked against Dynamo in test_conformance_dynamo)
    assert salt_seed() == salt_seed("", "") == salt_seed(None, "") == XXH3_SEED
    seeds = {salt_seed("ns"), salt_seed(None, "ns"), salt_seed("ns", "lora"), salt_seed("n", "slora")}
    assert len(seeds) == 4 and XXH3_SEED not in seeds
    a = routing_identity(tokens, [], block_size=4, cache_namespace="ns")
    b = routing_identity(tokens, [], block_size=4, lora_name="ns")
    assert a.block_hashes != b.block_hashes != blocks
    # the chain is not salted: the salt is in every block hash already
    assert a.sequence_hashes == sequence_hashes(a.block_hashes)
    assert a.sequence_hashes[1] == xxhash.xxh3_64_intdigest(struct.pack("<QQ", *a.block_hashes), seed=XXH3_SEED)


def test_block_mm_hashes_suffix():
    tokens = list(range(8))
    plain = block_hashes(tokens, 4)
    with_mm = block_hashes(tokens, 4, block_mm_hashes=[[7, 3], None, [1]])  # entries past the last block ignored
    assert with_mm[1] == plain[1] and with_mm[0] != plain[0]
    assert with_mm[0] == xxhash.xxh3_64_intdigest(struct.pack("<4I2Q", 0, 1, 2, 3, 3, 7), seed=XXH3_SEED)
    assert block_hashes(tokens, 4, block_mm_hashes=[[], None]) == plain


def test_pad_matches_routing_marker_u64():
    ident = "xxh3-128:" + "cd" * 16
    marker = routing.routing_marker(ident)
    assert routing.pad_value(marker) == routing.pad_value(ident)
