"""``grpc_inline_tcp``: as ``grpc_inline`` (one unary gRPC call carrying the payload bytes inline,
``tobytes()`` included, the empty response is the ack) but over TCP loopback (127.0.0.1) instead of a
Unix socket — the transport a frontend and a worker on one node use when nothing else is set up."""
from __future__ import annotations

from ._grpc import GrpcConsumer as Consumer  # noqa: F401 — spawned by name
from .grpc_inline import Producer as _UnixProducer


class Producer(_UnixProducer):
    name = "grpc_inline_tcp"
    tcp = True
