"""``RemoteTensorHandle(transport="nixl", descriptor, nbytes)``: our descriptor format.

``descriptor`` is a serialized ``shmtransport.v1.NixlDescriptor`` (remote.proto), version 1:
endpoint (``host:port`` of the owning daemon's Remote service), NIXL agent name, the owning daemon's
shm namespace id and the full ``TensorHandle`` (segment, offset, nbytes, generation, instance id,
dtype, shape, digest, commit token). Protobuf, never pickle. It names bytes; it carries no address:
the daemon turns a leased handle into the region to READ, so a forged descriptor can at most name
an allocation the daemon then refuses (stale generation, wrong instance, out of bounds).
"""
from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument
from ..handle import Handle
from ..tensors import dtype_from_name
from ..v1 import daemon_pb2 as pb
from ..v1 import features_pb2 as fpb
from ..v1 import remote_pb2 as rpb

DESCRIPTOR_VERSION = 1
TRANSPORT = "nixl"
MAX_DESCRIPTOR_NBYTES = 64 << 10


def encode(handle: Handle | pb.TensorHandle, endpoint: str, agent_name: str, shm_namespace: str
           ) -> fpb.RemoteTensorHandle:
    """A ``RemoteTensorHandle`` for a ``Handle`` (or ``TensorHandle`` proto)."""
    tensor = handle if isinstance(handle, pb.TensorHandle) else handle.to_proto()
    desc = rpb.NixlDescriptor(
        version=DESCRIPTOR_VERSION,
        endpoint=endpoint,
        agent_name=agent_name,
        shm_namespace=shm_namespace,
        tensor=tensor,
    )
    return fpb.RemoteTensorHandle(transport=TRANSPORT, descriptor=desc.SerializeToString(), nbytes=tensor.shm.nbytes)


def tensor_nbytes(t: pb.TensorHandle) -> int:
    """Bytes of the tensor a descriptor names (its shape times its dtype's size); InvalidArgument
    for an unknown dtype."""
    try:
        itemsize = dtype_from_name(t.dtype).itemsize
    except Exception as exc:
        raise InvalidArgument(f"descriptor dtype {t.dtype!r} is not a known dtype") from exc
    return int(np.prod(list(t.shape), dtype=np.int64)) * itemsize


def decode(remote: fpb.RemoteTensorHandle | bytes) -> rpb.NixlDescriptor:
    """Parse and check a remote handle; InvalidArgument for anything malformed or inconsistent."""
    if isinstance(remote, (bytes, bytearray, memoryview)):
        msg = fpb.RemoteTensorHandle()
        try:
            msg.ParseFromString(bytes(remote))
        except Exception as exc:
            raise InvalidArgument(f"not a serialized RemoteTensorHandle: {exc}") from exc
        remote = msg
    if remote.transport != TRANSPORT:
        raise InvalidArgument(f"remote handle transport {remote.transport!r} is not {TRANSPORT!r}")
    if len(remote.descriptor) > MAX_DESCRIPTOR_NBYTES:
        raise InvalidArgument(f"descriptor of {len(remote.descriptor)} bytes exceeds {MAX_DESCRIPTOR_NBYTES}")
    desc = rpb.NixlDescriptor()
    try:
        desc.ParseFromString(remote.descriptor)
    except Exception as exc:
        raise InvalidArgument(f"malformed NIXL descriptor: {exc}") from exc
    if desc.version != DESCRIPTOR_VERSION:
        raise InvalidArgument(f"NIXL descriptor version {desc.version}, this reader knows {DESCRIPTOR_VERSION}")
    if not desc.endpoint or not desc.agent_name or not desc.HasField("tensor"):
        raise InvalidArgument("NIXL descriptor lacks endpoint, agent name or tensor")
    t = desc.tensor
    if remote.nbytes != t.shm.nbytes:
        raise InvalidArgument(f"remote handle nbytes {remote.nbytes} != descriptor nbytes {t.shm.nbytes}")
    expected = tensor_nbytes(t)
    if expected != t.shm.nbytes and not (expected == 0 and t.shm.nbytes == 1):
        raise InvalidArgument(f"descriptor nbytes {t.shm.nbytes} != {t.dtype}{list(t.shape)} ({expected} bytes)")
    return desc
