"""GPU-worker side of the end-to-end pipeline: a gRPC ``Generator`` server running a small real
torch model over tensors leased from shared memory (``server``), and helpers to run it as its own
process (``process``). ``shmtransport worker --socket ... --daemon-socket ...`` starts it."""
from __future__ import annotations

from .process import WorkerProcess, start_daemon_process

__all__ = ["WorkerProcess", "start_daemon_process"]
