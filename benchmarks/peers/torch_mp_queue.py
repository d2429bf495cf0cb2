"""``torch_mp_queue``: a fresh CPU tensor per object through a ``torch.multiprocessing`` queue.

The producer does what a renderer would: ``torch.from_numpy(payload).clone()`` (a fresh tensor), then
``queue.put``; torch's reducer moves the storage into a new shared-memory segment and passes its fd
(``file_descriptor`` strategy). The descriptor pipe carries an empty ``xfer`` note after each ``put``
(as a serving request message refers to its tensors); the consumer then ``queue.get``s a tensor over
that memory and acks over the pipe. This peer pickles inherently (torch's own reducers); the payload
bytes travel through shared memory, not the pickle stream.
"""
from __future__ import annotations

import gc
from multiprocessing import resource_sharer

import numpy as np

from .common import REPLY_TIMEOUT_S, ConsumerBase, ProducerBase


def _torch():
    import torch
    import torch.multiprocessing  # noqa: F401 — registers the tensor reducers

    return torch


class Producer(ProducerBase):
    name = "torch_mp_queue"

    def __init__(self, workdir: str, **options):
        super().__init__(workdir, **options)
        torch = _torch()
        self.torch = torch
        self.queue = torch.multiprocessing.get_context("spawn").Queue()
        self._sent = None

    def consumer_kwargs(self) -> dict:
        return {"queue": self.queue}

    def transfer(self, payload: np.ndarray) -> float:
        tensor = self.torch.from_numpy(payload).clone()
        self._sent = tensor  # the producer keeps it alive until the consumer acked
        self.queue.put(tensor)
        self.chan.handoff(None)  # "a tensor is on the queue" — the request message that refers to it
        return 0.0

    def after_ack(self) -> None:
        self._sent = None

    def teardown(self) -> None:
        self._sent = None
        if self.queue is not None:
            queue, self.queue = self.queue, None
            queue.close()
            queue.join_thread()
            del queue
            gc.collect()  # the queue's named semaphores are unlinked by their finalizers
        # Passing storage fds to a spawned consumer started multiprocessing's fd-sharing listener
        # (one socket + thread per process); stop it with the peer that started it.
        resource_sharer.stop(timeout=5.0)


class Consumer(ConsumerBase):
    def __init__(self, queue):
        super().__init__()
        _torch()
        self.queue = queue
        self._tensor = None

    def receive(self, descriptor) -> np.ndarray:
        self._tensor = self.queue.get(timeout=REPLY_TIMEOUT_S)
        return self._tensor.numpy()

    def release(self) -> None:
        self._tensor = None

    def teardown(self) -> None:
        self._tensor = None
        self.queue.close()
