"""Bridges from our typed Generate request to stock servers' gRPC schemas.

- ``vllm_grpc``: vLLM's own ``package vllm`` schema (``proto/vllm/inference.proto``): features
  re-inlined as kwargs MessagePack with the grpc-mm identity, proto3 "zero = unset" rules enforced.
- ``smg``: SMG / ``vllm serve --grpc`` (``smg_grpc_proto`` ``vllm.grpc.engine.GenerateRequest``):
  one batch per modality with SMG's batched / flat (``flat_keys`` + sizes tensor) / shared layouts,
  tensors inline or as ShmHandles of dedicated segments, checked against SMG's real reader.
They read our request as a worker does (``worker.request``), so they sit above the worker layer.
Both bridges reject, with a message naming the control, what the target cannot represent.
"""
from .common import Unrepresentable

__all__ = ["Unrepresentable"]
