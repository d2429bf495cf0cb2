"""The GPU-worker side of the pipeline: a gRPC ``Generator`` server (Generate, GenerateStream,
GetServerInfo) that consumes multimodal requests through ``worker.request.open_request`` and runs
``TinyMultimodalModel``.

Per request: validate the prompt and controls (``sampling.project_sampling``) -> ``open_request``
(one Acquire for every shm tensor, identity recomputed from shared memory and checked, is_embed
expanded) -> tensors on the device (CPU: the zero-copy views themselves; CUDA: one host->device copy
straight from the arena mapping, registered as pinned memory with ``cudaHostRegister`` when
possible) -> encoders -> **leases released** (``EngineInputs.consumed()``) -> merge at ``is_embed``
-> decode, streaming one chunk per token. Leases are also released on every error, on cancel and
when the client goes away (the generator is closed and its ``finally`` runs).

Timing of each request travels back in trailing metadata ``x-shmt-timing`` (JSON of
``time.perf_counter()`` stamps; on Linux that clock is system-wide CLOCK_MONOTONIC, so the frontend
can subtract its own stamps): ``received``, ``opened`` (leased + verified), ``on_device``,
``encoded``, ``released``.

Other ways in (``ingests``, an extension point): a request with metadata ``x-shmt-ingest: NAME``
(default ``shm``: through the daemon, as above) gets its tensors from
``ingests[NAME](service, request.multimodal, prompt_len)``: a list of ``model.MMItem`` whose tensors
the worker owns (nothing to release), checked against the model and encoded like the shared-memory
ones; a name the worker does not serve is InvalidArgument. The pipeline benchmark's SMG-style peer
(``benchmarks/peers/segment_pread_worker.py``) is one.

``after_open(service, inputs, context)`` (another extension point, optional): called on the
shared-memory path once the request is opened (leased and verified: ``inputs`` is its
``request.EngineInputs``), before its tensors go to the device, with the RPC's context (its metadata,
whether the client is still there). The leases stay held until it returns; an exception it raises
fails the request like any other error, and the leases are released either way. A client that went
away while it ran ends the request there (cancelled). The tests' holding worker
(``tests/holding_worker.py``) is one: it keeps the leases while a crash or a deadline is provoked.
"""
from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Generator, Iterator, Mapping, cast

import grpc
import numpy as np

from ..client import Consumer
from ..error_boundary import ErrorBoundary
from ..errors import InvalidArgument, Unavailable
from ..protocol import sampling as sampling_mod
from ..protocol.capabilities import ServerInfoServicer
from ..protocol.limits import DEFAULT_LIMITS, Limits
from ..protocol.spec import INGEST_KEY, KNOWN_ADAPTERS, TIMING_KEY, grpc_options
from ..socket_lock import claim_socket, unix_socket_path
from ..stop_signal import StopSignal
from ..v1 import features_pb2 as fpb
from ..v1 import generate_pb2 as gpb
from ..v1 import generate_pb2_grpc as gpb_grpc
from . import model as model_mod
from .request import EngineInputs, open_request

if TYPE_CHECKING:
    import numpy.typing as npt
    import torch

_log = logging.getLogger("shmtransport.worker")

_FINISH = {"length": gpb.FINISH_REASON_LENGTH, "stop": gpb.FINISH_REASON_STOP}

# (service, request.multimodal, prompt length) -> the request's items: see ``ingests`` above.
Ingest = Callable[["GeneratorService", fpb.MultimodalRequest, int], "list[model_mod.MMItem]"]
# (service, the opened request, the RPC's context or None) -> None: see ``after_open`` above.
AfterOpen = Callable[["GeneratorService", EngineInputs, "grpc.ServicerContext | None"], None]


def resolve_device(device: str) -> str:
    """The torch device for ``device`` (``auto``: CUDA if available); InvalidArgument for CUDA without it."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidArgument(f"device {device!r} requested but CUDA is not available")
    return device


class _Aborted(Exception):
    """The client cancelled or went away."""


def _cudart() -> Any:
    """torch's binding of the CUDA runtime API (``torch.cuda.cudart()``, unannotated in torch)."""
    import torch

    return cast(Callable[[], Any], torch.cuda.cudart)()


class GeneratorService(ServerInfoServicer):
    """The ``Generator`` servicer: opens a request's tensors through the daemon and runs the tiny model."""

    def __init__(self, daemon_socket: str | None, *, device: str = "auto", verify: str = "always",
                 limits: Limits = DEFAULT_LIMITS, ingests: Mapping[str, Ingest] | None = None,
                 host_register: bool = True, chunk_tokens: int = 1, after_open: AfterOpen | None = None) -> None:
        """``ingests``, ``after_open``: the extension points described in this module's docstring."""
        import torch

        super().__init__(limits, native_generate=True)
        self.limits = limits
        self.verify = verify
        self.device = resolve_device(device)
        self.ingests = dict(ingests or {})
        self.chunk_tokens = max(1, chunk_tokens)
        self.after_open = after_open
        torch.manual_seed(0)
        if self.device.startswith("cuda"):  # CPU / GPU token parity: no TF32 in matmuls or cuDNN's GRU
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        self.model = model_mod.TinyMultimodalModel().to(self.device)
        self.consumer = Consumer(daemon_socket) if daemon_socket else None
        self.host_register = host_register and self.device.startswith("cuda")
        # daemon instance -> (address, nbytes, flags) once registered (None: registration refused)
        self.registered: dict[str, tuple[int, int, int] | None] = {}
        self._registered_view: npt.NDArray[np.uint8] | None = None
        self._register_lock = threading.Lock()
        self.stats = {"requests": 0, "errors": 0, "cancelled": 0}

    # -- device staging -----------------------------------------------------------------------------
    def _register_arena(self) -> None:
        """cudaHostRegister the consumer's arena mapping once (pinned: host->device copies by DMA)."""
        if not self.host_register or self.consumer is None:
            return
        arena, key = self.consumer.arena_view(), self.consumer.instance_id  # one arena per daemon instance
        if arena is None or key in self.registered:
            return
        with self._register_lock:
            if key in self.registered:
                return
            view = np.frombuffer(arena, dtype=np.uint8)
            ptr = view.ctypes.data
            result = None
            cudart = _cudart()
            # 8 = cudaHostRegisterReadOnly: our consumer mapping is PROT_READ, and flags 0 is refused
            # there (invalid argument, seen on an H200); 0 stays as the fallback for writable mappings.
            for flags in ((8, 0) if arena.readonly else (0, 8)):
                try:
                    err = cudart.cudaHostRegister(ptr, arena.nbytes, flags)
                    code = int(err.value) if hasattr(err, "value") else int(err)
                except Exception as exc:  # noqa: BLE001 - registration is an optimisation
                    _log.warning("cudaHostRegister raised %r", exc)
                    code = -1
                if code == 0:
                    result = (ptr, arena.nbytes, flags)
                    break
                _clear_cuda_error()
                _log.info("cudaHostRegister(flags=%d) of the arena of %s failed with %d", flags, key, code)
            self.registered[key] = result  # None = registration refused: pageable copies
            _log.info("cudaHostRegister of the arena of %s: %s", key, result)
            self._registered_view = view  # keep the address valid while registered

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the service's device (on CPU: the same tensor, no copy)."""
        if self.device == "cpu":
            return t  # the zero-copy view of shared memory is the device tensor
        return t.to(self.device, non_blocking=False)

    # -- request -> encoder outputs ---------------------------------------------------------------
    def _open(self, request: gpb.GenerateRequest, context: grpc.ServicerContext | None, timing: dict[str, float]
              ) -> tuple[list[int], model_mod.Sampling, str | None, torch.Tensor, sampling_mod.EngineSampling]:
        """Validated prompt, sampling, adapter and merged inputs_embeds; every lease released."""
        import torch

        prompt = sampling_mod.prompt_token_ids(request)
        engine = sampling_mod.project_sampling(request)
        sampling = model_mod.Sampling.from_engine_kwargs(engine.kwargs)
        if any(t >= self.model.vocab for t in prompt):
            raise InvalidArgument(f"prompt token id out of the vocabulary (< {self.model.vocab})")
        adapter = request.lora_name if request.HasField("lora_name") else None
        if adapter is not None and adapter not in KNOWN_ADAPTERS:
            raise InvalidArgument(f"unknown LoRA adapter {adapter!r}; loaded: {', '.join(KNOWN_ADAPTERS)}")
        mm = request.multimodal
        for batch in mm.batches:
            if batch.adapter and batch.adapter != (adapter or ""):
                raise InvalidArgument(f"features are cached under adapter {batch.adapter!r} but the request runs "
                                      f"adapter {adapter or 'none'!r}")
        metadata = dict(context.invocation_metadata()) if context is not None else {}
        ingest = metadata.get(INGEST_KEY, "shm")
        items: list[model_mod.MMItem] = []
        inputs: EngineInputs | None = None
        try:
            if not mm.batches and not mm.raw_media:
                pass
            elif ingest != "shm":
                if not isinstance(ingest, str) or ingest not in self.ingests:
                    raise InvalidArgument(f"ingest {ingest!r} is not served by this worker")
                items = self.ingests[ingest](self, mm, len(prompt))
            else:
                # Off the CPU the host tensors are only copied to the device (by DMA from the pinned
                # arena): no code gets to write them in place, so they need no private pages.
                inputs = open_request(self.consumer, mm, verify=self.verify, prompt_len=len(prompt),
                                      limits=self.limits, copy_on_write=self.device == "cpu")
                if self.host_register:
                    self._register_arena()
                if self.after_open is not None:
                    self.after_open(self, inputs, context)
                    if context is not None and not context.is_active():
                        raise _Aborted()
                for modality, kw_list in inputs.mm_kwargs.items():
                    for kw, ph in zip(kw_list, inputs.mm_placeholders[modality]):
                        items.append(model_mod.MMItem(modality, dict(kw), ph.offset, ph.length, ph.is_embed))
            timing["opened"] = time.perf_counter()  # leased (or read) + identity verified, still on the host
            for it in items:  # is_embed must count what the encoder will produce: check before running it
                want = model_mod.num_embeds(it.modality, it.kwargs)
                have = int(it.is_embed.sum()) if it.is_embed is not None else it.length
                if want != have:
                    raise InvalidArgument(f"{it.modality} placeholder at {it.offset} marks {have} embed positions "
                                          f"but its tensors give {want} embeddings")
            for it in items:
                it.kwargs = {k: self.to_device(v) for k, v in it.kwargs.items()}
                if it.is_embed is not None:
                    it.is_embed = it.is_embed.to(self.device)
            if self.device.startswith("cuda"):
                torch.cuda.synchronize()
            timing["on_device"] = time.perf_counter()
            with torch.no_grad():
                encoded = [self.model.encode(it) for it in items]
                if self.device.startswith("cuda"):
                    torch.cuda.synchronize()
            timing["encoded"] = time.perf_counter()
        finally:
            for it in items:
                it.kwargs = {}  # drop every view of the leases first, or the release is deferred
            if inputs is not None:
                inputs.consumed()
            timing["released"] = time.perf_counter()
        with torch.no_grad():
            ids = torch.tensor(prompt, dtype=torch.int64, device=self.device)
            embeds = self.model.merge(ids, items, encoded)
        return prompt, sampling, adapter, embeds, engine

    # -- RPCs -----------------------------------------------------------------------------------------
    def _chunks(self, request: gpb.GenerateRequest, context: grpc.ServicerContext | None
                ) -> Generator[gpb.GenerateStreamChunk, None, None]:
        timing = {"received": time.perf_counter()}
        self.stats["requests"] += 1
        try:
            prompt, sampling, adapter, embeds, engine = self._open(request, context, timing)
        finally:
            if context is not None:
                context.set_trailing_metadata(((TIMING_KEY, json.dumps(timing)),))
        want_mask = engine.return_sampling_mask
        first = True
        pending: list[int] = []
        n = 0
        mask_ids: list[int] = []
        mask_offsets: list[int] = [0]
        for tok, finish in self.model.generate(embeds, prompt, sampling, adapter):
            if context is not None and not context.is_active():
                raise _Aborted()
            pending.append(tok)
            n += 1
            if want_mask:
                mask_ids.append(tok)
                mask_offsets.append(len(mask_ids))
            if finish is None and len(pending) < self.chunk_tokens:
                continue
            chunk = gpb.GenerateStreamChunk(index=0, num_tokens=len(pending), token_ids=pending)
            if first:
                chunk.num_prompt_tokens = len(prompt)
                first = False
            if finish is not None:
                chunk.terminal = True
                chunk.finish_reason = _FINISH[finish]
                chunk.num_output_tokens = n
                if finish == "stop":
                    if tok in sampling.stop_token_ids:
                        chunk.matched_stop.stop_token_id = tok
                    else:
                        chunk.matched_stop.eos_token_id = tok
                if want_mask:
                    chunk.sampling_mask.token_ids.extend(mask_ids)
                    chunk.sampling_mask.offsets.extend(mask_offsets)
            yield chunk
            pending = []

    def GenerateStream(self, request: gpb.GenerateRequest, context: grpc.ServicerContext
                       ) -> Iterator[gpb.GenerateStreamChunk]:
        """Generate with the reference model, one chunk per step (counted as cancelled when the
        client goes away)."""
        gen = self._chunks(request, context)
        try:
            for chunk in gen:
                yield chunk
        except _Aborted:
            self.stats["cancelled"] += 1
        except GeneratorExit:  # the client went away: closing ``gen`` runs every finally
            self.stats["cancelled"] += 1
            raise
        except Exception:  # counted; the server's ErrorBoundary answers it
            self.stats["errors"] += 1
            raise
        finally:
            gen.close()

    def Generate(self, request: gpb.GenerateRequest, context: grpc.ServicerContext) -> gpb.GenerateResponse:
        """``GenerateStream``'s chunks folded into one response."""
        try:
            chunks = list(self._chunks(request, context))
        except _Aborted:
            self.stats["cancelled"] += 1
            context.abort(grpc.StatusCode.CANCELLED, "cancelled")
        except Exception:  # counted; the server's ErrorBoundary answers it
            self.stats["errors"] += 1
            raise
        from ..protocol.folding import fold

        return fold(chunks, request_id=request.request_id)

    def close(self) -> None:
        """Unregister host memory pinned for CUDA and close the daemon session."""
        if self.registered:
            for result in self.registered.values():
                if result is not None:
                    _cudart().cudaHostUnregister(result[0])
            self.registered.clear()
            self._registered_view = None
        if self.consumer is not None:
            self.consumer.close()


def _clear_cuda_error() -> None:
    """A failed cudaHostRegister leaves the runtime's "last error" set, and torch's next kernel
    launch check would report it as its own failure: consume it here (a tiny kernel whose launch
    check reads and clears it)."""
    import torch

    getter = getattr(_cudart(), "cudaGetLastError", None)
    try:
        if getter is not None:
            getter()
            return
        (torch.zeros(1, device="cuda") + 1).item()
    except Exception:  # noqa: BLE001 - that was the stale error being consumed
        pass


class WorkerServer:
    """The gRPC server around ``GeneratorService``; ``address`` is ``unix:PATH`` or ``HOST:PORT``."""

    def __init__(self, address: str, daemon_socket: str | None, *, max_workers: int = 4, **options: Any) -> None:
        """``options``: ``GeneratorService``'s keyword arguments.

        A ``unix:PATH`` address is claimed first (``socket_lock.claim_socket``: ``PATH.lock``, held
        until ``stop``): while another live worker serves that path this raises ``SocketInUse``
        and touches nothing of it; a dead worker's socket file left there is replaced."""
        limits: Limits = options.get("limits", DEFAULT_LIMITS)
        self.address = address
        path = unix_socket_path(address)
        self._claim = claim_socket(path, "shmtransport worker") if path is not None else None
        try:
            self.service = GeneratorService(daemon_socket, **options)
        except BaseException:
            self._release_claim()
            raise
        max_message = max(64 << 20, limits.max_inline_bytes + (8 << 20))
        self._server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=max_workers),
                                   options=grpc_options(max_message), interceptors=[ErrorBoundary()])
        gpb_grpc.add_GeneratorServicer_to_server(self.service, self._server)
        self.port = self._server.add_insecure_port(address)
        if self.port == 0:
            self.service.close()
            self._release_claim()
            raise Unavailable(f"worker cannot listen on {address}")

    def _release_claim(self) -> None:
        """Unlink our socket (and its lock file), then drop the lock: only ever our own socket."""
        if self._claim is not None:
            self._claim.release()

    def start(self) -> "WorkerServer":
        """Start serving; returns self."""
        self._server.start()
        return self

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving (in-flight calls get ``grace_s`` seconds), close the service, give up the socket."""
        self._server.stop(grace_s).wait(grace_s + 5)
        self.service.close()
        self._release_claim()

    def serve_until_signalled(self, name: str = "shmtransport worker") -> None:
        """Start, print ``NAME ready: ADDRESS device D pid P`` (what ``WorkerProcess`` waits for),
        serve until SIGTERM or SIGINT, then stop. For a process's main thread (signal handlers)."""
        stop = StopSignal()
        self.start()
        print(f"{name} ready: {self.address} device {self.service.device} pid {os.getpid()}", flush=True)
        try:
            stop.wait()
        finally:
            self.stop()
