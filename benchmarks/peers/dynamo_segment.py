"""``dynamo_segment``: Dynamo's SHM mm_kwargs transfer — one fresh named POSIX segment per item.

Producer (frontend): ``os.open(/dev/shm/<name>, O_CREAT|O_EXCL, 0600)`` + ``ftruncate`` + ``mmap`` +
copy in, send name and size. Consumer (backend): open, ``mmap`` read-only, copy out into its own
array, close, ack. Dynamo pickles each ``MultiModalKwargsItem`` into its segment and unpickles it on
the other side; this peer moves the raw payload bytes (no pickle), so it times the segment traffic
only. The producer unlinks after the ack (untimed), as Dynamo's sender ``cleanup()`` does once the
response completes. Plain ``/dev/shm`` files: nothing is registered with a resource tracker.
"""
from __future__ import annotations

import mmap
import os

import numpy as np

from ._segments import FreshSegments, open_segment
from .common import ConsumerBase, ProducerBase

PREFIX = "stbench_dyn_"


class Producer(ProducerBase):
    name = "dynamo_segment"

    def __init__(self, workdir: str, **options):
        super().__init__(workdir, **options)
        self._segments = FreshSegments(PREFIX)
        self._last: str | None = None

    def transfer(self, payload: np.ndarray) -> float:
        name, self._last, fd = self._segments.create()
        try:
            os.ftruncate(fd, payload.nbytes)
            with mmap.mmap(fd, payload.nbytes) as mm:
                dst = np.frombuffer(mm, dtype=np.uint8)
                np.copyto(dst, payload)
                del dst
        finally:
            os.close(fd)
        self.chan.handoff((name, payload.nbytes))
        return 0.0

    def after_ack(self) -> None:
        if self._last is not None:
            path, self._last = self._last, None
            os.unlink(path)

    def teardown(self) -> None:
        try:
            self.after_ack()
        except FileNotFoundError:
            pass


class Consumer(ConsumerBase):
    def receive(self, descriptor) -> np.ndarray:
        name, nbytes = descriptor
        _, fd = open_segment(name, PREFIX)
        try:
            with mmap.mmap(fd, nbytes, access=mmap.ACCESS_READ) as mm:
                src = np.frombuffer(mm, dtype=np.uint8)
                out = src.copy()
                del src
        finally:
            os.close(fd)
        return out
