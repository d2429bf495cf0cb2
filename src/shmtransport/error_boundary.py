"""The one place where an exception a servicer raises becomes a gRPC status: a server interceptor.

Install ``ErrorBoundary()`` on a ``grpc.server`` (``AioErrorBoundary()`` on a ``grpc.aio.server``)
as the outermost interceptor; it wraps every handler of every service of that server:

- a ``ShmTransportError``: its status code, its message as the details, its reason (and its
  ``field`` / ``limit`` when set) in trailing metadata (``errors.status_for``); the client rebuilds
  the same exception with ``errors.error_from_rpc``;
- ``context.abort(...)`` called by the handler: passes through untouched (the status is set);
- anything else is a bug: logged with its traceback and answered INTERNAL; the server keeps serving.
"""
from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar, cast

import grpc

from .errors import InternalError, ShmTransportError, status_for

_log = logging.getLogger(__name__)

UNEXPECTED_MESSAGE = "internal: unexpected error (see the server's log)"

# (attribute of an RpcMethodHandler, its constructor, whether it answers with a stream)
_KINDS = (
    ("unary_unary", grpc.unary_unary_rpc_method_handler, False),
    ("unary_stream", grpc.unary_stream_rpc_method_handler, True),
    ("stream_unary", grpc.stream_unary_rpc_method_handler, False),
    ("stream_stream", grpc.stream_stream_rpc_method_handler, True),
)
# Handlers are registered once per server, so each (method, handler) is wrapped once (a wrapper
# costs microseconds, per call otherwise); past this many pairs, e.g. a generic handler that makes
# a new one per call, they are wrapped per call.
_MAX_CACHED = 256

_Req = TypeVar("_Req")  # a request message, or an iterator of them (a streaming request)
_Resp = TypeVar("_Resp")
if TYPE_CHECKING:
    from typing import TypeAlias

    _Metadata: TypeAlias = tuple[tuple[str, str | bytes], ...]
    _AioContext: TypeAlias = grpc.aio.ServicerContext[Any, Any]
    _Handler: TypeAlias = grpc.RpcMethodHandler[Any, Any]
    # A handler's behavior (the servicer's method) -> the same behavior behind the boundary.
    _Wrapper: TypeAlias = staticmethod[[Callable[..., Any], str], Callable[..., Any]]


def _status(exc: Exception, context: grpc.ServicerContext | _AioContext,
            method: str) -> tuple[grpc.StatusCode, str, _Metadata]:
    """Code, details and trailing metadata (the handler's own kept) answering ``exc``."""
    if isinstance(exc, ShmTransportError):
        code, details, carried = status_for(exc)
    else:
        _log.exception("unexpected error in %s", method, exc_info=exc)
        code, details, carried = status_for(InternalError(UNEXPECTED_MESSAGE))
    ours = {key for key, _ in carried}
    kept = tuple((k, v) for k, v in (context.trailing_metadata() or ()) if k not in ours)
    return code, details, kept + carried


def _sync_aborted(exc: Exception, context: grpc.ServicerContext) -> bool:
    """grpc's sync ``context.abort`` records the status, then raises a bare ``Exception()`` (a
    handler that sets a code and then raises one itself is taken for an abort too)."""
    # grpc-stubs lacks ServicerContext.code() (grpc has it since 1.38)
    return type(exc) is Exception and not exc.args and context.code() is not None  # type: ignore[attr-defined]


def _sync_abort(exc: Exception, context: grpc.ServicerContext, method: str) -> NoReturn:
    if _sync_aborted(exc, context):
        raise exc
    code, details, metadata = _status(exc, context, method)
    context.set_trailing_metadata(metadata)
    context.abort(code, details)


def _sync_unary(behavior: Callable[[_Req, grpc.ServicerContext], _Resp],
                method: str) -> Callable[[_Req, grpc.ServicerContext], _Resp]:
    def handler(request: _Req, context: grpc.ServicerContext) -> _Resp:
        try:
            return behavior(request, context)
        except Exception as exc:  # noqa: BLE001 - the boundary
            _sync_abort(exc, context, method)

    return handler


def _sync_stream(behavior: Callable[[_Req, grpc.ServicerContext], Iterator[_Resp]],
                 method: str) -> Callable[[_Req, grpc.ServicerContext], Iterator[_Resp]]:
    def handler(request: _Req, context: grpc.ServicerContext) -> Iterator[_Resp]:
        try:
            yield from behavior(request, context)
        except Exception as exc:  # noqa: BLE001 - the boundary
            _sync_abort(exc, context, method)

    return handler


async def _aio_abort(exc: Exception, context: _AioContext, method: str) -> NoReturn:
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    code, details, metadata = _status(exc, context, method)
    await context.abort(code, details, metadata)


def _aio_unary(behavior: Callable[[_Req, _AioContext], Awaitable[_Resp]],
               method: str) -> Callable[[_Req, _AioContext], Awaitable[_Resp]]:
    async def handler(request: _Req, context: _AioContext) -> _Resp:
        try:
            return await behavior(request, context)
        except Exception as exc:  # noqa: BLE001 - the boundary
            await _aio_abort(exc, context, method)

    return handler


def _aio_stream(behavior: Callable[[_Req, _AioContext], AsyncIterator[_Resp] | Awaitable[None]],
                method: str) -> Callable[[_Req, _AioContext], AsyncIterator[_Resp] | Awaitable[None]]:
    if not inspect.isasyncgenfunction(behavior):  # a coroutine that answers with context.write()
        return _aio_unary(cast("Callable[[_Req, _AioContext], Awaitable[None]]", behavior), method)
    stream = cast("Callable[[_Req, _AioContext], AsyncIterator[_Resp]]", behavior)

    async def handler(request: _Req, context: _AioContext) -> AsyncIterator[_Resp]:
        try:
            async for response in stream(request, context):
                yield response
        except Exception as exc:  # noqa: BLE001 - the boundary
            await _aio_abort(exc, context, method)

    return handler


class _Boundary:
    """Wraps each handler the continuation returns (None, an unknown method, stays None)."""

    _unary: _Wrapper = staticmethod(_sync_unary)
    _stream: _Wrapper = staticmethod(_sync_stream)

    def __init__(self) -> None:
        # (method, id(handler)) -> (handler, its wrapper); holding the handler keeps its id unique
        # (a handler need not be hashable: a servicer with __eq__ and no __hash__ makes it not).
        self._wrapped: dict[tuple[str, int], tuple[_Handler, _Handler]] = {}

    def _wrap(self, handler: grpc.RpcMethodHandler[_Req, _Resp] | None,
              method: str) -> grpc.RpcMethodHandler[_Req, _Resp] | None:
        if handler is None:
            return None
        key = (method, id(handler))
        cached = self._wrapped.get(key)
        if cached is not None and cached[0] is handler:
            return cached[1]
        for attr, make, streaming in _KINDS:
            behavior = getattr(handler, attr)
            if getattr(behavior, "experimental_non_blocking", False):
                # It answers through a callback (grpc's health Watch does), holding no thread while
                # open; a wrapper would turn it into a blocking one. Such handlers raise nothing of ours.
                return handler
            if behavior is not None:
                wrap = self._stream if streaming else self._unary
                wrapped = make(wrap(behavior, method), request_deserializer=handler.request_deserializer,
                               response_serializer=handler.response_serializer)
                break
        else:
            return handler
        if len(self._wrapped) < _MAX_CACHED:
            self._wrapped[key] = (handler, wrapped)
        return wrapped


class ErrorBoundary(_Boundary, grpc.ServerInterceptor):
    """The error boundary of a ``grpc.server``: put it first in ``interceptors=[...]``."""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[_Req, _Resp] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[_Req, _Resp] | None:
        """The handler of the call, wrapped so that its errors reach the client as status codes."""
        return self._wrap(continuation(handler_call_details), handler_call_details.method)


class AioErrorBoundary(_Boundary, grpc.aio.ServerInterceptor):
    """The error boundary of a ``grpc.aio.server`` (async handlers)."""

    _unary = staticmethod(_aio_unary)
    _stream = staticmethod(_aio_stream)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[_Req, _Resp] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[_Req, _Resp] | None:
        """The handler of the call, wrapped so that its errors reach the client as status codes."""
        return self._wrap(await continuation(handler_call_details), handler_call_details.method)
