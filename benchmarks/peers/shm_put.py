"""``shm_put``: shmtransport ``Producer.put(array, digest=False)`` (one copy into the arena), handle over
the pipe, ``Consumer.acquire_bytes`` (the handle's bytes to a zero-copy read-only view), ack. Releases
on both sides are untimed."""
from __future__ import annotations

import numpy as np

from . import _ours
from .common import ConsumerBase, ProducerBase


class Producer(ProducerBase):
    name = "shm_put"
    hash = False

    def __init__(self, workdir: str, socket_path: str, **options):
        super().__init__(workdir, **options)
        self.socket_path = socket_path
        self.client = None
        self.handle = None

    def consumer_kwargs(self) -> dict:
        return {"socket_path": self.socket_path}

    def connect(self) -> None:
        self.client = _ours.client().Producer(self.socket_path, timeout_s=_ours.CLIENT_TIMEOUT_S)

    def transfer(self, payload: np.ndarray) -> float:
        self.handle = self.client.put(payload, digest=self.hash)
        self.chan.handoff(self.handle.to_bytes())
        return 0.0

    def after_ack(self) -> None:
        if self.handle is not None:
            handle, self.handle = self.handle, None
            self.client.release(handle)

    def teardown(self) -> None:
        if self.client is not None:
            try:
                self.after_ack()
            finally:
                self.client.close()
                self.client = None


class Consumer(ConsumerBase):
    def __init__(self, socket_path: str):
        super().__init__()
        mod = _ours.client()
        self.client = mod.Consumer(socket_path, timeout_s=_ours.CLIENT_TIMEOUT_S)
        self.lease = None

    def receive(self, descriptor: bytes):
        self.lease = self.client.acquire_bytes(descriptor)
        return self.lease.array

    def release(self) -> None:
        if self.lease is not None:
            lease, self.lease = self.lease, None
            lease.release()

    def teardown(self) -> None:
        try:
            self.release()
        finally:
            self.client.close()
