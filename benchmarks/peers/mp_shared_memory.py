"""``mp_shared_memory``: a fresh ``multiprocessing.shared_memory.SharedMemory`` segment per object.

Producer: create, copy in, send the name; consumer: attach, copy out (``np.copy``), close, ack;
producer unlinks after the ack (untimed). Only the creator registers the name with the resource
tracker (the attach is done with registration suppressed, as vLLM and SGLang do), so the create /
unlink pair balances and nothing is left in /dev/shm or reported as leaked.
"""
from __future__ import annotations

from multiprocessing import resource_tracker, shared_memory

import numpy as np

from .common import ConsumerBase, ProducerBase


class Producer(ProducerBase):
    name = "mp_shared_memory"

    def __init__(self, workdir: str, **options):
        super().__init__(workdir, **options)
        self.shm: shared_memory.SharedMemory | None = None

    def transfer(self, payload: np.ndarray) -> float:
        shm = shared_memory.SharedMemory(create=True, size=payload.nbytes)
        self.shm = shm
        dst = np.ndarray(payload.shape, dtype=np.uint8, buffer=shm.buf)
        np.copyto(dst, payload)
        del dst
        self.chan.handoff((shm.name, payload.nbytes))
        return 0.0

    def after_ack(self) -> None:
        if self.shm is not None:
            shm, self.shm = self.shm, None
            shm.close()
            shm.unlink()

    def teardown(self) -> None:
        try:
            self.after_ack()
        except FileNotFoundError:
            pass


class Consumer(ConsumerBase):
    def receive(self, descriptor) -> np.ndarray:
        name, nbytes = descriptor
        register = resource_tracker.register
        resource_tracker.register = lambda *a, **k: None  # attach without tracking (the creator owns it)
        try:
            shm = shared_memory.SharedMemory(name=name)
        finally:
            resource_tracker.register = register
        try:
            src = np.ndarray((nbytes,), dtype=np.uint8, buffer=shm.buf)
            out = src.copy()
            del src
        finally:
            shm.close()
        return out
