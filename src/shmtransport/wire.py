"""What both ends of the daemon's socket agree on, beside the protos: where the socket is by
default, the session metadata key, the gRPC channel options and the batch limit.

The bottom layer: the daemon and the client both import it, and it imports neither.
"""
from __future__ import annotations

import os

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
