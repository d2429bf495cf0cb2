"""``segment_pread``: SMG's worker style — one fresh /dev/shm file per tensor, read with pread.

Producer (gateway side): ``os.open(O_CREAT|O_EXCL, 0600)`` + ``posix_fallocate`` (reserve before
touching) + ``write``, close, send the name. Consumer (tokenspeed worker side): ``os.pread`` the whole
file (copy 1, ``bytes``), copy again into a ``bytearray`` (copy 2, as SMG does), wrap it as a numpy
array, ack; it unlinks the file after the check (untimed — kinder to the peer than SMG, which unlinks
inside consume).
"""
from __future__ import annotations

import os

import numpy as np

from ._segments import FreshSegments, open_segment
from .common import ConsumerBase, ProducerBase

PREFIX = "stbench_seg_"


def pread_twice(fd: int, nbytes: int, name: str) -> bytearray:
    """SMG's reader: ``pread`` the file (copy 1) into a ``bytearray`` (copy 2)."""
    chunks = []
    got = 0
    while got < nbytes:  # pread may return short reads for very large files
        chunk = os.pread(fd, nbytes - got, got)
        if not chunk:
            raise EOFError(f"{name}: {got} of {nbytes} bytes")
        chunks.append(chunk)
        got += len(chunk)
    raw = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    return bytearray(raw)


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        written = os.write(fd, data)
        data = data[written:]


class Producer(ProducerBase):
    name = "segment_pread"

    def __init__(self, workdir: str, **options):
        super().__init__(workdir, **options)
        self._segments = FreshSegments(PREFIX)
        self._last: str | None = None

    def transfer(self, payload: np.ndarray) -> float:
        name, self._last, fd = self._segments.create()
        try:
            os.posix_fallocate(fd, 0, payload.nbytes)
            _write_all(fd, memoryview(payload).cast("B"))
        finally:
            os.close(fd)
        self.chan.handoff((name, payload.nbytes))
        return 0.0

    def after_ack(self) -> None:
        self._last = None  # the consumer unlinked it

    def teardown(self) -> None:
        if self._last is not None:  # a failed iteration: the consumer may not have unlinked
            try:
                os.unlink(self._last)
            except FileNotFoundError:
                pass
            self._last = None


class Consumer(ConsumerBase):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._path: str | None = None

    def receive(self, descriptor) -> np.ndarray:
        name, nbytes = descriptor
        self._path, fd = open_segment(name, PREFIX)
        try:
            buf = pread_twice(fd, nbytes, name)
        finally:
            os.close(fd)
        return np.frombuffer(buf, dtype=np.uint8)

    def release(self) -> None:
        if self._path is not None:
            path, self._path = self._path, None
            os.unlink(path)

    def teardown(self) -> None:
        if self._path is not None:
            try:
                self.release()
            except FileNotFoundError:
                pass
