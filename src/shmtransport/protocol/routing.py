"""KV-routing markers and Dynamo's ``extra_args`` routing metadata (protocol-facts 2.3-2.6).

Routing marker of an item (our documented choice): ``u64 = hash_mm_identifier(mm_hash)`` where
``mm_hash`` is the content identity (no adapter prefix), and the marker string is
``format(u64, "016x") + "0" * 48``: the 64-char form vLLM publishes in ``BlockStored.extra_keys``
(Dynamo's ``_pad_mm_hashes_to_64``). ``hash_mm_identifier``: a 64-hex string -> int(first 16 hex);
anything else -> xxh3_64 (seed 0) of its UTF-8 bytes. Our identities (``"xxh3-128:<hex>"`` ...)
are never 64-hex, so they take the xxh3_64 branch, as Dynamo's ``"grpc-mm:<hex>"`` does.
"""
from __future__ import annotations

import re
from typing import Any

import xxhash

from ..errors import IdentityMismatch, InvalidArgument

_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
_MARKER = re.compile(r"[0-9a-f]{16}0{48}")

__all__ = ["hash_mm_identifier", "routing_marker", "check_marker_format", "pad_value"]


def hash_mm_identifier(identifier: str) -> int | None:
    if not identifier:
        return None
    if _HEX64.fullmatch(identifier):
        return int(identifier[:16], 16)
    return xxhash.xxh3_64_intdigest(identifier.encode("utf-8"))


def routing_marker(identity: str) -> str:
    u64 = hash_mm_identifier(identity)
    if u64 is None:
        raise InvalidArgument("cannot derive a routing marker from an empty identity")
    return format(u64, "016x") + "0" * 48


def pad_value(marker_or_identity: str) -> int:
    """The routing token that replaces is_embed positions: 1_000_000 + (u64 & (2**30 - 1))."""
    return 1_000_000 + (hash_mm_identifier(marker_or_identity) & ((1 << 30) - 1))


def check_marker_format(marker: Any) -> str:
    if not isinstance(marker, str) or not marker:
        raise InvalidArgument("routing marker must be a non-empty str")
    if not _MARKER.fullmatch(marker):
        raise InvalidArgument(f"routing marker {marker!r:.80} is not 16 lowercase hex + 48 '0'")
    return marker


def check_marker_matches(marker: str, identity: str, where: str) -> None:
    expected = routing_marker(identity)
    if marker != expected:
        raise IdentityMismatch(f"{where}: routing marker {marker} does not match the payload ({expected})")
