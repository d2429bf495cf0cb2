"""``grpc_inline``: one unary gRPC call carrying the payload bytes inline, Unix socket.

gRPC Python sends ``bytes``, so the producer's ``tobytes()`` is part of the handoff (as it is for a
real frontend holding a numpy tensor). The response (empty) is the ack.
"""
from __future__ import annotations

import numpy as np

from ._grpc import GrpcConsumer as Consumer  # noqa: F401 — spawned by name
from ._grpc import GrpcProducer


class Producer(GrpcProducer):
    name = "grpc_inline"

    def transfer(self, payload: np.ndarray) -> float:
        self.rpc(payload.tobytes())
        return 0.0
