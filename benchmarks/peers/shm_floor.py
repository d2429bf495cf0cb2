"""``shm_floor``: the floor of a zero-copy handoff: raw shared memory over the same channel.

One ``multiprocessing.shared_memory.SharedMemory`` segment per size, created and pre-faulted in
``setup`` (untimed); the consumer attaches on the first object with a new name and keeps that
mapping. Timed: the producer's write into the segment is excluded (a split timer, as for
``shm_loan`` and ``iceoryx2_loan``) -> its name over the handoff socket -> the consumer takes a
read-only view of its mapping (no copy) -> ack. No allocation, no lifetime, no checks: what is
left is the channel and two Python calls, the least any shared-memory transport can cost here.
"""
from __future__ import annotations

import time

import numpy as np

from .mp_shared_memory_reused import Consumer as _ReusedConsumer
from .mp_shared_memory_reused import Producer as _ReusedProducer


class Producer(_ReusedProducer):
    name = "shm_floor"

    def transfer(self, payload: np.ndarray) -> float:
        start_write = time.perf_counter()
        np.copyto(self.dst, payload)  # the renderer's write — untimed
        excluded = time.perf_counter() - start_write
        self.chan.handoff((self.shm.name, payload.nbytes))
        return excluded


class Consumer(_ReusedConsumer):
    def receive(self, descriptor) -> np.ndarray:
        view = self._attached(descriptor)[: descriptor[1]]
        view.flags.writeable = False  # a reader's view, as a lease's
        return view
