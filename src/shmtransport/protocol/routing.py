"""KV-routing markers and Dynamo's ``extra_args`` routing metadata (protocol-facts 2.3-2.6).

Dynamo 1.6.1's rules, which these functions follow:

- Routing hash of an identifier (kv-router ``hash_mm_identifier``): a 64-hex string -> int(first 16
  hex); any other non-empty string -> xxh3_64 (seed 0) of its UTF-8 bytes. Our identities
  (``"xxh3-128:<hex>"``, ``"blake3:<hex>"``, ``"grpc-mm:<hex>"``) are never 64-hex, so they take the
  xxh3_64 branch, as Dynamo's own ``"grpc-mm:<hex>"`` identities do.
- Routing marker: ``format(u64, "016x") + "0" * 48`` (kv-router ``mark_mm_hash_for_extra_key``). It
  is what Dynamo's frontend forwards in ``mm_hashes`` / ``mm_hashes_by_modality`` for us, what its
  worker hands vLLM as the item's ``multi_modal_uuid`` (unchanged: ``mark_forwarded``), and so what
  vLLM publishes in ``BlockStored.extra_keys``; Dynamo's event decoder reads a multimodal hash back
  only from that 16-hex + 48-zeros form (``parse_marker``), and a native vLLM hash does not enable it.
- Dynamo's worker (``mark_forwarded_mm_hashes_for_routing`` / ``_build_forwarded_mm_uuids``): each
  forwarded hash H -> ``H[:16] + "0" * 48`` (H must start with 16 hex), ``None`` kept for alignment;
  ``mm_hashes_by_modality`` first (empty lists skipped, ``image`` -> ``vision_chunk`` on unified-vision
  models), else the legacy flat ``mm_hashes`` as image.
- Pad value replacing an item's embed positions in the routing token stream (``pad_value_for_mm_hash``):
  ``1_000_000 + (u64 & (2**30 - 1))``.
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

import xxhash

from ..errors import IdentityMismatch, InvalidArgument

_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
_HEX16 = re.compile(r"[0-9a-fA-F]{16}")
_MARKER = re.compile(r"[0-9a-f]{16}0{48}")
_MARKER_ANY_CASE = re.compile(r"[0-9a-fA-F]{16}0{48}")
_MARKER_PAD = "0" * 48

__all__ = ["hash_mm_identifier", "routing_marker", "check_marker_format", "pad_value", "parse_marker",
           "mark_forwarded", "forwarded_mm_uuids"]


def hash_mm_identifier(identifier: str) -> int | None:
    """Dynamo's routing hash (u64) of an identifier; None for an empty one."""
    if not identifier:
        return None
    if _HEX64.fullmatch(identifier):
        return int(identifier[:16], 16)
    return xxhash.xxh3_64_intdigest(identifier.encode("utf-8"))


def routing_marker(identity: str) -> str:
    """The routing marker of an identity: 16 lowercase hex digits of its hash, then 48 ``0``."""
    u64 = hash_mm_identifier(identity)
    if u64 is None:
        raise InvalidArgument("cannot derive a routing marker from an empty identity")
    return format(u64, "016x") + _MARKER_PAD


def parse_marker(value: str) -> int | None:
    """The u64 Dynamo's KV-event decoder reads from a vLLM extra key, or None (not a marker)."""
    return int(value[:16], 16) if _MARKER_ANY_CASE.fullmatch(value) else None


def pad_value(marker_or_identity: str) -> int:
    """The routing token that replaces is_embed positions: 1_000_000 + (u64 & (2**30 - 1))."""
    u64 = hash_mm_identifier(marker_or_identity)
    if u64 is None:
        raise InvalidArgument("cannot derive a routing pad value from an empty identity")
    return 1_000_000 + (u64 & ((1 << 30) - 1))


def check_marker_format(marker: Any) -> str:
    """``marker`` if it is a well-formed routing marker; InvalidArgument otherwise."""
    if not isinstance(marker, str) or not marker:
        raise InvalidArgument("routing marker must be a non-empty str")
    if not _MARKER.fullmatch(marker):
        raise InvalidArgument(f"routing marker {marker!r:.80} is not 16 lowercase hex + 48 '0'")
    return marker


def check_marker_matches(marker: str, identity: str, where: str) -> None:
    """IdentityMismatch (naming ``where``) unless ``marker`` is the routing marker of ``identity``."""
    expected = routing_marker(identity)
    if marker != expected:
        raise IdentityMismatch(f"{where}: routing marker {marker} does not match the payload ({expected})")


def mark_forwarded(hashes: Sequence[str | None]) -> list[str | None]:
    """Dynamo's worker rule for forwarded hashes: H -> H[:16] + 48 '0'; None stays (alignment)."""
    out: list[str | None] = []
    for h in hashes:
        if h is None:
            out.append(None)
            continue
        if not isinstance(h, str) or not _HEX16.match(h):
            raise InvalidArgument(f"forwarded multimodal routing hash {h!r:.80} must start with 16 hex characters")
        out.append(h[:16] + _MARKER_PAD)
    return out


def forwarded_mm_uuids(extra_args: Mapping[str, Any],
                       unified_vision: bool = False) -> dict[str, list[str | None]] | None:
    """The ``multi_modal_uuids`` Dynamo's worker derives from the frontend's ``extra_args`` (None: none)."""
    grouped = extra_args.get("mm_hashes_by_modality")
    if isinstance(grouped, Mapping):  # Dynamo ignores a grouped value that is not an object
        out: dict[str, list[str | None]] = {}
        for modality, hashes in grouped.items():
            if not hashes:
                continue
            if not isinstance(hashes, list):
                raise InvalidArgument(f"mm_hashes_by_modality[{modality!r}] must be a list")
            key = "vision_chunk" if unified_vision and modality == "image" else str(modality)
            out.setdefault(key, []).extend(mark_forwarded(hashes))
        if out:
            return out
    flat = extra_args.get("mm_hashes")
    if flat:
        if not isinstance(flat, list):
            raise InvalidArgument("mm_hashes must be a list")
        return {"vision_chunk" if unified_vision else "image": mark_forwarded(flat)}
    return None
