"""``mp_shared_memory_reused``: one ``multiprocessing.shared_memory.SharedMemory`` segment per size,
created (and pre-faulted) in ``setup`` (untimed) and reused for every object of that size.

Timed: the producer copies the payload into the segment and sends its name; the consumer copies out
(``np.copy``) of its attachment and acks. The consumer attaches on the first object with a new name and
keeps that attachment (dropped at the next ``setup``); the producer unlinks the segment at the next
``setup`` and at teardown. Resource tracking as in ``mp_shared_memory``: only the creator registers.
"""
from __future__ import annotations

from multiprocessing import resource_tracker, shared_memory

import numpy as np

from .common import ConsumerBase, ProducerBase


class Producer(ProducerBase):
    name = "mp_shared_memory_reused"

    def __init__(self, workdir: str, **options):
        super().__init__(workdir, **options)
        self.shm: shared_memory.SharedMemory | None = None
        self.dst: np.ndarray | None = None

    def setup(self, nbytes: int) -> None:
        self.teardown()
        self.shm = shared_memory.SharedMemory(create=True, size=nbytes)
        self.dst = np.ndarray((nbytes,), dtype=np.uint8, buffer=self.shm.buf)
        self.dst.fill(1)  # fault every page in before timing, as a long-lived segment would be

    def transfer(self, payload: np.ndarray) -> float:
        np.copyto(self.dst, payload)
        self.chan.handoff((self.shm.name, payload.nbytes))
        return 0.0

    def teardown(self) -> None:
        self.dst = None
        if self.shm is not None:
            shm, self.shm = self.shm, None
            shm.close()
            shm.unlink()


class Consumer(ConsumerBase):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.shm: shared_memory.SharedMemory | None = None
        self.src: np.ndarray | None = None

    def setup(self, nbytes: int) -> None:
        self.teardown()  # the producer replaced its segment

    def receive(self, descriptor) -> np.ndarray:
        return self._attached(descriptor).copy()

    def _attached(self, descriptor) -> np.ndarray:
        """The segment ``descriptor`` names, mapped here (attached on a new name, then kept)."""
        name, nbytes = descriptor
        if self.shm is None or self.shm.name != name:
            self.teardown()
            register = resource_tracker.register
            resource_tracker.register = lambda *a, **k: None  # attach without tracking (the creator owns it)
            try:
                self.shm = shared_memory.SharedMemory(name=name)
            finally:
                resource_tracker.register = register
            self.src = np.ndarray((nbytes,), dtype=np.uint8, buffer=self.shm.buf)
        return self.src

    def teardown(self) -> None:
        self.src = None
        if self.shm is not None:
            shm, self.shm = self.shm, None
            shm.close()
