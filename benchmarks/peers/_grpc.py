"""Raw-bytes unary gRPC (generic handlers, no .proto) for the gRPC peers: over a Unix domain socket,
or over TCP loopback (``GrpcProducer.tcp``: the consumer binds ``127.0.0.1:0`` and writes the port it
got to a file in the workdir before it says ready; the producer reads it in ``connect``)."""
from __future__ import annotations

import os
import threading
from concurrent import futures
from typing import Any

import grpc

from .common import ConsumerBase, ProducerBase

MAX_MESSAGE = 2**31 - 1  # "1 GiB+": the 256 MiB payload must fit
OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.max_receive_message_length", MAX_MESSAGE)]
SERVICE = "stbench.Transfer"
CALL_TIMEOUT_S = 120.0


class GrpcConsumer(ConsumerBase):
    """A gRPC server in the consumer; the handler stores what it received (through ``decode``, which
    runs before the response, so inside the producer's span) and answers empty."""

    def __init__(self, address: str, port_path: str | None = None, workers: int = 4):
        super().__init__()
        self._lock = threading.Lock()
        self._received: Any = None
        handler = grpc.method_handlers_generic_handler(SERVICE, {
            "Call": grpc.unary_unary_rpc_method_handler(self._handle),  # no (de)serializers: raw bytes
        })
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=OPTIONS)
        self.server.add_generic_rpc_handlers((handler,))
        port = self.server.add_insecure_port(address)
        if port == 0:
            raise RuntimeError(f"cannot bind {address}")
        self.server.start()
        if port_path is not None:
            with open(port_path, "w") as fh:
                fh.write(str(port))

    def decode(self, request: bytes) -> Any:
        """The consumer's work on the request before it answers (default: none, keep the bytes)."""
        return request

    def _handle(self, request: bytes, context) -> bytes:
        received = self.decode(request)
        with self._lock:
            self._received = received
        return b""

    def take(self) -> Any:
        with self._lock:
            data, self._received = self._received, None
        if data is None:
            raise RuntimeError("no request arrived")
        return data

    def teardown(self) -> None:
        self.server.stop(grace=1.0).wait(5.0)


class GrpcProducer(ProducerBase):
    tcp = False

    def __init__(self, workdir: str, **options):
        super().__init__(workdir, **options)
        self.socket_path = os.path.join(workdir, "g.sock")
        self.port_path = os.path.join(workdir, "g.port")
        self.channel = None
        self.call = None

    def consumer_kwargs(self) -> dict:
        if self.tcp:
            return {"address": "127.0.0.1:0", "port_path": self.port_path}
        return {"address": f"unix:{self.socket_path}"}

    def connect(self) -> None:
        target, options = f"unix:{self.socket_path}", OPTIONS
        if self.tcp:
            with open(self.port_path) as fh:  # written before the consumer said ready
                target = f"127.0.0.1:{int(fh.read())}"
            options = [*OPTIONS, ("grpc.enable_http_proxy", 0)]  # loopback: never via an http_proxy
        self.channel = grpc.insecure_channel(target, options=options)
        grpc.channel_ready_future(self.channel).result(timeout=30.0)
        self.call = self.channel.unary_unary(f"/{SERVICE}/Call")  # raw bytes both ways

    def rpc(self, body: bytes) -> bytes:
        return self.call(body, timeout=CALL_TIMEOUT_S)

    def teardown(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
