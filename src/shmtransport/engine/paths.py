"""The three ways a rendered request reaches vLLM's engine, side by side (tests, demo, benchmark).

- ``stock``: our request -> SMG bridge -> vLLM's stock gRPC server (``VllmEngineServicer``). With
  ``shm=True`` each tensor is a ``ShmHandle`` of its own daemon-owned segment (the stock reader
  preads, copies into a bytearray, and unlinks each file); else the bytes ride inline in the message.
- ``ours``: our request (handles into the daemon's arena) -> ``shmtransport vllm-worker``, whose
  handles ride through vLLM's engine to the process where the model runs.
- ``vllm-*``: the same request to a ``vllm-worker`` that gives vLLM the views and lets one of
  vLLM's own ways carry the bytes (``WORKER_FLAGS``).
- the offline engine (``vllm.LLM``) given the same tensors, in the tests.

Host copies of tensor bytes between the renderer's output and the engine's input (the API process's
``mm_input``), by path, counting our side and the server's (vLLM's own process hops come after this
point; ``copies_to_model`` adds them):

- ours (shm): 1: ``put`` into the arena, digest fused (0 for a tensor rendered into a loan)
- stock, shm: 5: into the request inline (1), the bridge's copy out of the request (1), ``put`` into
  a dedicated segment (1), the server's ``pread`` (1) and ``bytearray`` (1); +1 cast for float tensors
- stock, inline: 4: serialise (1), the bridge's copy (1), the server's parse (1) and ``bytearray``
  (1); +1 cast for float tensors
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import time
from typing import Sequence

import grpc

from ..client import Consumer, Producer
from ..errors import InvalidArgument
from ..frontend.client import GeneratorClient
from ..frontend.request import BuiltRequest, build_request
from ..protocol.items import FeatureItem
from ..protocol.limits import DEFAULT_LIMITS
from ..v1 import generate_pb2 as gpb

_ids = itertools.count()
# the stock path's request is built inline first (the bridge's input); the stock server itself
# accepts messages of any size, so the inline cap is not the stock path's limit
_BRIDGE_LIMITS = dataclasses.replace(DEFAULT_LIMITS, max_inline_bytes=1 << 31)
PATHS = ("ours", "stock-shm", "stock-inline")
# vLLM's in-tree ways to the model, each a vllm-worker given the same views (our request, our client)
VLLM_PATHS = ("vllm-direct", "vllm-shm-cache", "vllm-torch-shm")
WORKER_FLAGS = {
    "ours": (),  # handles all the way to the model
    "vllm-direct": ("--model-inputs", "views"),  # vLLM's default: MessagePack over ZMQ
    "vllm-shm-cache": ("--model-inputs", "views", "--mm-processor-cache-type", "shm"),  # inject_into_mm_cache
    "vllm-torch-shm": ("--model-inputs", "views", "--mm-tensor-ipc", "torch_shm"),
}
WORKER_ENV = {"vllm-torch-shm": {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}}  # torch_shm refuses fork
# host copies of the tensor bytes before the engine's input (see the module docstring)
HOST_COPIES = {"ours": 1, "stock-shm": 5, "stock-inline": 4, "vllm-direct": 1, "vllm-shm-cache": 1,
               "vllm-torch-shm": 1}
RING_CHUNK_NBYTES = 16 << 20  # VLLM_MQ_MAX_CHUNK_BYTES_MB: larger steps go over ZMQ to each rank


def copies_to_model(path: str, tp: int, nbytes: int, *, worker_process: bool = True) -> int:
    """Host copies of a request's tensor bytes from the renderer's output to the model's input,
    by construction (``HOST_COPIES`` plus vLLM's hops; a batching copy of several items, the same
    on every path, not counted). ``worker_process``: the model runs in a process of its own even at
    TP=1 (vLLM's CPU backend), behind the EngineCore's broadcast ring.

    - ours: the handles cross vLLM's hops; each rank maps the bytes.
    - vllm-shm-cache: P0 copies the item into vLLM's ring, each rank decodes a copy out of it.
    - vllm-torch-shm: P0 moves the tensor into torch shared memory (a copy) instead of the ZMQ
      frames (a kernel copy in, one out); the rest as vLLM's default.
    - every other path: ZMQ to the EngineCore (2), then into the broadcast ring and out in each rank
      (1 + tp), or over ZMQ to each rank above the ring's chunk size (2 per rank)."""
    before = HOST_COPIES[path]
    if path == "ours":
        return before
    if path == "vllm-shm-cache":
        return before + 1 + tp
    hop1 = 1 if path == "vllm-torch-shm" else 2
    if not worker_process and tp == 1:
        return before + hop1
    hop2 = 1 + tp if nbytes < RING_CHUNK_NBYTES else 2 * tp
    return before + hop1 + hop2


@dataclasses.dataclass
class Completion:
    """What one path produced for a request: tokens, logprobs, and timings in seconds."""

    token_ids: list[int]
    logprobs: list[float]
    first_token_s: float  # request built and sent -> first token back
    total_s: float


def _request(token_ids: Sequence[int], built: BuiltRequest, max_tokens: int,
             logprobs: int | None) -> gpb.GenerateRequest:
    req = gpb.GenerateRequest(request_id=f"shmt-{os.getpid()}-{next(_ids)}", multimodal=built.request)
    req.token_ids.ids.extend(token_ids)
    req.sampling.temperature = 0.0
    req.stopping.max_tokens = max_tokens
    req.stopping.ignore_eos = True  # every path generates the same number of tokens
    if logprobs is not None:
        req.sampling.logprobs = logprobs
    return req


def send_ours(client: GeneratorClient, token_ids: Sequence[int], features: Sequence[FeatureItem], *,
              max_tokens: int = 8, logprobs: int | None = 1) -> Completion:
    """``shmtransport vllm-worker`` through the public client: tensors into the arena (one copy,
    digest fused), handles on the wire; the same controls as the stock path's ``_request``."""
    t0 = time.perf_counter()
    first = None
    tokens: list[int] = []
    values: list[float] = []
    with client.generate_stream(token_ids, features, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                logprobs=logprobs) as stream:
        for chunk in stream:
            first = first or time.perf_counter()
            tokens += chunk.token_ids
            values += chunk.logprobs
    return Completion(tokens, values, (first or time.perf_counter()) - t0, time.perf_counter() - t0)


def send_stock(channel: grpc.Channel, producer: Producer | None, consumer: Consumer | None, token_ids: Sequence[int],
               features: Sequence[FeatureItem], *, shm: bool, max_tokens: int = 8, logprobs: int | None = 1,
               timeout_s: float = 300.0) -> Completion:
    """vLLM's stock server through the SMG bridge; blake3 identities (SMG's ``mm_hashes``)."""
    from smg_grpc_proto import vllm_engine_pb2_grpc

    from ..bridges.smg import to_smg, to_smg_shm

    stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    t0 = time.perf_counter()
    built = build_request(None, features, scheme="blake3", prompt_len=len(token_ids), mode="inline",
                          limits=_BRIDGE_LIMITS)
    req = _request(token_ids, built, max_tokens, logprobs)
    smg = None
    if shm:
        if producer is None:
            raise InvalidArgument("send_stock(shm=True) needs a Producer: each tensor goes into its own segment")
        smg = to_smg_shm(req, consumer, producer, limits=_BRIDGE_LIMITS)
    try:
        msg = smg.request if smg is not None else to_smg(req, consumer, limits=_BRIDGE_LIMITS)
        msg.stream = True
        first = None
        tokens: list[int] = []
        values: list[float] = []
        for out in stub.Generate(msg, timeout=timeout_s):
            part = out.chunk if out.HasField("chunk") else None
            if part is None:
                continue
            first = first or time.perf_counter()
            tokens += part.token_ids
            values += part.output_logprobs.token_logprobs
    finally:
        if smg is not None:
            smg.release()
    return Completion(tokens, values, (first or time.perf_counter()) - t0, time.perf_counter() - t0)
