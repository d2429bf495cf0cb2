"""What we advertise: ``ServerInfo`` (shm namespace, identity schemes, limits, native Generate)."""
from __future__ import annotations

import grpc

from ..identity import SCHEMES
from ..shm_names import shm_namespace_id
from ..v1 import generate_pb2 as gpb
from ..v1 import generate_pb2_grpc as gpb_grpc
from .limits import DEFAULT_LIMITS, Limits

__all__ = ["server_info", "same_shm_namespace", "ServerInfoServicer"]


def server_info(limits: Limits = DEFAULT_LIMITS, *, native_generate: bool = False,
                dedicated_segments: bool = True) -> gpb.ServerInfo:
    """The ``ServerInfo`` a generator advertises for these limits and features."""
    return gpb.ServerInfo(
        shm_namespace_id=shm_namespace_id(), identity_schemes=list(SCHEMES),
        supports_native_generate=native_generate, max_items=limits.max_items,
        max_shm_bytes=limits.max_shm_bytes or 0, max_inline_items=limits.max_inline_items,
        max_inline_bytes=limits.max_inline_bytes, supports_dedicated_segments=dedicated_segments,
        bridges=["smg", "vllm-grpc"])


def same_shm_namespace(info: gpb.ServerInfo) -> bool:
    """True when the peer shares our /dev/shm (shared-memory handles are usable); else go inline."""
    return bool(info.shm_namespace_id) and info.shm_namespace_id == shm_namespace_id()


class ServerInfoServicer(gpb_grpc.GeneratorServicer):
    """Serves GetServerInfo; Generate / GenerateStream stay UNIMPLEMENTED unless a subclass serves them."""

    def __init__(self, limits: Limits = DEFAULT_LIMITS, native_generate: bool = False):
        self._info = server_info(limits, native_generate=native_generate)

    def GetServerInfo(self, request: gpb.ServerInfoRequest, context: grpc.ServicerContext) -> gpb.ServerInfo:
        """What this server accepts and does (limits, adapters, native Generate)."""
        return self._info
