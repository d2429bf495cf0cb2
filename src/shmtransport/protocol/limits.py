"""Every bound the protocol enforces, in one place (configurable per deployment).

Defaults follow vLLM's gRPC gateway and Dynamo (reference/protocol-facts.md 1.6, 2.2, 2.3): the
inline path keeps vLLM's 64 features and 16 MiB of inline payload; the shared-memory path has its
own, larger, item and byte limits (no 16 MiB cap: the bytes never travel in the message).
"""
from __future__ import annotations

import dataclasses

from ..tensors import MAX_RANK

MODALITIES = ("image", "video", "audio")

MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Limits:
    """The bounds a request is checked against; bytes unless named otherwise, None for unbounded."""

    # inline path (kwargs MessagePack or TensorData.inline): vLLM's RESOURCE_EXHAUSTED limits
    max_inline_items: int = 64
    max_inline_bytes: int = 16 * MIB
    # shared-memory path (configurable; None = unbounded)
    max_items: int = 4096
    max_shm_bytes: int | None = 64 << 30
    # names and identities (Dynamo)
    max_modality_bytes: int = 64
    max_hash_bytes: int = 512
    # MessagePack preflight and kwargs item shape (vLLM)
    msgpack_max_depth: int = 32
    msgpack_max_nodes: int = 65_536
    max_fields: int = 256
    max_key_bytes: int = 256
    max_rank: int = MAX_RANK
    # cache-only references (features without kwargs): rejected unless enabled
    allow_cache_only: bool = False


DEFAULT_LIMITS = Limits()
U64_MAX = (1 << 64) - 1
U32_MAX = (1 << 32) - 1
