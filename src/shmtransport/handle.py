"""``Handle``: where one tensor lives in shared memory (the daemon's handle plus dtype, shape and
digest). Immutable plain data: the frontend builds it, the request carries it, the worker
acquires it."""
from __future__ import annotations

from typing import Sequence

from . import handle_wire
from .errors import InvalidArgument
from .handle_wire import Where
from .v1 import daemon_pb2 as pb

__all__ = ["Handle", "Where"]


class Handle:
    """A tensor in shared memory: the daemon handle plus dtype, shape and (optional) digest.

    Immutable: ``with_digest`` makes a new one. Its ``shm`` message and its wire form
    (``to_bytes``) are each built once, when first asked for: a handle read from the wire keeps
    its bytes, and one a producer placed in its object table starts from plain values."""

    __slots__ = ("_shm", "_where", "_wire", "_dtype", "_shape", "_digest", "_commit_token")

    def __init__(
        self, shm: pb.Handle, dtype: str, shape: Sequence[int], *, digest: bytes = b"", commit_token: bytes = b""
    ):
        self._shm: pb.Handle | None = shm
        self._where: Where | None = None
        self._wire: bytes | None = None
        self._dtype = dtype
        self._shape = tuple(int(d) for d in shape)
        self._digest = digest
        self._commit_token = commit_token

    @classmethod
    def _of(cls, where: Where | None, wire: bytes | None, dtype: str, shape: tuple[int, ...], digest: bytes = b"",
            commit_token: bytes = b"") -> "Handle":
        """A handle known by its plain values or its wire form (one at least), the rest built later."""
        handle = cls.__new__(cls)
        handle._shm, handle._where, handle._wire = None, where, wire
        handle._dtype, handle._shape, handle._digest, handle._commit_token = dtype, shape, digest, commit_token
        return handle

    @property
    def shm(self) -> pb.Handle:
        """The daemon's handle: segment, offset, size, generation, instance, slot (do not modify)."""
        if self._shm is None:
            if self._where is not None:
                self._shm = pb.Handle(**self._where._asdict())
            else:
                assert self._wire is not None
                self._shm = pb.TensorHandle.FromString(self._wire).shm
        return self._shm

    @property
    def where(self) -> Where:
        """``shm``'s fields as plain values (cheaper to read than the message's)."""
        if self._where is None:
            s = self.shm
            self._where = Where(s.name, s.offset, s.nbytes, s.owner_id, s.generation, s.instance_id, s.slot)
        return self._where

    @property
    def dtype(self) -> str:
        """vLLM's name of the tensor's dtype ("float32", "bfloat16", ...)."""
        return self._dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor's shape."""
        return self._shape

    @property
    def digest(self) -> bytes:
        """The content digest the producer computed (``Lease.verify`` checks it); empty if none."""
        return self._digest

    @property
    def commit_token(self) -> bytes:
        """Set by a producer that lets the first Acquire commit the object; empty otherwise."""
        return self._commit_token

    @property
    def nbytes(self) -> int:
        """Size of the object in bytes (a zero-size tensor occupies 1)."""
        return self.where.nbytes

    def with_digest(self, digest: bytes) -> "Handle":
        """This handle carrying ``digest``."""
        return Handle._of(self.where, None, self._dtype, self._shape, digest, self._commit_token)

    def to_proto(self) -> pb.TensorHandle:
        """The ``shmtransport.v1.TensorHandle`` message, to embed in a request."""
        return pb.TensorHandle(
            shm=self.shm, dtype=self._dtype, shape=self._shape, digest=self._digest, commit_token=self._commit_token
        )

    @classmethod
    def from_proto(cls, msg: pb.TensorHandle) -> "Handle":
        """The handle a ``TensorHandle`` message carries (checked when it is acquired)."""
        return cls(msg.shm, msg.dtype, msg.shape, digest=msg.digest, commit_token=msg.commit_token)

    def to_bytes(self) -> bytes:
        """The serialized ``TensorHandle``: what a frontend sends the worker (about 100 bytes)."""
        if self._wire is None:
            w = self.where
            self._wire = handle_wire.write(
                w.name.encode(), w.offset, w.nbytes, w.owner_id.encode(), w.generation, w.instance_id.encode(),
                w.slot, self._dtype.encode(), self._shape, self._digest, self._commit_token,
            ) or self.to_proto().SerializeToString()
        return self._wire

    @classmethod
    def from_bytes(cls, data: bytes) -> "Handle":
        """The handle ``to_bytes`` wrote; InvalidArgument when ``data`` is not one."""
        data = bytes(data)
        f = handle_wire.parse(data)
        if f is not None:
            return cls._of(f.where, data, f.dtype, f.shape, f.digest, f.commit_token)
        msg = pb.TensorHandle()
        try:
            msg.ParseFromString(data)
        except Exception as exc:  # protobuf raises DecodeError; keep our error type
            raise InvalidArgument(f"not a serialized TensorHandle: {exc}") from exc
        return cls.from_proto(msg)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Handle) and self.to_bytes() == other.to_bytes()

    def __hash__(self) -> int:
        w = self.where
        return hash((w.instance_id, w.offset, w.generation))

    def __repr__(self) -> str:
        w = self.where
        return (
            f"Handle({self.dtype}{list(self.shape)}, nbytes={w.nbytes}, offset={w.offset}, "
            f"gen={w.generation}, instance={w.instance_id})"
        )
