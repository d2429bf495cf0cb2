"""Transport peers for ``benchmarks/suites/transport.py``: one module per peer, one process harness.

Every peer module defines ``Producer`` (runs in the benchmark process, owns the timed span) and,
unless it is a single-process floor, ``Consumer`` (runs in a ``spawn``ed child driven by
``common.consumer_main``). ``common.Session`` glues the two halves together.
"""
from __future__ import annotations

import importlib.util
import pathlib
import sys

_SRC = pathlib.Path(__file__).resolve().parents[2] / "src"
if importlib.util.find_spec("shmtransport") is None and _SRC.is_dir():  # repo checkout, not installed
    sys.path.insert(0, str(_SRC))

BASELINE_PEERS = ("memcpy", "bare_rtt", "grpc_inline", "mp_shared_memory", "segment_pread", "torch_mp_queue",
                  "grpc_inline_tcp", "vllm_msgpack_inline", "dynamo_segment", "mp_shared_memory_reused",
                  "pickle5_oob")
OURS_PEERS = ("shm_put_hash", "shm_put", "shm_loan", "shm_put_verify", "shm_loan_verify")
ALL_PEERS = BASELINE_PEERS + OURS_PEERS
