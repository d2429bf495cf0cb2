"""Transport peers for ``benchmarks/suites/transport.py``: one module per peer, one process harness.

Every peer module defines ``Producer`` (runs in the benchmark process, owns the timed span) and,
unless it is a single-process floor, ``Consumer`` (runs in a ``spawn``ed child driven by
``common.consumer_main``). ``common.Session`` glues the two halves together.
"""
from __future__ import annotations

import importlib
import importlib.util
import pathlib
import sys

_SRC = pathlib.Path(__file__).resolve().parents[2] / "src"
if importlib.util.find_spec("shmtransport") is None and _SRC.is_dir():  # repo checkout, not installed
    sys.path.insert(0, str(_SRC))

BASELINE_PEERS = ("memcpy", "bare_rtt", "grpc_inline", "mp_shared_memory", "segment_pread", "torch_mp_queue",
                  "grpc_inline_tcp", "vllm_msgpack_inline", "dynamo_segment", "mp_shared_memory_reused",
                  "pickle5_oob", "shm_floor")
OURS_PEERS = ("shm_put_hash", "shm_put", "shm_loan", "shm_put_verify", "shm_loan_verify")
# What a user would pick instead of us, each an optional package (the ``peers`` extra); both take
# ``max_nbytes`` (the suite's largest payload) to size their shared memory up front.
ALTERNATIVE_PEERS = {"iceoryx2_loan": "iceoryx2", "ray_put": "ray"}
ALL_PEERS = BASELINE_PEERS + OURS_PEERS + tuple(ALTERNATIVE_PEERS)


def import_error(peer: str) -> str | None:
    """None when an alternative peer's package imports, else why not."""
    try:
        importlib.import_module(f"peers.{peer}").import_package()
    except Exception as exc:  # noqa: BLE001 — ImportError, or a broken install failing at import
        return f"{ALTERNATIVE_PEERS[peer]} not importable ({type(exc).__name__}: {exc})"
    return None
