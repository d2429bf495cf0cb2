"""``memcpy``: np.copyto into a preallocated, pre-faulted buffer, one process — the data-plane floor."""
from __future__ import annotations

import numpy as np

from .common import ProducerBase, verify


class Producer(ProducerBase):
    name = "memcpy"
    consumer_class = None

    dst: np.ndarray | None = None

    def setup(self, nbytes: int) -> None:
        self.dst = np.empty(nbytes, dtype=np.uint8)
        self.dst.fill(1)  # fault every page in before timing

    def transfer(self, payload: np.ndarray) -> float:
        np.copyto(self.dst, payload)
        return 0.0

    def check_local(self, digest: int, corrupt: bool) -> bool:
        return verify(self.dst, digest, corrupt)

    def teardown(self) -> None:
        self.dst = None
