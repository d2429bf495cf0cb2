"""KV-routing identity of a multimodal request: routing token stream, block and sequence hashes.

Routing token stream (Dynamo ``/generate`` exact projection, protocol-facts 2.6; the
``routing_token_ids`` of Dynamo's ``build_mm_routing_info_from_features``): start from the
prompt token ids; for each multimodal item, every ``is_embed`` position of its placeholder (every
position when the placeholder is dense) is replaced by the item's pad value
``1_000_000 + (u64 & (2**30 - 1))`` with ``u64 = routing.hash_mm_identifier(mm_hash)`` (the
content identity, no adapter prefix; equal to the u64 of the item's routing marker). Positions
that are not embeds keep their token ids.

Block hashes (Dynamo's ``compute_block_hash_for_seq``): for each FULL block of ``block_size``
tokens, ``xxh3_64_with_seed(tokens as little-endian u32 [|| u64le(mm_hash) for each of the block's
multimodal objects, in ascending order], seed)``; partial tail blocks are not hashed (they are never
cached). The mm-hash suffix is Dynamo's ``block_mm_infos`` side channel (``block_mm_hashes`` here);
the pad-value stream above carries the identity instead, with no side channel, as Dynamo's frontend
does today. Sequence hashes chain with the UNSALTED seed: ``seq[0] = block[0]``,
``seq[i] = xxh3_64_with_seed(u64le(seq[i-1]) || u64le(block[i]), 1337)``.

Seed (Dynamo's ``compute_salt_hash``; empty string = absent): ``XXH3_SEED = 1337``, plus
``xxh3_64(utf8 lora_name)`` when a LoRA name is given, plus ``xxh3_64_with_seed(utf8
cache_namespace, 1)`` when a cache namespace is given, wrapping at 2**64.

Ambiguous layouts never produce a wrong hash: they fall back to token-only routing (the plain
prompt token ids), with the reason logged and returned. Ambiguous = a placeholder outside the
prompt, overlapping placeholders, a mask-less span whose token ids are not all equal ("mixed
multimodal placeholder spans require is_embed"), adjacent ranges (prev_end == next_offset) with
different identities, or an item without an identity.

The same ``routing_identity`` runs on the frontend's typed request (``items_from_request``) and on
the worker's ``EngineInputs`` (``items_from_engine_inputs``) and gives the same hashes.
"""
from __future__ import annotations

import dataclasses
import logging
import struct
from typing import Any, Iterable, Sequence

import numpy as np
import xxhash

from ..embedmask import EmbedMask
from ..errors import InvalidArgument
from ..v1 import features_pb2 as fpb
from . import routing

log = logging.getLogger(__name__)

XXH3_SEED = 1337
_U64 = (1 << 64) - 1
DEFAULT_BLOCK_SIZE = 16

__all__ = ["RoutingItem", "RoutingIdentity", "routing_identity", "routing_tokens", "block_hashes",
           "sequence_hashes", "salt_seed", "items_from_request", "items_from_engine_inputs", "XXH3_SEED"]


@dataclasses.dataclass(frozen=True)
class RoutingItem:
    """One multimodal item as routing sees it: its placeholder span, embed mask and content identity."""

    modality: str
    offset: int
    length: int
    is_embed: EmbedMask | None  # None = dense
    mm_hash: str


@dataclasses.dataclass
class RoutingIdentity:
    """What a KV router keys a request on: the routing token stream and its block and sequence hashes."""

    tokens: list[int]               # routing token stream (pads at embed positions) or plain tokens
    block_hashes: list[int]
    sequence_hashes: list[int]
    fallback_reason: str | None     # None = multimodal-aware; else why it routes on tokens only

    @property
    def multimodal(self) -> bool:
        """Whether the identity is multimodal-aware (False: it fell back to tokens only)."""
        return self.fallback_reason is None


def salt_seed(cache_namespace: str | None = None, lora_name: str | None = None) -> int:
    """The block-hash seed for a cache namespace and LoRA name (Dynamo's ``compute_salt_hash``), as a u64."""
    seed = XXH3_SEED
    if lora_name:
        seed += xxhash.xxh3_64_intdigest(lora_name.encode("utf-8"))
    if cache_namespace:
        # seed 1: a namespace and a LoRA of the same name salt differently
        seed += xxhash.xxh3_64_intdigest(cache_namespace.encode("utf-8"), seed=1)
    return seed & _U64


def block_hashes(tokens: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE, seed: int = XXH3_SEED,
                 block_mm_hashes: Sequence[Sequence[int] | None] | None = None) -> list[int]:
    """``block_mm_hashes[i]``: the u64 hashes of the multimodal objects in block i (None: none);
    Dynamo's ``block_mm_infos``. Entries past the last full block are ignored."""
    if block_size <= 0:
        raise InvalidArgument(f"block_size must be > 0, got {block_size}")
    arr = np.asarray(tokens, dtype="<u4")
    out = []
    for i in range(len(arr) // block_size):
        data = arr[i * block_size:(i + 1) * block_size].tobytes()
        mm = block_mm_hashes[i] if block_mm_hashes is not None and i < len(block_mm_hashes) else None
        if mm:
            data += np.asarray(sorted(mm), dtype="<u8").tobytes()
        out.append(xxhash.xxh3_64_intdigest(data, seed=seed))
    return out


def sequence_hashes(blocks: Sequence[int]) -> list[int]:
    """The chain of sequence hashes over ``blocks`` (unsalted: the salt is in every block hash)."""
    # the chain is never salted: the salt is already in every block hash
    out: list[int] = []
    for b in blocks:
        out.append(b if not out else xxhash.xxh3_64_intdigest(struct.pack("<QQ", out[-1], b), seed=XXH3_SEED))
    return out


def routing_tokens(token_ids: Sequence[int], items: Sequence[RoutingItem]) -> tuple[list[int], str | None]:
    """(routing token stream, None) or (plain token ids, reason) for an ambiguous layout."""
    tokens = list(token_ids)
    n = len(tokens)
    ordered = sorted(items, key=lambda it: it.offset)
    prev: RoutingItem | None = None
    for it in ordered:
        end = it.offset + it.length
        if it.length <= 0 or it.offset < 0 or end > n:
            return list(token_ids), f"{it.modality} placeholder [{it.offset}, {end}) is outside the prompt ({n})"
        if not it.mm_hash:
            return list(token_ids), f"{it.modality} item at {it.offset} has no identity"
        if it.is_embed is not None and len(it.is_embed) != it.length:
            return list(token_ids), f"{it.modality} item at {it.offset}: is_embed length != placeholder length"
        if prev is not None:
            prev_end = prev.offset + prev.length
            if it.offset < prev_end:
                return list(token_ids), f"overlapping placeholders at {prev.offset} and {it.offset}"
            if it.offset == prev_end and it.mm_hash != prev.mm_hash:
                return list(token_ids), (f"adjacent ranges at {prev.offset} and {it.offset} have different "
                                         f"identifiers")
        if it.is_embed is None and len(set(tokens[it.offset:end])) > 1:
            return list(token_ids), (f"mixed multimodal placeholder spans require is_embed ({it.modality} at "
                                     f"{it.offset})")
        prev = it
    for it in ordered:
        pad = routing.pad_value(it.mm_hash)
        if it.is_embed is None:
            positions: Iterable[int] = range(it.offset, it.offset + it.length)
        else:
            positions = (it.offset + int(i) for i in it.is_embed.indices())
        for p in positions:
            tokens[p] = pad
    return tokens, None


def routing_identity(token_ids: Sequence[int], items: Sequence[RoutingItem], *, block_size: int = DEFAULT_BLOCK_SIZE,
                     cache_namespace: str | None = None, lora_name: str | None = None) -> RoutingIdentity:
    """The routing identity of a prompt and its items; falls back to token-only routing (logged) for
    an ambiguous layout."""
    tokens, reason = routing_tokens(token_ids, items)
    if reason is not None:
        log.info("kv routing falls back to token-only routing: %s", reason)
    seed = salt_seed(cache_namespace, lora_name)
    blocks = block_hashes(tokens, block_size, seed)
    return RoutingIdentity(tokens, blocks, sequence_hashes(blocks), reason)


def items_from_request(request: fpb.MultimodalRequest) -> list[RoutingItem]:
    """Frontend view: items of a typed ``MultimodalRequest`` (features_pb2)."""
    from .items import modality_from_pb

    out = []
    for batch in request.batches:
        modality = modality_from_pb(batch.modality)
        for it in batch.items:
            ph = it.placeholder
            mask = EmbedMask(ph.is_embed, ph.is_embed_nbits) if ph.HasField("is_embed_nbits") else None
            out.append(RoutingItem(modality, ph.offset, ph.length, mask, it.mm_hash))
    return out


def items_from_engine_inputs(inputs: Any) -> list[RoutingItem]:
    """Worker view: items of ``worker.EngineInputs`` (identity = the verified/recomputed one)."""
    out = []
    for modality, placeholders in inputs.mm_placeholders.items():
        hashes = inputs.mm_hashes.get(modality, [])
        for p, h in zip(placeholders, hashes):
            r = p.range
            out.append(RoutingItem(modality, r.offset, r.length, r.is_embed, h))
    return out
