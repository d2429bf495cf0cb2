"""``shmtransport epd-proxy``: one OpenAI endpoint in front of encoder-only vLLM servers
(``ec_producer``) and a language-model server (``ec_consumer`` or ``ec_both``), as vLLM's EPD
examples do.

A chat request with media goes to an encoder first (the whole request, ``max_tokens`` 1: vLLM's
encoder-only server encodes every item, our connector publishes each output, and it answers with
no tokens), then unchanged to the language model, whose scheduler finds every item in the index
and loads it instead of encoding. The answer (streamed or not) is the language model's, passed
through as it comes. Text-only requests go straight to the language model.

The encoder's step is an optimisation, never a condition: when it fails (down, overloaded, an
item it refuses), the language model still gets the request with its media and encodes what the
index does not have, so a request fails only where the language model itself fails it.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import sys
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, web

_log = logging.getLogger("shmtransport.epd_proxy")
_DESCRIPTION = ("One OpenAI endpoint in front of encoder-only vLLM servers and a language-model server: a request "
                "with media goes to an encoder first, then to the language model, which loads what the encoder "
                "published instead of encoding it.")
MEDIA_PARTS = frozenset({"image_url", "video_url", "audio_url", "input_audio", "image_pil", "image_embeds"})
_HOP_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "content-encoding"})


def has_media(body: dict[str, Any]) -> bool:
    """Whether a chat request carries a media part the encoder would encode."""
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in MEDIA_PARTS for p in content):
            return True
    return False


def encoder_request(body: dict[str, Any]) -> dict[str, Any]:
    """The encoder's copy of a chat request: every item, one token at most, no stream."""
    request = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens", "n")}
    request["max_tokens"] = 1
    return request


class EPDProxy:
    """The proxy's routes over one client session (``app``: the aiohttp application)."""

    def __init__(self, encoders: list[str], llm: str, timeout_s: float = 600.0) -> None:
        if not encoders:
            raise ValueError("at least one encoder URL is needed")
        self._encoders = itertools.cycle([url.rstrip("/") for url in encoders])
        self._llm = llm.rstrip("/")
        self._timeout = ClientTimeout(total=timeout_s, sock_connect=10.0)
        self._session: ClientSession | None = None
        self.encoder_failures = 0
        self.app = web.Application()
        self.app.router.add_post("/v1/chat/completions", self._chat)
        self.app.router.add_get("/v1/models", self._passthrough)
        self.app.router.add_get("/health", self._health)
        self.app.on_startup.append(self._open)
        self.app.on_cleanup.append(self._close)

    async def _open(self, _app: web.Application) -> None:
        self._session = ClientSession(timeout=self._timeout)

    async def _close(self, _app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    def _client(self) -> ClientSession:
        assert self._session is not None  # (opened at startup)
        return self._session

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            return web.json_response({"error": {"message": "the request body is not JSON", "type": "BadRequest"}},
                                     status=400)
        if isinstance(body, dict) and has_media(body):
            await self._encode(body)
        return await self._forward(request, "/v1/chat/completions", raw)

    async def _encode(self, body: dict[str, Any]) -> None:
        url = f"{next(self._encoders)}/v1/chat/completions"
        try:
            async with self._client().post(url, json=encoder_request(body)) as reply:
                if reply.status == 200:
                    await reply.read()
                    return
                detail = (await reply.text())[:300]
        except (OSError, ClientError, asyncio.TimeoutError) as exc:  # ClientError: it died mid-reply
            detail = repr(exc)
        self.encoder_failures += 1
        _log.warning("encoder %s failed (%s): the language model encodes what the cache lacks", url, detail)

    async def _forward(self, request: web.Request, path: str, raw: bytes) -> web.StreamResponse:
        headers = {"Content-Type": "application/json"}
        if "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        async with self._client().post(f"{self._llm}{path}", data=raw, headers=headers) as reply:
            response = web.StreamResponse(status=reply.status, headers={
                k: v for k, v in reply.headers.items() if k.lower() not in _HOP_HEADERS})
            await response.prepare(request)
            async for chunk in reply.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def _passthrough(self, request: web.Request) -> web.Response:
        async with self._client().get(f"{self._llm}{request.path}") as reply:
            return web.Response(status=reply.status, body=await reply.read(), content_type=reply.content_type)

    async def _health(self, _request: web.Request) -> web.Response:
        try:
            async with self._client().get(f"{self._llm}/health") as reply:
                return web.Response(status=200 if reply.status == 200 else 503)
        except (OSError, asyncio.TimeoutError):
            return web.Response(status=503)


def build_parser() -> argparse.ArgumentParser:
    """The ``shmtransport epd-proxy`` options."""
    parser = argparse.ArgumentParser(prog="shmtransport epd-proxy", description=_DESCRIPTION)
    parser.add_argument("--encoder", action="append", required=True, metavar="URL",
                        help="an encoder-only vLLM server (ec_producer), e.g. http://127.0.0.1:8001 (repeatable: "
                             "requests go to each in turn)")
    parser.add_argument("--llm", required=True, metavar="URL", help="the language-model vLLM server (ec_consumer or "
                                                                    "ec_both)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="longest a request may take end to end")
    return parser


def main(argv: list[str]) -> int:
    """Serve until SIGINT/SIGTERM."""
    args = build_parser().parse_args(argv)
    if not 0 <= args.port <= 65535:
        print(f"shmtransport epd-proxy: --port must be 0 to 65535, got {args.port}", file=sys.stderr)
        return 2
    proxy = EPDProxy(args.encoder, args.llm, args.timeout_s)
    ready = f"shmtransport epd-proxy ready: http://{args.host}:{args.port} (encoders {', '.join(args.encoder)}; " \
            f"language model {args.llm})"
    web.run_app(proxy.app, host=args.host, port=args.port, print=lambda _: print(ready, flush=True),
                handle_signals=True, access_log=None)
    return 0
