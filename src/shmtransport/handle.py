"""``Handle``: where one tensor lives in shared memory (the daemon's handle plus dtype, shape and
digest). Plain data: the frontend builds it, the request carries it, the worker acquires it."""
from __future__ import annotations

from typing import Sequence

from .errors import InvalidArgument
from .v1 import daemon_pb2 as pb

__all__ = ["Handle"]


class Handle:
    """A tensor in shared memory: the daemon handle plus dtype, shape and (optional) digest."""

    __slots__ = ("shm", "dtype", "shape", "digest", "commit_token")

    def __init__(
        self, shm: pb.Handle, dtype: str, shape: Sequence[int], *, digest: bytes = b"", commit_token: bytes = b""
    ):
        self.shm = shm
        self.dtype = dtype
        self.shape = tuple(int(d) for d in shape)
        self.digest = digest
        self.commit_token = commit_token  # a producer that lets the first Acquire commit sets it

    @property
    def nbytes(self) -> int:
        """Size of the object in bytes (a zero-size tensor occupies 1)."""
        return self.shm.nbytes

    def to_proto(self) -> pb.TensorHandle:
        """The ``shmtransport.v1.TensorHandle`` message, to embed in a request."""
        return pb.TensorHandle(
            shm=self.shm, dtype=self.dtype, shape=self.shape, digest=self.digest, commit_token=self.commit_token
        )

    @classmethod
    def from_proto(cls, msg: pb.TensorHandle) -> "Handle":
        """The handle a ``TensorHandle`` message carries (checked when it is acquired)."""
        return cls(msg.shm, msg.dtype, msg.shape, digest=msg.digest, commit_token=msg.commit_token)

    def to_bytes(self) -> bytes:
        """The serialized ``TensorHandle``: what a frontend sends the worker (about 100 bytes)."""
        return self.to_proto().SerializeToString()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Handle":
        """The handle ``to_bytes`` wrote; InvalidArgument when ``data`` is not one."""
        msg = pb.TensorHandle()
        try:
            msg.ParseFromString(data)
        except Exception as exc:  # protobuf raises DecodeError; keep our error type
            raise InvalidArgument(f"not a serialized TensorHandle: {exc}") from exc
        return cls.from_proto(msg)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Handle) and self.to_bytes() == other.to_bytes()

    def __hash__(self) -> int:
        return hash((self.shm.instance_id, self.shm.offset, self.shm.generation))

    def __repr__(self) -> str:
        return (
            f"Handle({self.dtype}{list(self.shape)}, nbytes={self.nbytes}, offset={self.shm.offset}, "
            f"gen={self.shm.generation}, instance={self.shm.instance_id})"
        )
