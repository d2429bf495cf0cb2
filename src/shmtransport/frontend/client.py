"""The public client of the ``Generator`` service that ``shmtransport vllm-worker`` and
``shmtransport worker`` serve: prompt token ids plus preprocessed multimodal items in, a stream of
generated tokens out.

``GeneratorClient`` (threads) and ``AsyncGeneratorClient`` (asyncio) send the same request the same
way: each item's tensors go into shared memory through the caller's ``Producer`` with
``frontend.request.build_request`` (one copy per tensor, the item identity's digest fused into it;
tensors already committed to shared memory as ``Handle``s are referenced, not copied), and only the
handles travel in the gRPC message. Without a producer the tensors ride inline in the message,
within ``Limits.max_inline_bytes``.

The producer's references are dropped once the worker answers with its first chunk (it holds
leases on the bytes by then), or when the call fails or is cancelled: a request leaves nothing
behind in the daemon once the worker is done with it.

Failures are typed: what the worker rejects arrives as the ``ShmTransportError`` it raised
(``InvalidArgument`` for a bad request, ``IdentityMismatch``, ...); a worker that is not there or
goes away mid-request is ``WorkerUnavailable``; a deadline is ``DeadlineExceeded``.
"""
from __future__ import annotations

import asyncio
import dataclasses
import uuid
from types import TracebackType
from typing import Any, Iterator, Literal, Mapping, Protocol, Sequence, runtime_checkable

import grpc
import grpc.aio
from google.protobuf.message import Message

from ..aio import AsyncProducer
from ..client import Producer
from ..errors import DeadlineExceeded, InvalidArgument, ShmTransportError, Unavailable, carried_reason, error_from_rpc
from ..identity import DEFAULT_SCHEME
from ..protocol.items import FeatureItem
from ..protocol.limits import DEFAULT_LIMITS, Limits
from ..protocol.spec import grpc_options
from ..v1 import generate_pb2 as gpb
from ..v1 import generate_pb2_grpc as gpb_grpc
from .request import DEFAULT_INLINE, BuiltRequest, InlinePolicy, build_request

__all__ = ["AsyncGeneratorClient", "AsyncTokenStream", "Completion", "FinishReason", "GeneratorClient",
           "RenderedPrompt", "TokenChunk", "TokenStream", "WorkerUnavailable"]

FinishReason = Literal["stop", "length", "abort"]
_FINISH: dict[int, FinishReason] = {gpb.FINISH_REASON_STOP: "stop", gpb.FINISH_REASON_LENGTH: "length",
                                    gpb.FINISH_REASON_ABORTED: "abort"}


class WorkerUnavailable(Unavailable):
    """The worker went away (crashed, killed, not listening) before the request finished."""


@runtime_checkable
class RenderedPrompt(Protocol):
    """What a renderer returns for one request: the prompt's token ids (placeholders expanded) and
    one ``FeatureItem`` per image, video or audio clip (``engine.qwen2_vl.Prompt`` is one)."""

    @property
    def token_ids(self) -> Sequence[int]:
        """The prompt's token ids, each item's placeholder run included."""

    @property
    def features(self) -> Sequence[FeatureItem]:
        """The items, in prompt order."""


@dataclasses.dataclass(frozen=True)
class TokenChunk:
    """The tokens generated since the previous chunk of a stream.

    ``logprobs`` has one entry per token when the request asked for ``logprobs``, and
    ``top_logprobs`` one ``{token id: logprob}`` per token (the sampled token and the top ones);
    ``finish_reason`` is None until the last chunk; ``num_prompt_tokens`` is set on the first."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int | None = None


@dataclasses.dataclass
class Completion:
    """A whole generation: every chunk of a stream joined (``GeneratorClient.generate``)."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    finish_reason: FinishReason
    num_prompt_tokens: int


def _chunk(msg: gpb.GenerateStreamChunk, first: bool) -> TokenChunk:
    top = [dict(zip(t.token_ids, t.logprobs)) for t in msg.top_logprobs]
    finish = _FINISH.get(msg.finish_reason, "stop") if msg.terminal else None
    return TokenChunk(list(msg.token_ids), list(msg.logprobs), top, finish,
                      msg.num_prompt_tokens if first else None)


def _joined(request_id: str, chunks: Sequence[TokenChunk]) -> Completion:
    finish = next((c.finish_reason for c in reversed(chunks) if c.finish_reason), None)
    if finish is None:  # a stream that ended without its terminal chunk did not finish
        raise WorkerUnavailable(f"request {request_id}: the stream ended before the last chunk")
    return Completion(request_id, [t for c in chunks for t in c.token_ids], [v for c in chunks for v in c.logprobs],
                      [t for c in chunks for t in c.top_logprobs], finish,
                      next((c.num_prompt_tokens for c in chunks if c.num_prompt_tokens is not None), 0))


def set_controls(msg: Message, values: Mapping[str, Any] | None) -> None:
    """Set the fields of a ``SamplingControls`` / ``StoppingControls`` / ``ResponseControls`` from
    a mapping of field name -> value (maps updated, repeated fields extended)."""
    for name, value in (values or {}).items():
        field = getattr(msg, name)
        if isinstance(value, dict):
            field.update(value)
        elif isinstance(value, (list, tuple)):
            field.extend(value)
        else:
            setattr(msg, name, value)


def typed_error(err: grpc.RpcError, address: str, timeout_s: float | None) -> ShmTransportError:
    """The ``ShmTransportError`` a failed call to the worker at ``address`` stands for."""
    exc = error_from_rpc(err)
    if isinstance(exc, DeadlineExceeded):
        return DeadlineExceeded(f"worker at {address} did not finish within {timeout_s} s")
    if isinstance(exc, Unavailable) and carried_reason(err) is None:  # the transport's, not the worker's
        return WorkerUnavailable(f"worker at {address} is gone or unreachable "
                                 f"({err.code().name}: {err.details() or ''})")
    return exc


@dataclasses.dataclass(frozen=True)
class _Options:
    """What every request of a client shares."""

    address: str
    timeout_s: float | None
    limits: Limits
    scheme: str
    inline: InlinePolicy


def _prompt(prompt: Sequence[int] | RenderedPrompt,
            items: Sequence[FeatureItem] | None) -> tuple[list[int], list[FeatureItem]]:
    if isinstance(prompt, RenderedPrompt):
        if items is not None:
            raise InvalidArgument("pass items with token ids, not with a rendered prompt (it carries its own)")
        return [int(t) for t in prompt.token_ids], list(prompt.features)
    return [int(t) for t in prompt], list(items or ())


def _build(options: _Options, producer: Producer | None, token_ids: list[int], items: list[FeatureItem],
           controls: dict[str, Any]) -> tuple[gpb.GenerateRequest, BuiltRequest]:
    """The ``GenerateRequest`` with its tensors in shared memory (or inline without a producer)."""
    built = build_request(producer, items, scheme=options.scheme, prompt_len=len(token_ids),
                          mode="shm" if producer is not None else "inline", limits=options.limits,
                          inline=options.inline)
    try:
        request = gpb.GenerateRequest(request_id=controls["request_id"] or f"shmt-{uuid.uuid4().hex}",
                                      multimodal=built.request)
        request.token_ids.ids.extend(token_ids)
        for name, value in (("max_tokens", controls["max_tokens"]), ("ignore_eos", controls["ignore_eos"])):
            if value is not None:
                setattr(request.stopping, name, value)
        for name in ("temperature", "top_p", "top_k", "seed", "logprobs"):
            if controls[name] is not None:
                setattr(request.sampling, name, controls[name])
        if controls["stop_token_ids"]:
            request.stopping.stop_token_ids.extend(controls["stop_token_ids"])
        set_controls(request.sampling, controls["sampling"])
        set_controls(request.stopping, controls["stopping"])
    except BaseException:
        built.release()
        raise
    return request, built


def _channel_options(limits: Limits) -> list[tuple[str, int]]:
    return grpc_options(max(64 << 20, limits.max_inline_bytes + (8 << 20)))


class TokenStream:
    """One request's chunks as they are generated (an iterator of ``TokenChunk``); made by
    ``GeneratorClient.generate_stream``. ``cancel()`` (from any thread) ends it: the worker stops
    generating and iteration stops. Leaving a ``with`` block cancels an unfinished stream."""

    def __init__(self, call: Any, built: BuiltRequest, request_id: str, options: _Options) -> None:
        self.request_id = request_id
        self._call = call
        self._built: BuiltRequest | None = built
        self._options = options
        self._first = True
        self._cancelled = False
        self._finish: FinishReason | None = None

    @property
    def cancelled(self) -> bool:
        """Whether ``cancel()`` ended the stream before its last chunk."""
        return self._cancelled

    @property
    def finish_reason(self) -> FinishReason | None:
        """Why generation stopped, once the last chunk has arrived; None before (and if cancelled)."""
        return self._finish

    def __iter__(self) -> Iterator[TokenChunk]:
        return self

    def __next__(self) -> TokenChunk:
        try:
            msg = next(self._call)
        except StopIteration:
            self._release()
            raise
        except grpc.RpcError as err:
            self._release()
            if self._cancelled:
                raise StopIteration from None
            raise typed_error(err, self._options.address, self._options.timeout_s) from None
        self._release()  # the worker answers only once it holds its own leases on the bytes
        chunk = _chunk(msg, self._first)
        self._first = False
        if chunk.finish_reason is not None:
            self._finish = chunk.finish_reason
        return chunk

    def cancel(self) -> None:
        """Stop the request: the worker aborts it in its engine and iteration ends."""
        if self._finish is None and not self._cancelled:
            self._cancelled = True
            self._call.cancel()
        self._release()

    def close(self) -> None:
        """Cancel the request if it is still running; a finished stream is left as it is."""
        self.cancel()

    def _release(self) -> None:
        built, self._built = self._built, None
        if built is not None:
            built.release()

    def __enter__(self) -> "TokenStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class GeneratorClient:
    """A client of one worker's ``Generator`` service (``shmtransport vllm-worker`` or
    ``shmtransport worker``) at ``address`` (``HOST:PORT`` or ``unix:PATH``). Thread-safe: share one
    per worker. A context manager; ``close()`` closes the gRPC channel, never the producer.

    ``producer``: where tensors go (a ``Producer`` of the daemon the worker reads from); None sends
    them inline in the message. ``timeout_s``: the deadline of each request (None: none).
    ``channel``: an existing gRPC channel to the worker, used instead of opening one (not closed
    by ``close()``). ``limits``, ``scheme``, ``inline``: what ``build_request`` checks against, the
    item identity scheme, and which small tensors ride in the message anyway."""

    def __init__(self, address: str, producer: Producer | None = None, *, timeout_s: float | None = None,
                 channel: grpc.Channel | None = None, limits: Limits = DEFAULT_LIMITS,
                 scheme: str = DEFAULT_SCHEME, inline: InlinePolicy = DEFAULT_INLINE) -> None:
        self.producer = producer
        self._options = _Options(address, timeout_s, limits, scheme, inline)
        self._own_channel = channel is None
        self._channel = channel if channel is not None else grpc.insecure_channel(
            address, options=_channel_options(limits))
        self._stub = gpb_grpc.GeneratorStub(self._channel)

    @property
    def address(self) -> str:
        """The worker's address."""
        return self._options.address

    def generate_stream(self, prompt: Sequence[int] | RenderedPrompt, items: Sequence[FeatureItem] | None = None,
                        *, max_tokens: int | None = None, temperature: float | None = None,
                        top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
                        logprobs: int | None = None, stop_token_ids: Sequence[int] = (),
                        ignore_eos: bool | None = None, sampling: Mapping[str, Any] | None = None,
                        stopping: Mapping[str, Any] | None = None, request_id: str | None = None,
                        metadata: Sequence[tuple[str, str]] | None = None) -> TokenStream:
        """Send a request; its ``TokenStream``. ``prompt``: token ids (placeholders for ``items``
        expanded) with ``items``, or a renderer's prompt that carries both. ``logprobs=k``: the
        sampled token's logprob and the top k per token. ``sampling`` / ``stopping``: any other
        field of ``SamplingControls`` / ``StoppingControls`` by name. Unset controls are the
        worker's defaults (vLLM's). An item the request cannot carry raises here, typed."""
        token_ids, features = _prompt(prompt, items)
        request, built = _build(self._options, self.producer, token_ids, features, dict(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, logprobs=logprobs,
            stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, sampling=sampling, stopping=stopping,
            request_id=request_id))
        try:
            call = self._stub.GenerateStream(request, timeout=self._options.timeout_s, metadata=metadata)
        except BaseException:
            built.release()
            raise
        return TokenStream(call, built, request.request_id, self._options)

    def generate(self, prompt: Sequence[int] | RenderedPrompt, items: Sequence[FeatureItem] | None = None,
                 **controls: Any) -> Completion:
        """``generate_stream`` run to its end and joined; the same arguments."""
        with self.generate_stream(prompt, items, **controls) as stream:
            return _joined(stream.request_id, list(stream))

    def server_info(self) -> gpb.ServerInfo:
        """What the worker serves: identity schemes, limits, its shared-memory namespace."""
        try:
            info: gpb.ServerInfo = self._stub.GetServerInfo(gpb.ServerInfoRequest(), timeout=self._options.timeout_s)
        except grpc.RpcError as err:
            raise typed_error(err, self.address, self._options.timeout_s) from None
        return info

    def close(self) -> None:
        """Close the channel (if this client opened it); streams in flight are cancelled."""
        if self._own_channel:
            self._channel.close()

    def __enter__(self) -> "GeneratorClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncTokenStream:
    """``TokenStream`` for asyncio (an async iterator of ``TokenChunk``); made by
    ``AsyncGeneratorClient.generate_stream``. The request is sent when iteration starts.
    Cancelling the task that iterates cancels the request, as do ``cancel()`` and leaving an
    ``async with`` block before the last chunk."""

    def __init__(self, client: "AsyncGeneratorClient", token_ids: list[int], items: list[FeatureItem],
                 controls: dict[str, Any], metadata: Sequence[tuple[str, str]] | None) -> None:
        self._client = client
        self._args: tuple[list[int], list[FeatureItem], dict[str, Any]] | None = (token_ids, items, controls)
        self._metadata = metadata
        self._call: Any = None
        self._built: BuiltRequest | None = None
        self.request_id: str = controls["request_id"] or f"shmt-{uuid.uuid4().hex}"
        controls["request_id"] = self.request_id
        self._first = True
        self._cancelled = False
        self._finish: FinishReason | None = None

    @property
    def cancelled(self) -> bool:
        """Whether the stream was cancelled before its last chunk."""
        return self._cancelled

    @property
    def finish_reason(self) -> FinishReason | None:
        """Why generation stopped, once the last chunk has arrived; None before (and if cancelled)."""
        return self._finish

    def __aiter__(self) -> "AsyncTokenStream":
        return self

    async def __anext__(self) -> TokenChunk:
        if self._cancelled or (self._args is None and self._call is None):  # cancelled, or it failed to start
            raise StopAsyncIteration
        try:
            if self._args is not None:
                await self._start()
            msg = await self._call.read()
        except asyncio.CancelledError:
            self.cancel()
            raise
        except grpc.RpcError as err:
            self._release()
            if self._cancelled:
                raise StopAsyncIteration from None
            raise typed_error(err, self._client.address, self._client._options.timeout_s) from None
        except BaseException:
            self._release()
            raise
        self._release()  # the worker answers only once it holds its own leases on the bytes
        if msg is grpc.aio.EOF:
            raise StopAsyncIteration
        chunk = _chunk(msg, self._first)
        self._first = False
        if chunk.finish_reason is not None:
            self._finish = chunk.finish_reason
        return chunk

    async def _start(self) -> None:
        assert self._args is not None
        token_ids, items, controls = self._args
        self._args = None
        request, self._built = await self._client._build(token_ids, items, controls)
        self._call = self._client._stub.GenerateStream(request, timeout=self._client._options.timeout_s,
                                                       metadata=self._metadata)

    def cancel(self) -> None:
        """Stop the request (or never send it): the worker aborts it and iteration ends."""
        if self._finish is None and not self._cancelled:
            self._cancelled = True
            self._args = None
            if self._call is not None:
                self._call.cancel()
        self._release()

    async def aclose(self) -> None:
        """Cancel the request if it is still running; a finished stream is left as it is."""
        self.cancel()

    def _release(self) -> None:
        built, self._built = self._built, None
        if built is not None:
            built.release()  # a release through the object table or one short RPC: not worth a thread

    async def __aenter__(self) -> "AsyncTokenStream":
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.cancel()


class AsyncGeneratorClient:
    """``GeneratorClient`` for asyncio, over ``grpc.aio``; the same arguments. ``producer`` may be
    an ``AsyncProducer`` (its worker threads copy the tensors) or a ``Producer`` (copied in the
    default executor): the event loop never waits on a copy. Belongs to one event loop; an async
    context manager."""

    def __init__(self, address: str, producer: AsyncProducer | Producer | None = None, *,
                 timeout_s: float | None = None, channel: grpc.aio.Channel | None = None,
                 limits: Limits = DEFAULT_LIMITS, scheme: str = DEFAULT_SCHEME,
                 inline: InlinePolicy = DEFAULT_INLINE) -> None:
        self.producer = producer
        self._options = _Options(address, timeout_s, limits, scheme, inline)
        self._own_channel = channel is None
        self._channel = channel if channel is not None else grpc.aio.insecure_channel(
            address, options=_channel_options(limits))
        self._stub = gpb_grpc.GeneratorStub(self._channel)

    @property
    def address(self) -> str:
        """The worker's address."""
        return self._options.address

    def generate_stream(self, prompt: Sequence[int] | RenderedPrompt, items: Sequence[FeatureItem] | None = None,
                        *, max_tokens: int | None = None, temperature: float | None = None,
                        top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
                        logprobs: int | None = None, stop_token_ids: Sequence[int] = (),
                        ignore_eos: bool | None = None, sampling: Mapping[str, Any] | None = None,
                        stopping: Mapping[str, Any] | None = None, request_id: str | None = None,
                        metadata: Sequence[tuple[str, str]] | None = None) -> AsyncTokenStream:
        """``GeneratorClient.generate_stream`` for asyncio: ``async for chunk in
        client.generate_stream(...)``. The request is built and sent at the first iteration (an
        item it cannot carry raises there)."""
        token_ids, features = _prompt(prompt, items)
        return AsyncTokenStream(self, token_ids, features, dict(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, logprobs=logprobs,
            stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, sampling=sampling, stopping=stopping,
            request_id=request_id), metadata)

    async def generate(self, prompt: Sequence[int] | RenderedPrompt, items: Sequence[FeatureItem] | None = None,
                       **controls: Any) -> Completion:
        """``generate_stream`` run to its end and joined; the same arguments."""
        async with self.generate_stream(prompt, items, **controls) as stream:
            return _joined(stream.request_id, [chunk async for chunk in stream])

    async def server_info(self) -> gpb.ServerInfo:
        """What the worker serves: identity schemes, limits, its shared-memory namespace."""
        try:
            info: gpb.ServerInfo = await self._stub.GetServerInfo(gpb.ServerInfoRequest(),
                                                                  timeout=self._options.timeout_s)
        except grpc.RpcError as err:
            raise typed_error(err, self.address, self._options.timeout_s) from None
        return info

    async def _build(self, token_ids: list[int], items: list[FeatureItem],
                     controls: dict[str, Any]) -> tuple[gpb.GenerateRequest, BuiltRequest]:
        """``_build`` off the event loop; a request built after its task was cancelled is released."""
        producer = self.producer
        if isinstance(producer, AsyncProducer):
            return await producer._run(lambda sync: _build(self._options, sync, token_ids, items, controls),
                                       undo=lambda done: done[1].release())
        job = asyncio.get_running_loop().run_in_executor(
            None, lambda: _build(self._options, producer, token_ids, items, controls))
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            job.add_done_callback(lambda f: None if f.cancelled() or f.exception() else f.result()[1].release())
            raise

    async def close(self) -> None:
        """Close the channel (if this client opened it); streams in flight are cancelled."""
        if self._own_channel:
            await self._channel.close()

    async def __aenter__(self) -> "AsyncGeneratorClient":
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()
