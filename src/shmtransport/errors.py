"""One exception tree for the whole package, and the one table that maps it to gRPC status codes.

Every error a client can cause carries a ``Reason``, and may name the request ``field`` at fault
and the ``limit`` it exceeded. A server sends the reason and those fields in trailing metadata
(the details are the message alone), so the client re-raises the same class with the same fields.
The table is used both ways: server side ``status_for(exc)`` (applied by ``error_boundary``),
client side ``error_from_rpc(err)``.
"""

from __future__ import annotations

import enum
from typing import cast

import grpc


class Reason(str, enum.Enum):
    """Why an operation failed. Stable strings: they travel on the wire."""

    INVALID_ARGUMENT = "invalid_argument"
    BAD_HANDLE = "bad_handle"  # unknown, forged or malformed handle
    STALE_HANDLE = "stale_handle"  # generation does not match the current owner of the bytes
    OUT_OF_BOUNDS = "out_of_bounds"  # offset/length outside the arena or the allocation
    NOT_OWNER = "not_owner"  # release/commit of another client's loan or lease
    DOUBLE_RELEASE = "double_release"
    WRONG_STATE = "wrong_state"  # e.g. acquire of an uncommitted loan, commit twice
    ARENA_FULL = "arena_full"
    TABLE_FULL = "table_full"  # every slot of the tenant's object table holds a live object (--object-slots)
    QUOTA_EXCEEDED = "quota_exceeded"
    TENANT_BUSY = "tenant_busy"  # the tenant's share of the daemon's RPC threads is in use: retried by the client
    SHM_TOO_SMALL = "shm_too_small"  # not enough memory for the arena, or /dev/shm for a dedicated segment
    FD_LIMIT = "fd_limit"  # the process is out of file descriptors
    PERMISSION_DENIED = "permission_denied"
    UNKNOWN_SESSION = "unknown_session"  # no live session for the call's token: the client reconnects
    DAEMON_UNAVAILABLE = "daemon_unavailable"
    INSTANCE_MISMATCH = "instance_mismatch"  # handle of a dead daemon instance
    IDENTITY_MISMATCH = "identity_mismatch"
    VIEW_RELEASED = "view_released"
    CLOSED = "closed"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    MISSING_DEPENDENCY = "missing_dependency"  # an optional package this call needs is not installed
    INTERNAL = "internal"


class ShmTransportError(Exception):
    """Base of every error this package raises on purpose."""

    default_reason = Reason.INTERNAL

    def __init__(self, message: str, reason: Reason | None = None, *, field: str | None = None,
                 limit: int | None = None):
        """``field``: the request field at fault (e.g. ``batches[0].items[1].kwargs``); ``limit``:
        the limit it exceeded (a quota, a count). Both travel to the client with the reason."""
        super().__init__(message)
        self.reason = reason if reason is not None else self.default_reason
        self.field = field
        self.limit = limit

    @property
    def message(self) -> str:
        """The message alone, without the reason or fields."""
        return str(self.args[0]) if self.args else ""

    def __repr__(self) -> str:
        extra = "".join(f", {name}={value!r}" for name, value in (("field", self.field), ("limit", self.limit))
                        if value is not None)
        return f"{type(self).__name__}({self.message!r}, reason={self.reason.value}{extra})"


class InvalidArgument(ShmTransportError, ValueError):
    """A value the call cannot accept (out of range, malformed, over a limit); also a ``ValueError``."""

    default_reason = Reason.INVALID_ARGUMENT


class InvalidType(InvalidArgument, TypeError):
    """An argument of the wrong type (a kernel given a str for a buffer, a float for a count)."""


class HandleError(ShmTransportError):
    """A handle that does not name bytes the caller may use (bad, stale, out of bounds)."""

    default_reason = Reason.BAD_HANDLE


class OwnershipError(ShmTransportError):
    """An operation only the object's producer (or lease holder) may do."""

    default_reason = Reason.NOT_OWNER


class StateError(ShmTransportError):
    """An operation the object's state does not allow (already committed, already released)."""

    default_reason = Reason.WRONG_STATE


class ResourceExhausted(ShmTransportError):
    """No room: arena full, a quota or a limit reached (the reason says which)."""

    default_reason = Reason.ARENA_FULL


class PermissionDenied(ShmTransportError):
    """Not allowed: an unknown session, a uid not admitted, or a path that belongs to someone else."""

    default_reason = Reason.PERMISSION_DENIED


class Unavailable(ShmTransportError):
    """The daemon cannot be reached, or the handle is of another daemon instance."""

    default_reason = Reason.DAEMON_UNAVAILABLE


class IdentityMismatch(ShmTransportError):
    """Bytes whose digest is not the identity the handle claims (``verify()``)."""

    default_reason = Reason.IDENTITY_MISMATCH


class ClosedError(ShmTransportError):
    """Use of a closed resource or of a view whose lease was released."""

    default_reason = Reason.CLOSED


class DeadlineExceeded(ShmTransportError, TimeoutError):
    """The call's deadline passed; also a ``TimeoutError``."""

    default_reason = Reason.DEADLINE_EXCEEDED


class MissingDependency(ShmTransportError, ImportError):
    """An optional package the call needs is not installed; the message says what to install."""

    default_reason = Reason.MISSING_DEPENDENCY


class InternalError(ShmTransportError):
    """A bug or an unexpected failure on the other side; not caused by the request."""

    default_reason = Reason.INTERNAL


# reason -> (exception class, gRPC status). The single source of truth, read in both directions.
_TABLE: dict[Reason, tuple[type[ShmTransportError], grpc.StatusCode]] = {
    Reason.INVALID_ARGUMENT: (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    Reason.BAD_HANDLE: (HandleError, grpc.StatusCode.NOT_FOUND),
    Reason.STALE_HANDLE: (HandleError, grpc.StatusCode.NOT_FOUND),
    Reason.OUT_OF_BOUNDS: (HandleError, grpc.StatusCode.OUT_OF_RANGE),
    Reason.NOT_OWNER: (OwnershipError, grpc.StatusCode.PERMISSION_DENIED),
    Reason.DOUBLE_RELEASE: (StateError, grpc.StatusCode.FAILED_PRECONDITION),
    Reason.WRONG_STATE: (StateError, grpc.StatusCode.FAILED_PRECONDITION),
    Reason.ARENA_FULL: (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    Reason.TABLE_FULL: (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    Reason.QUOTA_EXCEEDED: (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    Reason.TENANT_BUSY: (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    Reason.SHM_TOO_SMALL: (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    Reason.FD_LIMIT: (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    Reason.PERMISSION_DENIED: (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    Reason.UNKNOWN_SESSION: (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    Reason.DAEMON_UNAVAILABLE: (Unavailable, grpc.StatusCode.UNAVAILABLE),
    Reason.INSTANCE_MISMATCH: (Unavailable, grpc.StatusCode.UNAVAILABLE),
    Reason.IDENTITY_MISMATCH: (IdentityMismatch, grpc.StatusCode.DATA_LOSS),
    Reason.VIEW_RELEASED: (ClosedError, grpc.StatusCode.FAILED_PRECONDITION),
    Reason.CLOSED: (ClosedError, grpc.StatusCode.FAILED_PRECONDITION),
    Reason.DEADLINE_EXCEEDED: (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    Reason.MISSING_DEPENDENCY: (MissingDependency, grpc.StatusCode.FAILED_PRECONDITION),
    Reason.INTERNAL: (InternalError, grpc.StatusCode.INTERNAL),
}

# Status codes that arrive without one of our reasons (transport failures, foreign servers).
_BARE_STATUS: dict[grpc.StatusCode, Reason] = {
    grpc.StatusCode.UNAVAILABLE: Reason.DAEMON_UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: Reason.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED: Reason.DAEMON_UNAVAILABLE,
    grpc.StatusCode.INVALID_ARGUMENT: Reason.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Reason.ARENA_FULL,
    grpc.StatusCode.PERMISSION_DENIED: Reason.PERMISSION_DENIED,
    grpc.StatusCode.NOT_FOUND: Reason.BAD_HANDLE,
    grpc.StatusCode.OUT_OF_RANGE: Reason.OUT_OF_BOUNDS,
    grpc.StatusCode.FAILED_PRECONDITION: Reason.WRONG_STATE,
    grpc.StatusCode.DATA_LOSS: Reason.IDENTITY_MISMATCH,
}

# Trailing metadata keys of a typed error. The field is binary (``-bin``): it may name a kwarg
# key, which is any text, and plain metadata values must be printable ASCII.
REASON_KEY = "x-shmt-reason"
FIELD_KEY = "x-shmt-field-bin"
LIMIT_KEY = "x-shmt-limit"


def status_for(exc: ShmTransportError) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str | bytes], ...]]:
    """Server side: the status code, details and trailing metadata that carry ``exc`` to the client."""
    _, code = _TABLE[exc.reason]
    metadata: list[tuple[str, str | bytes]] = [(REASON_KEY, exc.reason.value)]
    if exc.field is not None:
        metadata.append((FIELD_KEY, exc.field.encode("utf-8")))
    if exc.limit is not None:
        metadata.append((LIMIT_KEY, str(exc.limit)))
    return code, exc.message, tuple(metadata)


def _trailing_metadata(err: grpc.RpcError) -> tuple[tuple[str, str | bytes], ...]:
    """The (key, value) pairs of a failure's trailing metadata. grpc-stubs types them as a
    ``_Metadatum`` that cannot be unpacked; at runtime they are pairs (namedtuples, or the tuples
    ``grpc.aio.Metadata`` iterates over)."""
    return cast("tuple[tuple[str, str | bytes], ...]", err.trailing_metadata() or ())


def carried_reason(err: grpc.RpcError) -> Reason | None:
    """The reason a server of ours sent with this failure (one we know, agreeing with the status
    code), or None: a bare status from the transport, a proxy or a foreign server."""
    value = next((v for k, v in _trailing_metadata(err) if k == REASON_KEY), None)
    try:
        reason = Reason(value)
    except ValueError:
        return None
    return reason if _TABLE[reason][1] == err.code() else None


def _int_or_none(value: str | bytes | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def error_from_rpc(err: grpc.RpcError) -> ShmTransportError:
    """Client side: rebuild the typed exception of a failed call. Without a reason of ours in its
    trailing metadata (a transport failure such as UNAVAILABLE or DEADLINE_EXCEEDED, a proxy, a
    foreign server) the class follows the status code alone, INTERNAL when nothing fits."""
    reason = carried_reason(err)
    if reason is None:
        reason = _BARE_STATUS.get(err.code(), Reason.INTERNAL)
        return _TABLE[reason][0](err.details() or err.code().name, reason)
    carried = {key: value for key, value in _trailing_metadata(err)}
    field = carried.get(FIELD_KEY)
    return _TABLE[reason][0](err.details() or "", reason,
                             field=field.decode("utf-8", "replace") if isinstance(field, bytes) else None,
                             limit=_int_or_none(carried.get(LIMIT_KEY)))


def error_for_reason(reason: str, message: str) -> ShmTransportError:
    """The typed error a reason's value names (a refusal that did not travel as a gRPC status, such
    as the session handshake's); an unknown value is an ``InternalError`` that says so."""
    try:
        known = Reason(reason)
    except ValueError:
        return InternalError(f"unknown reason {reason!r}: {message}")
    cls, _ = _TABLE[known]
    return cls(message, known)
