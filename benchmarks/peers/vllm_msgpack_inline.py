"""``vllm_msgpack_inline``: the payload as a uint8 tensor under ``"pixel_values"`` in one
MultiModalKwargsItem, MessagePack-encoded the way vLLM's ``MsgpackEncoder`` does when everything goes
inline (map form, tensor bytes as ``Ext(3)``; no aux buffers — one gRPC message carries it all), sent
in one unary gRPC call over a Unix socket. The empty response is the ack.

Timed, producer: the encode, with msgspec as vLLM does (the Ext packed straight from the tensor's
memory: one copy). The bytes equal shmtransport's ``encode_kwargs_item`` (tested). Timed, consumer,
before it answers: ``decode_kwargs_item`` (the structure decoded, the tensor bytes a zero-copy view of
the request, as msgspec's ext hook hands them to vLLM), then the copy into a ``bytearray`` that vLLM's
decoder makes for inline tensor data; the numpy array wraps that bytearray.
"""
from __future__ import annotations

import msgspec
import numpy as np

from shmtransport.protocol.items import FieldConfig
from shmtransport.protocol.msgpack_kwargs import EXT_RAW_VIEW, decode_kwargs_item

from ._grpc import GrpcConsumer, GrpcProducer

KEY = "pixel_values"
FIELD = FieldConfig().to_wire()


def encode(payload: np.ndarray) -> bytes:
    """vLLM's inline kwargs MessagePack of ``{KEY: payload}`` (uint8, 1-D)."""
    data = ["uint8", [payload.size], msgspec.msgpack.Ext(EXT_RAW_VIEW, memoryview(payload))]
    return msgspec.msgpack.encode({KEY: {"data": data, "field": FIELD}})


class Producer(GrpcProducer):
    name = "vllm_msgpack_inline"

    def transfer(self, payload: np.ndarray) -> float:
        self.rpc(encode(payload))
        return 0.0


class Consumer(GrpcConsumer):
    def decode(self, request: bytes) -> np.ndarray:
        dtype, shape, view = decode_kwargs_item(request).tensors[KEY]
        return np.frombuffer(bytearray(view), dtype=dtype).reshape(shape)
