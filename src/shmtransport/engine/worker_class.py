"""``HandleResolvingWorker``: vLLM's worker class for this platform with ``model_worker``'s
resolver before each step (a module of its own: it imports vLLM, which the rest of the package
does only where it runs vLLM)."""
from __future__ import annotations

import os
from typing import Any

from ..client import Consumer
from .handle_items import is_handle_item
from .model_worker import (
    BASE_WORKER_ENV,
    DAEMON_SOCKET_ENV,
    ENCODER_INPUT_LOG_ENV,
    WORKER_CLS,
    HandleResolver,
    check_vllm_version,
    log_encoder_inputs,
)

__all__ = ["HandleResolvingWorker"]


def _base_worker() -> type:
    from vllm.platforms import current_platform
    from vllm.utils.import_utils import resolve_obj_by_qualname

    default = ("vllm.v1.worker.cpu_worker.CPUWorker" if current_platform.is_cpu()
               else "vllm.v1.worker.gpu_worker.Worker")
    base: type = resolve_obj_by_qualname(os.environ.get(BASE_WORKER_ENV) or default)
    return base


class HandleResolvingWorker(_base_worker()):  # type: ignore[misc]
    """The platform's vLLM worker, resolving our handle items before each step runs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import vllm

        problem = check_vllm_version(vllm.__version__)
        if problem is not None:
            raise RuntimeError(problem)
        super().__init__(*args, **kwargs)
        self._shmtransport_resolver: HandleResolver | None = None
        self._shmtransport_probed = False

    def _shmtransport(self) -> HandleResolver:
        if self._shmtransport_resolver is None:
            socket_path = os.environ.get(DAEMON_SOCKET_ENV)
            if not socket_path:
                raise RuntimeError(f"{WORKER_CLS} needs {DAEMON_SOCKET_ENV} (set by shmtransport vllm-worker)")
            self._shmtransport_resolver = HandleResolver(Consumer(socket_path))
        return self._shmtransport_resolver

    def execute_model(self, scheduler_output: Any) -> Any:
        """Release finished requests' leases, resolve new requests' handles, then vLLM's step."""
        resolver = self._shmtransport_resolver
        if resolver is not None and scheduler_output.finished_req_ids:
            resolver.finished(scheduler_output.finished_req_ids,
                              getattr(self.model_runner, "encoder_cache", None))
        for request in scheduler_output.scheduled_new_reqs:
            if any(is_handle_item(f.data) for f in request.mm_features):
                self._shmtransport().resolve(request.req_id, request.mm_features)
        if not self._shmtransport_probed and os.environ.get(ENCODER_INPUT_LOG_ENV):
            self._shmtransport_probed = True
            log_encoder_inputs(self.model_runner.get_model(), os.environ[ENCODER_INPUT_LOG_ENV])
        return super().execute_model(scheduler_output)

    def shutdown(self) -> None:
        """vLLM's shutdown, then this process's daemon session (the daemon reclaims it anyway)."""
        try:
            super().shutdown()
        finally:
            resolver = getattr(self, "_shmtransport_resolver", None)  # None if __init__ failed
            if resolver is not None:
                resolver.consumer.close()
