"""``shm_loan``: ``Producer.loan(nbytes=)`` -> the renderer writes into ``loan.array`` -> ``commit()``
(zero copies) -> handle over the pipe -> ``Consumer.acquire`` -> ack.

The renderer's write is the producer's own work, not transport: it is excluded from the span with a
split timer (timed: loan, commit, handoff, acquire, ack).
"""
from __future__ import annotations

import time

import numpy as np

from .shm_put import Consumer  # noqa: F401 — spawned by name
from .shm_put import Producer as _PutProducer


class Producer(_PutProducer):
    name = "shm_loan"

    def transfer(self, payload: np.ndarray) -> float:
        loan = self.client.loan(nbytes=payload.nbytes)
        start_write = time.perf_counter()
        np.copyto(loan.array.reshape(-1)[: payload.nbytes], payload)  # the renderer's write — untimed
        excluded = time.perf_counter() - start_write
        self.handle = loan.commit()
        self.chan.handoff(self.handle.to_bytes())
        return excluded
