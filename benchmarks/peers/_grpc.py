"""Raw-bytes unary gRPC over a Unix domain socket (generic handlers, no .proto), for the gRPC peers."""
from __future__ import annotations

import os
import threading
from concurrent import futures

import grpc

from .common import ConsumerBase, ProducerBase

MAX_MESSAGE = 2**31 - 1  # "1 GiB+": the 256 MiB payload must fit
OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.max_receive_message_length", MAX_MESSAGE)]
SERVICE = "stbench.Transfer"
CALL_TIMEOUT_S = 120.0


class GrpcConsumer(ConsumerBase):
    """A gRPC server in the consumer; the handler stores what it received and answers empty."""

    def __init__(self, socket_path: str, workers: int = 4):
        super().__init__()
        self._lock = threading.Lock()
        self._received: bytes | None = None
        handler = grpc.method_handlers_generic_handler(SERVICE, {
            "Call": grpc.unary_unary_rpc_method_handler(self._handle),  # no (de)serializers: raw bytes
        })
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=OPTIONS)
        self.server.add_generic_rpc_handlers((handler,))
        if self.server.add_insecure_port(f"unix:{socket_path}") == 0:
            raise RuntimeError(f"cannot bind unix:{socket_path}")
        self.server.start()

    def _handle(self, request: bytes, context) -> bytes:
        with self._lock:
            self._received = request
        return b""

    def take(self) -> bytes:
        with self._lock:
            data, self._received = self._received, None
        if data is None:
            raise RuntimeError("no request arrived")
        return data

    def teardown(self) -> None:
        self.server.stop(grace=1.0).wait(5.0)


class GrpcProducer(ProducerBase):
    def __init__(self, workdir: str, **options):
        super().__init__(workdir, **options)
        self.socket_path = os.path.join(workdir, "g.sock")
        self.channel = None
        self.call = None

    def consumer_kwargs(self) -> dict:
        return {"socket_path": self.socket_path}

    def connect(self) -> None:
        self.channel = grpc.insecure_channel(f"unix:{self.socket_path}", options=OPTIONS)
        grpc.channel_ready_future(self.channel).result(timeout=30.0)
        self.call = self.channel.unary_unary(f"/{SERVICE}/Call")  # raw bytes both ways

    def rpc(self, body: bytes) -> bytes:
        return self.call(body, timeout=CALL_TIMEOUT_S)

    def teardown(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
