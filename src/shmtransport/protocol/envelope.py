"""Dynamo's ``vllm_tito.features`` JSON envelope (protocol-facts 2.2) -> validated ``FeatureItem`` list.

    {"mm_hashes":       {modality: [hash, ...]},
     "mm_placeholders": {modality: [[offset, length] | {"offset", "length", "is_embed"?: [bool]|null}]},
     "kwargs_data":     {modality: [base64(MessagePack of one kwargs item) | null]}}

Exactly these three keys (``deny_unknown_fields``; the optional ``mm_metadata`` is not accepted).
The envelope is the inline path: vLLM's 64 items and 16 MiB of decoded kwargs apply
(RESOURCE_EXHAUSTED). The envelope's hashes are validated (non-empty, <= 512 bytes, safe as a UUID);
one that is an identity of our scheme is carried and verified against the payload; others (vLLM
``MultiModalHasher`` digests) are not trusted: the content identity is recomputed from the kwargs.

``kwargs_data`` items are what vLLM's ``mm_serde.encode_mm_kwargs_item`` writes and
``decode_mm_kwargs_item`` reads back: field data may be a tensor or vLLM's non-tensor data (ints,
bools, floats, lists of these and tensors); each item keeps every value and its exact bytes.
"""
from __future__ import annotations

import base64
import binascii
import json
from typing import Any, Sequence

from ..embedmask import EmbedMask, PlaceholderRange
from ..errors import InvalidArgument
from ..identity import SCHEMES
from .items import FeatureItem
from .limits import DEFAULT_LIMITS, Limits
from .msgpack_kwargs import decode_kwargs_item
from .validate import (
    check_hash,
    check_modality_name,
    check_placeholders,
    check_position,
    check_routing_markers,
    limit_exceeded,
)

ENVELOPE_KEYS = ("mm_hashes", "mm_placeholders", "kwargs_data")
_PLACEHOLDER_KEYS = {"offset", "length", "is_embed"}

__all__ = ["decode_envelope", "parse_placeholder", "ENVELOPE_KEYS"]


def parse_placeholder(value: Any, where: str) -> PlaceholderRange:
    """``[offset, length]`` or ``{"offset", "length", "is_embed"?}`` -> PlaceholderRange."""
    mask_list = None
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise InvalidArgument(f"{where}: placeholder list must be [offset, length]")
        offset, length = value
    elif isinstance(value, dict):
        unknown = set(value) - _PLACEHOLDER_KEYS
        if unknown:
            raise InvalidArgument(f"{where}: unknown placeholder keys {sorted(unknown)}")
        if "offset" not in value or "length" not in value:
            raise InvalidArgument(f"{where}: placeholder needs offset and length")
        offset, length, mask_list = value["offset"], value["length"], value.get("is_embed")
    else:
        raise InvalidArgument(f"{where}: placeholder must be [offset, length] or an object")
    offset = check_position(offset, f"{where} offset")
    length = check_position(length, f"{where} length", positive=True)
    mask = None
    if mask_list is not None:
        if not isinstance(mask_list, list) or any(not isinstance(b, bool) for b in mask_list):
            raise InvalidArgument(f"{where}: is_embed must be a list of booleans")
        if len(mask_list) != length:
            raise InvalidArgument(f"{where}: is_embed has {len(mask_list)} entries but length is {length}")
        mask = EmbedMask.from_bools(mask_list)
    if offset + length >= 1 << 64:
        raise InvalidArgument(f"{where}: offset + length overflows u64")
    return PlaceholderRange(offset, length, mask)


def decode_envelope(features: Any, *, prompt_len: int | None = None, routing_markers: Sequence[str] | None = None,
                    has_raw_media: bool = False, limits: Limits = DEFAULT_LIMITS) -> list[FeatureItem]:
    """Validate and decode the envelope (a dict, or its JSON text). ``routing_markers``: Dynamo's
    per-image ``dynamo_mm_routing_hashes`` (checked here for count, verified against the payload by
    the frontend). ``has_raw_media``: the request also carries raw ``multi_modal_data``."""
    if isinstance(features, (str, bytes, bytearray)):
        try:
            features = json.loads(features)
        except ValueError as exc:
            raise InvalidArgument(f"features is not valid JSON: {exc}") from None
    if features is None:
        check_routing_markers(routing_markers, 0, has_features=False)
        return []
    if not isinstance(features, dict):
        raise InvalidArgument(f"features must be a JSON object, got {type(features).__name__}")
    if has_raw_media:
        raise InvalidArgument("raw media and preprocessed media features cannot be mixed")
    missing = [k for k in ENVELOPE_KEYS if k not in features]
    unknown = sorted(set(features) - set(ENVELOPE_KEYS))
    if missing or unknown:
        raise InvalidArgument(f"features keys must be exactly {list(ENVELOPE_KEYS)}: missing {missing}, "
                              f"unknown {unknown}")
    maps = {}
    for name in ENVELOPE_KEYS:
        if not isinstance(features[name], dict):
            raise InvalidArgument(f"features.{name} must be an object keyed by modality")
        maps[name] = features[name]
    if not maps["mm_hashes"]:
        raise InvalidArgument("features.mm_hashes is an empty modality map")
    keysets = {name: set(m) for name, m in maps.items()}
    if len({frozenset(k) for k in keysets.values()}) != 1:
        raise InvalidArgument(f"modality key sets differ: {({n: sorted(k) for n, k in keysets.items()})}")
    total = 0
    for modality in maps["mm_hashes"]:
        check_modality_name(modality, limits)
        lists = [maps[name][modality] for name in ENVELOPE_KEYS]
        if not all(isinstance(v, list) for v in lists):
            raise InvalidArgument(f"features.*.{modality} must be lists")
        if len({len(v) for v in lists}) != 1:
            raise InvalidArgument(f"{modality}: mm_hashes, mm_placeholders and kwargs_data lengths differ "
                                  f"({', '.join(str(len(v)) for v in lists)})")
        if not lists[0]:
            raise InvalidArgument(f"{modality}: no items")
        total += len(lists[0])
    if total > limits.max_inline_items:
        raise limit_exceeded("max_inline_items", total, limits.max_inline_items)
    n_images = len(maps["mm_hashes"].get("image", []))
    markers = check_routing_markers(routing_markers, n_images, has_features=True)
    # cheap structural checks first, then the (costlier) base64 + MessagePack decoding
    parsed = []
    for modality in maps["mm_hashes"]:
        for i, (h, ph, kw) in enumerate(zip(maps["mm_hashes"][modality], maps["mm_placeholders"][modality],
                                             maps["kwargs_data"][modality])):
            where = f"{modality}[{i}]"
            check_hash(h, limits, f"{where} mm_hash")
            parsed.append((modality, i, h, parse_placeholder(ph, where), kw))
    check_placeholders([(m, i, p.offset, p.length) for m, i, _, p, _ in parsed], prompt_len)
    items: list[FeatureItem] = []
    remaining = limits.max_inline_bytes
    for modality, i, h, placeholder, kw in parsed:
        where = f"{modality}[{i}]"
        if kw is None:
            if not limits.allow_cache_only:
                raise InvalidArgument(f"{where}: kwargs_data is null: cache-only references are not enabled")
            items.append(FeatureItem(modality, {}, placeholder, mm_hash=h))
            continue
        if not isinstance(kw, str):
            raise InvalidArgument(f"{where}: kwargs_data entries must be base64 strings")
        if len(kw) > (remaining + 2) // 3 * 4 + 4:
            raise limit_exceeded("max_inline_bytes", limits.max_inline_bytes - remaining + len(kw) * 3 // 4,
                                 limits.max_inline_bytes)
        try:
            raw = base64.b64decode(kw, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidArgument(f"{where}: kwargs_data is not valid base64") from None
        if not raw:
            raise InvalidArgument(f"{where}: kwargs_data decodes to nothing")
        remaining -= len(raw)
        if remaining < 0:
            raise limit_exceeded("max_inline_bytes", limits.max_inline_bytes - remaining, limits.max_inline_bytes)
        decoded = decode_kwargs_item(raw, limits)
        named = SCHEMES.get(h.split(":", 1)[0])
        ours = named is not None and not named.over_msgpack  # verifiable against the decoded values
        items.append(FeatureItem(modality, decoded.values, placeholder, decoded.fields,
                                 mm_hash=h if ours else None, kwargs_msgpack=raw))
    if markers is not None:
        images = [it for it in items if it.modality == "image"]
        for it, marker in zip(images, markers):
            it.routing_marker = marker
    return items
