"""Our EC connector with a stall a test arms, for the tests that kill an engine mid-save or mid-load.

A vLLM server loads it with ``{"ec_connector": "StallingECConnector", "ec_connector_module_path":
"ec_faults"}`` (this directory on its ``PYTHONPATH``) and ``SHMT_FAULT_DIR`` in its environment.
Unarmed it is ``ShmtransportECConnector`` exactly. While ``$SHMT_FAULT_DIR/stall-save`` exists, a
save loans its arena space, writes half the encoder output there, creates
``$SHMT_FAULT_DIR/stalled`` and sleeps until it is killed (the loan never committed, nothing
published); while ``stall-load`` exists, a load acquires the object, creates ``stalled`` and sleeps
(the lease taken, the step never finished). The shipped connector has no such stall.
"""
from __future__ import annotations

import os
import pathlib
import time
from typing import Any

from shmtransport.engine.ec_connector import ShmtransportECConnector

STALL_S = 600.0  # far longer than any test waits: the test's SIGKILL ends it


def _fault_dir() -> pathlib.Path:
    return pathlib.Path(os.environ["SHMT_FAULT_DIR"])


def _stall() -> None:
    (_fault_dir() / "stalled").touch()
    time.sleep(STALL_S)


class StallingECConnector(ShmtransportECConnector):
    def save_caches(self, encoder_cache: dict[str, Any], mm_hash: str, **kwargs: Any) -> None:
        if not (_fault_dir() / "stall-save").exists() or not self.is_producer or not self._writes():
            return super().save_caches(encoder_cache, mm_hash, **kwargs)
        output = encoder_cache[mm_hash].detach().reshape(-1)
        loan = self._producer_client().loan(shape=tuple(output.shape), dtype=output.dtype)
        half = output.numel() // 2
        loan.tensor()[:half].copy_(output[:half])
        _stall()

    def _load(self, mm_hash: str, wire: bytes) -> Any:
        if not (_fault_dir() / "stall-load").exists():
            return super()._load(mm_hash, wire)
        self._consumer_client().acquire_bytes(wire)
        _stall()
