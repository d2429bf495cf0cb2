"""GPU-worker side of the end-to-end pipeline: opening a request into engine-ready inputs
(``request``: zero-copy torch views, identity verified), a gRPC ``Generator`` server running a small
real torch model over them (``server``), and helpers to run it as its own process (``process``).
``shmtransport worker --socket ... --daemon-socket ...`` starts it."""
from __future__ import annotations

from .process import WorkerProcess, start_daemon_process

__all__ = ["WorkerProcess", "start_daemon_process"]
