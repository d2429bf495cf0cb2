"""Where vLLM's model runs (the EngineCore at tensor-parallel size 1, each rank's worker process
above that): handle items (``handle_items``) become read-only views of the arena just before the
model runner sees them.

``HandleResolvingWorker`` is vLLM's worker class for the platform (``CPUWorker``, the CUDA
``Worker``, or the class the user named with ``--worker-cls``: ``BASE_WORKER_ENV``), with
``execute_model`` preceded by the swap, as vLLM's own shared-memory cache does it in
``WorkerWrapperBase._apply_mm_cache``. ``vllm-worker`` installs it through vLLM's supported
``--worker-cls`` (``parallel_config.worker_cls``). It reads vLLM data structures that are not a
stable interface (``SchedulerOutput.scheduled_new_reqs[*].mm_features`` and ``finished_req_ids``),
so it works with the vLLM versions in ``SUPPORTED_VLLM`` and refuses others at start.

Leases follow vLLM's use: each process that resolves is a Consumer of the daemon, and holds the
leases of a request until vLLM reports it finished (``finished_req_ids``, aborts included); an
encoder that runs again after a preemption finds the same bytes. A killed engine process is a dead
session to the daemon, which reclaims its leases. Identities are not recomputed here: the API
process verified them from the same immutable bytes before sending the handles (once, not once per
rank), and a handle names one object generation, so any other object fails to acquire.

A handle that no longer acquires can only belong to a request the API process has given up on
(aborted while this step was on its way, after the API process's own leases went): its tensor is
zeros, under a key of its own in vLLM's encoder cache so that no other request ever reads that
output; the request's tokens go nowhere. Dummy and profiling runs feed vLLM's own tensors and
never pass through here.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any

from ..client import Consumer, Lease
from ..errors import ShmTransportError
from ..tensors import DTYPES, to_torch
from .handle_items import MARKER_KEY, is_handle_item, parse_marker

BASE_WORKER_ENV = "SHMTRANSPORT_VLLM_BASE_WORKER"  # the worker class ours extends
DAEMON_SOCKET_ENV = "SHMTRANSPORT_VLLM_DAEMON_SOCKET"
ENCODER_INPUT_LOG_ENV = "SHMTRANSPORT_ENCODER_INPUT_LOG"  # JSON lines: where each encoder input lies
WORKER_CLS = "shmtransport.engine.worker_class.HandleResolvingWorker"  # imports vLLM: a module of its own
SUPPORTED_VLLM = ("0.32.",)  # version prefixes whose SchedulerOutput and feature layout this reads
UNAVAILABLE_PREFIX = "shmtransport-unavailable:"

_log = logging.getLogger(__name__)

__all__ = ["HandleResolver", "check_vllm_version", "log_encoder_inputs", "WORKER_CLS", "SUPPORTED_VLLM"]


def check_vllm_version(version: str) -> str | None:
    """Why handles cannot ride through this vLLM version; None when they can."""
    if version.startswith(SUPPORTED_VLLM):
        return None
    return (f"shmtransport's model-side resolver reads vLLM's scheduler output, which is not a stable "
            f"interface: it supports vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM)}, not {version}")


class HandleResolver:
    """Per process: swaps handle items for arena views and holds their leases per request."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer
        self._leases: dict[str, list[Lease]] = {}  # request id -> leases
        self._unavailable: dict[str, list[str]] = {}  # request id -> its encoder-cache keys of zeros
        self._lock = threading.Lock()

    @property
    def live_requests(self) -> int:
        """Requests whose leases this process holds."""
        return len(self._leases)

    def resolve(self, request_id: str, features: list[Any]) -> None:
        """Swap every handle item of ``features`` (vLLM's ``MultiModalFeatureSpec`` list of one
        new request) for views of the arena, in place; the leases are the request's."""
        pending = [(f, parse_marker(bytes(f.data[MARKER_KEY].data.numpy())))
                   for f in features if is_handle_item(f.data)]
        if not pending:
            return
        handles = [h for _, marker in pending for h in marker.values()]
        try:
            leases = self.consumer.acquire_many(handles)
        except ShmTransportError as exc:
            _log.warning("request %s: its handles no longer acquire (%s); aborted by the API process, "
                         "its items are encoded from zeros under keys of their own", request_id, exc)
            self._zeros(request_id, pending)
            return
        with self._lock:
            self._leases.setdefault(request_id, []).extend(leases)
        it = iter(leases)
        for feature, marker in pending:
            item = feature.data
            del item[MARKER_KEY]
            for key in marker:
                item[key].data = next(it).tensor()

    def _zeros(self, request_id: str, pending: list[tuple[Any, dict[str, Any]]]) -> None:
        import numpy as np

        for i, (feature, marker) in enumerate(pending):
            item = feature.data
            del item[MARKER_KEY]
            for key, h in marker.items():
                item[key].data = to_torch(np.zeros(h.shape, DTYPES[h.dtype]), h.dtype)
            feature.identifier = f"{UNAVAILABLE_PREFIX}{request_id}:{i}"
            with self._lock:
                self._unavailable.setdefault(request_id, []).append(feature.identifier)

    def finished(self, request_ids: set[str] | frozenset[str], encoder_cache: dict[str, Any] | None) -> None:
        """Release the leases of finished requests (the client defers each until vLLM has dropped
        its last view); forget their outputs from zeros in ``encoder_cache``."""
        with self._lock:
            done = [lease for r in request_ids for lease in self._leases.pop(r, ())]
            keys = [k for r in request_ids for k in self._unavailable.pop(r, ())]
        if done:
            self.consumer.release(done)
        if encoder_cache is not None:
            for key in keys:
                encoder_cache.pop(key, None)


def log_encoder_inputs(model: Any, path: str) -> None:
    """Diagnostics: append, per call of the model's ``embed_multimodal``, where each tensor input
    lies (its data pointer inside a mapping of a shmtransport arena or not)."""
    inner = model.embed_multimodal

    def embed_multimodal(**kwargs: Any) -> Any:
        import torch

        record = {key: _where(value) for key, value in kwargs.items() if isinstance(value, torch.Tensor)}
        with open(path, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "inputs": record}) + "\n")
        return inner(**kwargs)

    model.embed_multimodal = embed_multimodal


def _where(tensor: Any) -> dict[str, Any]:
    """The mapping that holds ``tensor``'s first byte: its path (a memfd's name) and whether it is
    one of a shmtransport arena."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if start <= address < end:
                path = parts[5].strip() if len(parts) > 5 else ""
                return {"nbytes": tensor.nbytes, "path": path, "in_arena": path.startswith("/memfd:")
                        and "-arena" in path, "shared": parts[1][3] == "s"}
    return {"nbytes": tensor.nbytes, "path": "", "in_arena": False, "shared": False}
