"""``shm_put_verify``: as ``shm_put_hash`` (``put(array, digest=True)``, the content hash fused into the
copy) and the consumer checks the identity inside the span: ``acquire`` then ``lease.verify()`` (the
digest recomputed from shared memory, compared with the handle's) before it acks."""
from __future__ import annotations

from .shm_put import Consumer as _ViewConsumer
from .shm_put_hash import Producer as _HashProducer


class Producer(_HashProducer):
    name = "shm_put_verify"


class Consumer(_ViewConsumer):
    def receive(self, descriptor: bytes):
        array = super().receive(descriptor)
        self.lease.verify()
        return array
