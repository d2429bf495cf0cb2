"""What both ends of the daemon's socket agree on, beside the protos: where the socket is by
default, the session metadata key, the gRPC channel options, the batch limit and the framing of
the session handshake's messages.

The bottom layer: the daemon and the client both import it, and it imports neither.
"""
from __future__ import annotations

import os
import struct

# gRPC metadata carrying the session token the handshake gave the client.
SESSION_METADATA_KEY = "shmt-session"

# Entries in one Loan/Commit/Acquire/Release; clients split larger ones.
MAX_BATCH = 4096

# A client channel's options (the daemon's answers, a List of every object included, stay far below).
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.so_reuseport", 0),
]


# The session handshake's messages (``SessionRequest``, ``SessionReply``) each travel as a 4-byte
# big-endian length, then the serialized message: a stream socket has no message boundaries.
_FRAME_HEADER = struct.Struct(">I")


def framed(payload: bytes) -> bytes:
    """``payload`` as one handshake frame: its 4-byte big-endian length, then the bytes."""
    return _FRAME_HEADER.pack(len(payload)) + payload


def frame_payload(data: bytes, limit: int) -> bytes | None:
    """The payload once ``data`` holds a whole frame, None while it is short; ValueError when the
    frame announces more than ``limit`` bytes (checked before they are waited for)."""
    if len(data) < _FRAME_HEADER.size:
        return None
    (nbytes,) = _FRAME_HEADER.unpack_from(data)
    if nbytes > limit:
        raise ValueError(f"a handshake message of {nbytes} bytes exceeds the limit of {limit}")
    end = _FRAME_HEADER.size + nbytes
    return data[_FRAME_HEADER.size:end] if len(data) >= end else None


def default_socket_path() -> str:
    """``$SHMTRANSPORT_SOCKET``, else a ``daemon.sock`` in a directory only this uid can create
    entries in (the daemon creates it 0700 and refuses one anybody else could write to): root's
    ``/run/shmtransport``, ``$XDG_RUNTIME_DIR/shmtransport``, or ``/tmp/shmtransport-<uid>``."""
    explicit = os.environ.get("SHMTRANSPORT_SOCKET")
    if explicit:
        return explicit
    euid = os.geteuid()
    if euid == 0:
        return "/run/shmtransport/daemon.sock"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "shmtransport", "daemon.sock")
    return f"/tmp/shmtransport-{euid}/daemon.sock"
