"""``shm_loan_verify``: as ``shm_loan`` but ``commit(digest=True)`` (the content digest computed from
shared memory at commit — transport cost, timed) and the consumer runs ``lease.verify()`` inside the
span, as ``shm_put_verify`` does. The renderer's write stays excluded, as in ``shm_loan``."""
from __future__ import annotations

import time

import numpy as np

from .shm_put import Producer as _PutProducer
from .shm_put_verify import Consumer  # noqa: F401 — spawned by name


class Producer(_PutProducer):
    name = "shm_loan_verify"

    def transfer(self, payload: np.ndarray) -> float:
        loan = self.client.loan(nbytes=payload.nbytes)
        start_write = time.perf_counter()
        np.copyto(loan.array.reshape(-1)[: payload.nbytes], payload)  # the renderer's write — untimed
        excluded = time.perf_counter() - start_write
        self.handle = loan.commit(digest=True)
        self.chan.handoff(self.handle.to_bytes())
        return excluded
