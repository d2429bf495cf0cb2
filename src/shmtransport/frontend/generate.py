"""Frontend side of the pipeline: rendered items -> ``GenerateRequest`` (handles, placeholders,
identities, sampling / stopping controls) -> the worker's ``Generator`` over gRPC.

Tensors go into shared memory through ``protocol.frontend.build_request`` (one ``put_many``: one
copy per tensor with the XXH3-128 digest fused in) or are already there (a committed loan the
renderer wrote in place, e.g. the video patches: referenced by handle, not copied). ``mode="inline"``
sends the same tensors as bytes inside ``TensorData.inline`` (the comparison path).

The producer's references are dropped as soon as the worker has answered with its first chunk
(the worker's Acquire has committed and leased the objects by then), or when the call fails or is
cancelled; the daemon frees the bytes when the worker releases its leases.

Errors are typed: whatever the worker rejects arrives as the ``ShmTransportError`` subclass it
raised (``InvalidArgument``, ``IdentityMismatch``, ...); a worker that dies or disappears mid-request
is ``WorkerUnavailable``; a deadline is ``DeadlineExceeded``.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
from typing import Any, Sequence, cast

import grpc
import numpy as np

from ..client import Handle, Loan, Producer
from ..errors import (
    InvalidArgument,
    ShmTransportError,
)
from ..identity import DEFAULT_SCHEME, identity_scheme
from ..protocol.folding import fold
from ..protocol.items import FeatureItem
from ..protocol.limits import DEFAULT_LIMITS, Limits
from ..protocol.spec import TIMING_KEY, grpc_options
from ..v1 import generate_pb2 as gpb
from ..v1 import generate_pb2_grpc as gpb_grpc
from .client import WorkerUnavailable, set_controls, typed_error
from .prompt import expand_prompt
from .request import DEFAULT_INLINE, BuiltRequest, InlinePolicy, build_request

__all__ = ["Item", "Outcome", "Prepared", "Frontend", "WorkerUnavailable"]

_ids = itertools.count()


@dataclasses.dataclass
class Item:
    """One rendered item: ``kwargs`` are numpy arrays, loans the renderer wrote in place (committed
    by ``Frontend.build`` with the digest computed from shared memory) or committed ``Handle``s;
    ``owned``: such handles, released by the frontend with the request."""

    modality: str
    kwargs: dict[str, Any]
    owned: list[Handle] = dataclasses.field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes of all the item's tensors, wherever they live."""
        return sum(_nbytes(v) for v in self.kwargs.values())

    @property
    def in_place(self) -> int:
        """Bytes of the tensors already in shared memory (loans and handles): sent without a copy."""
        return sum(_nbytes(v) for v in self.kwargs.values() if isinstance(v, (Handle, Loan)))


def _nbytes(v: Any) -> int:
    if isinstance(v, Loan):
        return v.handle.nbytes
    return v.nbytes if isinstance(v, Handle) else np.asarray(v).nbytes


@dataclasses.dataclass
class Prepared:
    """A built request not yet sent, with what its building cost (bytes in shm and inline, host copies)."""

    request: gpb.GenerateRequest
    built: BuiltRequest
    owned: list[Handle]
    mode: str
    t_start: float
    shm_bytes: int
    inline_bytes: int
    host_copies: int  # full host copies of tensors (shm: one put each; inline: tobytes, serialize, parse)
    copied_bytes: int = 0  # bytes those copies moved (tensors written in place by the renderer: 0)


@dataclasses.dataclass
class Outcome:
    """What a request got back, with its timings (``perf_counter`` seconds) and transport costs."""

    request_id: str
    token_ids: list[int]
    finish_reason: int
    num_prompt_tokens: int
    timing: dict[str, float]  # the worker's perf_counter stamps (received, on_device, encoded, released)
    t_start: float
    t_first: float | None
    t_end: float
    mode: str
    shm_bytes: int
    inline_bytes: int
    host_copies: int
    identities: list[str]
    cancelled: bool = False
    copied_bytes: int = 0

    @property
    def latency_s(self) -> float:
        """Seconds from the start of building to the last chunk."""
        return self.t_end - self.t_start

    @property
    def handoff_s(self) -> float | None:
        """Frontend done rendering -> the worker has the tensors on its device (verified)."""
        return self.timing["on_device"] - self.t_start if "on_device" in self.timing else None


class Frontend:
    """A client of one worker's ``Generator`` over gRPC; its tensors go through ``producer`` (None:
    inline only). A context manager."""

    def __init__(self, address: str, producer: Producer | None = None, *, timeout_s: float = 60.0,
                 limits: Limits = DEFAULT_LIMITS, scheme: str = DEFAULT_SCHEME, inline: InlinePolicy = DEFAULT_INLINE):
        self.address = address
        self.producer = producer
        self.timeout_s = timeout_s
        self.limits = limits
        self.scheme = scheme
        self.inline = inline  # which small tensors of a shared-memory request ride in the message
        max_message = max(64 << 20, limits.max_inline_bytes + (8 << 20))
        self._channel = grpc.insecure_channel(address, options=grpc_options(max_message))
        self.stub = gpb_grpc.GeneratorStub(self._channel)

    def close(self) -> None:
        """Close the gRPC channel."""
        self._channel.close()

    def __enter__(self) -> "Frontend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def server_info(self) -> gpb.ServerInfo:
        """The worker's ``ServerInfo``; its errors raised as typed ``ShmTransportError``s."""
        try:
            info: gpb.ServerInfo = self.stub.GetServerInfo(gpb.ServerInfoRequest(), timeout=self.timeout_s)
            return info
        except grpc.RpcError as err:
            raise self._typed(err) from None

    # -- build --------------------------------------------------------------------------------------
    def build(self, items: Sequence[Item], text: str = "describe this", *, mode: str = "shm",
              adapter: str | None = None, sampling: dict[str, Any] | None = None,
              stopping: dict[str, Any] | None = None, request_id: str | None = None,
              t_start: float | None = None) -> Prepared:
        """Turn ``items`` and ``text`` into a request, tensors in shared memory (``mode="shm"``) or
        inline; on failure the handles it owned are released."""
        t_start = time.perf_counter() if t_start is None else t_start
        items = self._commit_loans(items, mode)
        owned = [h for it in items for h in it.owned]
        try:
            prompt = expand_prompt(text, [(it.modality, it.kwargs) for it in items])
            features = [FeatureItem(it.modality, it.kwargs, ph) for it, ph in zip(items, prompt.placeholders)]
            built = build_request(self.producer if mode == "shm" else None, features, scheme=self.scheme,
                                  adapter=adapter, prompt_len=len(prompt.token_ids), mode=mode, limits=self.limits,
                                  inline=self.inline)
        except BaseException:
            if owned and self.producer is not None:
                self.producer.release(owned)
            raise
        req = gpb.GenerateRequest(request_id=request_id or f"req-{os.getpid()}-{next(_ids)}",
                                  multimodal=built.request)
        req.token_ids.ids.extend(prompt.token_ids)
        set_controls(req.sampling, sampling)
        set_controls(req.stopping, stopping)
        if adapter:
            req.lora_name = adapter
        total = sum(it.nbytes for it in items)
        n_tensors = sum(len(it.kwargs) for it in items)
        if mode == "shm":  # one put per tensor not written in place; small ones ride inline
            n_inline = sum(td.tensor.HasField("inline") for b in built.request.batches for it in b.items
                           for td in it.kwargs.values())
            copies = n_tensors - sum(len(it.owned) for it in items) + 2 * n_inline
            shm_bytes, inline_bytes = total - built.inline_nbytes, built.inline_nbytes
            copied = total - sum(it.in_place for it in items) + 2 * built.inline_nbytes
        else:  # tobytes + serialize + the worker's parse
            copies, shm_bytes, inline_bytes, copied = 3 * n_tensors, 0, total, 3 * total
        return Prepared(req, built, owned, mode, t_start, shm_bytes, inline_bytes, copies, copied)

    def _commit_loans(self, items: Sequence[Item], mode: str) -> list[Item]:
        """Commit the loans the renderer wrote in place (digest from shared memory, no RPC: commit by
        handoff); on failure every loan and handle of the request is given back."""
        loans = [v for it in items for v in it.kwargs.values() if isinstance(v, Loan)]
        if not loans:
            return list(items)
        try:
            if mode != "shm" or self.producer is None:
                raise InvalidArgument("loaned tensors go through mode='shm' with a Producer")
            handles = iter(self.producer.commit_many(loans, digest=identity_scheme(self.scheme).uses_fused_digest))
        except BaseException:
            for loan in loans:
                loan.release()
            owned = [h for it in items for h in it.owned]
            if owned and self.producer is not None:
                self.producer.release(owned)
            raise
        for loan in loans:
            loan._detach_views()  # the producer keeps its reference through the handle (as put_many does)
        out = []
        for it in items:
            kw, new = {}, []
            for k, v in it.kwargs.items():
                if isinstance(v, Loan):
                    v = next(handles)
                    new.append(v)
                kw[k] = v
            out.append(Item(it.modality, kw, owned=list(it.owned) + new))
        return out

    def _release(self, prepared: Prepared) -> None:
        prepared.built.release()
        if prepared.owned and self.producer is not None:
            owned, prepared.owned = prepared.owned, []
            self.producer.release(owned)

    # -- send ---------------------------------------------------------------------------------------
    def send(self, prepared: Prepared, *, stream: bool = True, cancel_after: int | None = None,
             metadata: Sequence[tuple[str, str]] | None = None) -> Outcome:
        """Run the request; ``cancel_after=k`` cancels the stream after k chunks (Outcome.cancelled)."""
        req = prepared.request
        t_first = None
        chunks: list[gpb.GenerateStreamChunk] = []
        cancelled = False
        timing: dict[str, float] = {}
        try:
            if stream:
                call = self.stub.GenerateStream(req, timeout=self.timeout_s, metadata=metadata)
                try:
                    for chunk in call:
                        if t_first is None:
                            t_first = time.perf_counter()
                            self._release(prepared)
                        chunks.append(chunk)
                        if cancel_after is not None and len(chunks) >= cancel_after:
                            call.cancel()
                            cancelled = True
                            break
                except grpc.RpcError as err:
                    if not cancelled:
                        raise self._typed(err) from None
                timing = _timing(call)
                response = None if cancelled else fold(chunks, request_id=req.request_id)
            else:
                response, call = self.stub.Generate.with_call(req, timeout=self.timeout_s, metadata=metadata)
                t_first = time.perf_counter()
                timing = _timing(call)
        except grpc.RpcError as err:
            raise self._typed(err) from None
        finally:
            self._release(prepared)
        t_end = time.perf_counter()
        identities = [it.mm_hash for b in req.multimodal.batches for it in b.items]
        tokens = [t for c in chunks for t in c.token_ids] if response is None else list(response.token_ids)
        return Outcome(req.request_id, tokens, response.finish_reason if response else gpb.FINISH_REASON_ABORTED,
                       response.num_prompt_tokens if response else 0, timing, prepared.t_start, t_first, t_end,
                       prepared.mode, prepared.shm_bytes, prepared.inline_bytes, prepared.host_copies, identities,
                       cancelled, prepared.copied_bytes)

    def generate(self, items: Sequence[Item], text: str = "describe this", *, stream: bool = True,
                 cancel_after: int | None = None, metadata: Sequence[tuple[str, str]] | None = None,
                 **build_options: Any) -> Outcome:
        """``build`` then ``send``: run one request and return its outcome."""
        return self.send(self.build(items, text, **build_options), stream=stream, cancel_after=cancel_after,
                         metadata=metadata)

    def _typed(self, err: grpc.RpcError) -> ShmTransportError:
        return typed_error(err, self.address, self.timeout_s)


def _timing(call: grpc.Call) -> dict[str, float]:
    try:
        for key, value in call.trailing_metadata() or ():
            if key == TIMING_KEY:
                return cast("dict[str, float]", json.loads(value))  # the worker's {stage: seconds}
    except Exception:  # noqa: BLE001 - timing is informational
        pass
    return {}
