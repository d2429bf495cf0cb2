"""One exception tree for the whole package, and the one table that maps it to gRPC status codes.

Every error a client can cause carries a ``Reason``; the daemon sends the reason name in the
status details so the client re-raises the same class. The table is used both ways: server side
``status_for(exc)``, client side ``error_from_status(code, details)``.
"""

from __future__ import annotations

import enum

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
    TABLE_FULL = "table_full"  # no free slots in the tenant's object table: loan through the daemon
    QUOTA_EXCEEDED = "quota_exceeded"
    SHM_TOO_SMALL = "shm_too_small"  # /dev/shm cannot back the requested arena
    FD_LIMIT = "fd_limit"  # the process is out of file descriptors
    PERMISSION_DENIED = "permission_denied"
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

    def __init__(self, message: str, reason: Reason | None = None):
        super().__init__(message)
        self.reason = reason if reason is not None else self.default_reason

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, reason={self.reason.value})"


class InvalidArgument(ShmTransportError, ValueError):
    default_reason = Reason.INVALID_ARGUMENT


class InvalidType(InvalidArgument, TypeError):
    """An argument of the wrong type (a kernel given a str for a buffer, a float for a count)."""


class HandleError(ShmTransportError):
    """A handle that does not name bytes the caller may use (bad, stale, out of bounds)."""

    default_reason = Reason.BAD_HANDLE


class OwnershipError(ShmTransportError):
    default_reason = Reason.NOT_OWNER


class StateError(ShmTransportError):
    default_reason = Reason.WRONG_STATE


class ResourceExhausted(ShmTransportError):
    default_reason = Reason.ARENA_FULL


class PermissionDenied(ShmTransportError):
    default_reason = Reason.PERMISSION_DENIED


class Unavailable(ShmTransportError):
    default_reason = Reason.DAEMON_UNAVAILABLE


class IdentityMismatch(ShmTransportError):
    default_reason = Reason.IDENTITY_MISMATCH


class ClosedError(ShmTransportError):
    """Use of a closed resource or of a view whose lease was released."""

    default_reason = Reason.CLOSED


class DeadlineExceeded(ShmTransportError, TimeoutError):
    default_reason = Reason.DEADLINE_EXCEEDED


class MissingDependency(ShmTransportError, ImportError):
    """An optional package the call needs is not installed; the message says what to install."""

    default_reason = Reason.MISSING_DEPENDENCY


class InternalError(ShmTransportError):
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
    Reason.SHM_TOO_SMALL: (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    Reason.FD_LIMIT: (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    Reason.PERMISSION_DENIED: (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
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

_SEPARATOR = ": "


def status_for(exc: ShmTransportError) -> tuple[grpc.StatusCode, str]:
    """Server side: the status code and details string that carry ``exc`` to the client."""
    _, code = _TABLE[exc.reason]
    return code, f"{exc.reason.value}{_SEPARATOR}{exc.message}"


def error_from_status(code: grpc.StatusCode, details: str | None) -> ShmTransportError:
    """Client side: rebuild the typed exception from a status (ours or a bare transport one)."""
    details = details or code.name
    head, sep, rest = details.partition(_SEPARATOR)
    try:
        reason = Reason(head) if sep else None
    except ValueError:
        reason = None
    if reason is None or _TABLE[reason][1] != code:
        reason = _BARE_STATUS.get(code, Reason.INTERNAL)
        rest = details
    cls, _ = _TABLE[reason]
    return cls(rest, reason)


def error_from_rpc(err: grpc.RpcError) -> ShmTransportError:
    return error_from_status(err.code(), err.details())
