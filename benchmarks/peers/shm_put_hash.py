"""``shm_put_hash``: as ``shm_put`` with ``put(array, digest=True)`` — the copy into shm with the content
hash fused in (the default producer path)."""
from __future__ import annotations

from .shm_put import Consumer  # noqa: F401 — spawned by name
from .shm_put import Producer as _PutProducer


class Producer(_PutProducer):
    name = "shm_put_hash"
    hash = True
