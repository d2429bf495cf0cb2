"""``pickle5_oob``: pickle protocol 5 with out-of-band buffers over a Unix stream socket (a data socket
in the workdir, separate from the control pipe).

Timed, producer: ``pickle.dumps(array, protocol=5, buffer_callback=...)`` (the array's memory becomes a
``PickleBuffer``, not part of the pickle), then ``("xfer", (pickle length, buffer lengths))`` on the
pipe, then on the socket the pickle bytes and each raw buffer with ``sendall(memoryview)`` (no extra
copy). Timed, consumer: a fresh ``bytearray`` per part, filled with ``recv_into``, then
``pickle.loads(..., buffers=...)`` (the array wraps its bytearray), ack over the pipe.
"""
from __future__ import annotations

import os
import pickle
import socket

import numpy as np

from .common import REPLY_TIMEOUT_S, ConsumerBase, ProducerBase


def _recv_exactly(sock: socket.socket, nbytes: int) -> bytearray:
    buf = bytearray(nbytes)
    view = memoryview(buf)
    got = 0
    while got < nbytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError(f"data socket closed after {got} of {nbytes} bytes")
        got += n
    return buf


class Producer(ProducerBase):
    name = "pickle5_oob"

    def __init__(self, workdir: str, **options):
        super().__init__(workdir, **options)
        self.socket_path = os.path.join(workdir, "data.sock")
        self.sock: socket.socket | None = None

    def consumer_kwargs(self) -> dict:
        return {"socket_path": self.socket_path}

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(REPLY_TIMEOUT_S)
        self.sock.connect(self.socket_path)  # the consumer listens before it says ready

    def transfer(self, payload: np.ndarray) -> float:
        buffers: list[pickle.PickleBuffer] = []
        head = pickle.dumps(payload, protocol=5, buffer_callback=buffers.append)
        raws = [buf.raw() for buf in buffers]
        self.chan.send(("xfer", (len(head), [raw.nbytes for raw in raws])))
        self.sock.sendall(head)
        for raw in raws:
            self.sock.sendall(raw)
        self.chan.recv("ack")
        return 0.0

    def teardown(self) -> None:
        if self.sock is not None:
            sock, self.sock = self.sock, None
            sock.close()


class Consumer(ConsumerBase):
    def __init__(self, socket_path: str):
        super().__init__()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.settimeout(REPLY_TIMEOUT_S)
        self.listener.bind(socket_path)
        self.listener.listen(1)
        self.sock: socket.socket | None = None

    def setup(self, nbytes: int) -> None:
        if self.sock is None:  # the producer connected before its first setup
            self.sock, _ = self.listener.accept()
            self.sock.settimeout(REPLY_TIMEOUT_S)

    def receive(self, descriptor) -> np.ndarray:
        head_len, buffer_lens = descriptor
        head = _recv_exactly(self.sock, head_len)
        buffers = [_recv_exactly(self.sock, n) for n in buffer_lens]
        return pickle.loads(head, buffers=buffers)

    def teardown(self) -> None:
        for sock in (self.sock, self.listener):
            if sock is not None:
                sock.close()
        self.sock = self.listener = None
