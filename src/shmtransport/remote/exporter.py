"""Producer / consumer glue: a ``TensorData`` with the right payload, and resolving one.

``RemoteExporter(producer)`` asks the producer's own daemon (Unix socket) for its Remote service's
endpoint and agent once; ``tensor_data(handle, consumer_namespace)`` then fills ``shm`` (same
namespace), ``remote`` (NIXL) or — only with ``allow_inline=True`` and no NIXL — ``inline`` bytes.
``resolve(td, consumer=, reader=, allow_inline=)`` is the worker side.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
import numpy.typing as npt

from ..errors import InvalidArgument, error_from_rpc
from ..tensors import dtype_from_name
from ..v1 import features_pb2 as fpb
from ..v1 import remote_pb2 as rpb
from ..v1 import remote_pb2_grpc as rpb_grpc
from ..wire import GRPC_OPTIONS
from . import descriptor as _desc
from ._nixl import NixlUnavailable, load_nixl
from .transport import COUNTERS, INLINE, REMOTE, SHM, TransportCounters, choose_transport, namespace_of

if TYPE_CHECKING:
    from ..client import Consumer, Handle, Lease, Producer
    from .reader import RemoteBuffer, RemoteReader


class RemoteExporter:
    """Describes a producer's tensors for a consumer on this node or another; asks its daemon for
    the remote endpoint once."""

    def __init__(self, producer: Producer, timeout_s: float = 10.0, counters: TransportCounters | None = None
                 ) -> None:
        self.producer = producer
        self.counters = counters or COUNTERS
        self.namespace = namespace_of(producer)
        channel = grpc.insecure_channel(f"unix:{producer.socket_path}", options=GRPC_OPTIONS)
        self.info: rpb.RemoteInfo | None
        try:
            self.info = rpb_grpc.RemoteStub(channel).Describe(rpb.DescribeRequest(), timeout=timeout_s)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.info = None  # the daemon runs without the remote extension
            else:
                raise error_from_rpc(err) from None
        finally:
            channel.close()

    def export(self, handle: Handle) -> fpb.RemoteTensorHandle:
        """The ``RemoteTensorHandle`` of ``handle``; NixlUnavailable if the daemon does not serve the remote tier."""
        if self.info is None:
            raise NixlUnavailable("the producer's daemon does not serve the remote tier (start it with "
                                  "remote_extension(); pip install shmtransport[nixl])")
        return _desc.encode(handle, self.info.endpoint, self.info.agent_name, self.info.shm_namespace)

    def tensor_data(self, handle: Handle, consumer_namespace: str, allow_inline: bool = False) -> fpb.TensorData:
        """``TensorData`` of ``handle`` for a consumer in ``consumer_namespace``: shm, remote, or
        (if allowed) inline."""
        transport = choose_transport(self.namespace, consumer_namespace, allow_inline=allow_inline,
                                     nbytes=handle.nbytes, counters=self.counters)
        td = fpb.TensorData(shape=handle.shape, dtype=handle.dtype, digest=handle.digest)
        if transport == SHM:
            td.shm.CopyFrom(handle.shm)
            td.commit_token = handle.commit_token
        elif transport == REMOTE:
            td.remote.CopyFrom(self.export(handle))
        else:
            td.inline = self.producer.read_bytes(handle)
        return td


def resolve(td: fpb.TensorData, *, consumer: Consumer | None = None, reader: RemoteReader | None = None,
            allow_inline: bool = False, counters: TransportCounters | None = None
            ) -> Lease | RemoteBuffer | npt.NDArray[Any]:
    """The tensor a ``TensorData`` names: a consumer ``Lease`` (shm), a ``RemoteBuffer`` (remote),
    or a numpy array (inline, only when ``allow_inline``). Release the first two when done."""
    counters = counters or COUNTERS
    kind = td.WhichOneof("payload")
    if kind == "shm":
        from ..client import Handle

        if consumer is None:
            raise InvalidArgument("a shm tensor needs a Consumer")
        counters.count(SHM, td.shm.nbytes)
        return consumer.acquire(Handle(td.shm, td.dtype, td.shape, digest=td.digest, commit_token=td.commit_token))
    if kind == "remote":
        if td.remote.transport != _desc.TRANSPORT:
            raise InvalidArgument(f"remote transport {td.remote.transport!r} is not supported")
        load_nixl()  # NixlUnavailable naming the extra
        if reader is None:
            raise InvalidArgument("a remote tensor needs a RemoteReader")
        counters.count(REMOTE, td.remote.nbytes)
        return reader.read(td.remote)
    if kind == "inline":
        if not allow_inline:
            raise InvalidArgument("inline tensor bytes refused: pass allow_inline=True to accept them")
        counters.count(INLINE, len(td.inline))
        return np.frombuffer(td.inline, dtype=dtype_from_name(td.dtype)).reshape(tuple(td.shape))
    raise InvalidArgument("TensorData carries no payload")
