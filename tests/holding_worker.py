"""The reference worker with a lease hold plugged in, for the tests that need a request caught while
the worker holds its leases (a client deadline, a worker or frontend killed mid-request).

    python tests/holding_worker.py --socket PATH --daemon-socket PATH [--device cpu]
        [--max-inline-bytes N] [--torch-threads N] [--log-level WARNING]

A request with metadata ``x-shmt-test-hold-ms: N`` (``HOLD_KEY``) keeps its leases for N ms once the
worker has opened it (leased and verified), or until its client goes away, then goes on as usual;
every other request is served exactly as ``shmtransport worker`` serves it. The hold plugs into the
real worker through ``GeneratorService(after_open=...)`` (``shmtransport.worker.server``), as the
benchmark's ``benchmarks/peers/segment_pread_worker.py`` plugs its ingest in; the shipped worker has
no such hold. Tests start it with ``WorkerProcess(..., entry=ENTRY)``: it takes the options
``WorkerProcess`` passes and prints the same ready line as ``shmtransport worker``.
"""
from __future__ import annotations

import pathlib
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc

    from shmtransport.worker.request import EngineInputs
    from shmtransport.worker.server import GeneratorService

HOLD_KEY = "x-shmt-test-hold-ms"
ENTRY = (str(pathlib.Path(__file__).resolve()),)  # WorkerProcess(entry=...): ``python`` runs this script
_POLL_S = 0.01


def hold(service: GeneratorService, inputs: EngineInputs, context: grpc.ServicerContext | None) -> None:
    """``after_open``: keep the request's leases for its ``HOLD_KEY`` ms, or until its client goes away
    (the worker then ends the request as cancelled)."""
    if context is None:
        return
    hold_ms = int(dict(context.invocation_metadata()).get(HOLD_KEY, 0))
    deadline = time.monotonic() + hold_ms / 1000
    while time.monotonic() < deadline and context.is_active():
        time.sleep(_POLL_S)


def main(argv: list[str] | None = None) -> int:
    from shmtransport.worker.process import serve_entry

    return serve_entry("holding worker", argv, after_open=hold)


if __name__ == "__main__":
    sys.exit(main())
