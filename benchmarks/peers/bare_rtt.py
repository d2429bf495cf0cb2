"""``bare_rtt``: one bare unary gRPC round trip with an empty request, Unix socket — the control-plane floor.

The payload is not sent; the consumer checks the (empty) request against the digest of an empty
buffer, so the row still carries a receiver-computed flag (and the corruption hook, which turns an
empty buffer into one byte, can still make it fail).
"""
from __future__ import annotations

import time

import numpy as np

from ._grpc import GrpcConsumer as Consumer  # noqa: F401 — spawned by name
from ._grpc import GrpcProducer
from .common import digest_of

EMPTY_DIGEST = digest_of(b"")


class Producer(GrpcProducer):
    name = "bare_rtt"

    def expected_digest(self, digest: int) -> int:
        return EMPTY_DIGEST

    def transfer(self, payload: np.ndarray) -> float:
        # The size's payload is not sent. Sender-side corruption makes the empty request one byte.
        self.rpc(b"\x01" if self.corrupt_send else b"")
        return 0.0

    def calls_per_s(self, duration_s: float) -> tuple[float, list[float]]:
        """Back-to-back bare calls from this one client for ``duration_s``: (calls/s, per-call seconds)."""
        samples = []
        deadline = time.perf_counter() + duration_s
        start = time.perf_counter()
        while True:
            t0 = time.perf_counter()
            self.rpc(b"")
            t1 = time.perf_counter()
            samples.append(t1 - t0)
            if t1 >= deadline:
                break
        return len(samples) / (time.perf_counter() - start), samples
