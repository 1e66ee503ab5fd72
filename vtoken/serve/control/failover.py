"""Failover in Serve's HTTP proxy: a request whose replica dies is retried, or answered with a clear 503.

Without this, a replica that dies mid-request (``ray.kill``, OOM, node loss) makes Serve's proxy end the
request with a bare ``500 Internal Server Error`` (it sends nothing and uvicorn fills in the 500). This
pure ASGI middleware runs *in the proxy* around Serve's own app::

    client ─▶ FailoverMiddleware ─▶ Serve proxy app ─▶ replica
              buffers the body (≤ max_body_bytes), replays it on retry
              nothing sent yet and the attempt ended → retry (backoff), else 503 + Retry-After
              response started but its stream broke → a final SSE ``data: {"error": {…503…}}`` event

Completions are stateless, so re-running a request that produced no output is safe. Requests whose
client disconnected are not retried. Install it with Serve's documented hook, before Serve starts:

    RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=vtoken.serve.control.failover:proxy_middlewares

(``vtoken serve`` and the tests set it; on KubeRay put it in the head/worker container env). Tuning:
``VTOKEN_FAILOVER_RETRIES`` (2), ``VTOKEN_FAILOVER_BACKOFF_S`` (0.5), ``VTOKEN_FAILOVER_MAX_BODY_BYTES``
(8 MiB; larger bodies are streamed through without retry). This module must not import vLLM (the
proxy stays light).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os

from vtoken.serve.replica.asgi import replay_body

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK_PATH = "vtoken.serve.control.failover:proxy_middlewares"


def error_json(message: str, code: int = 503, err_type: str = "ServiceUnavailableError") -> bytes:
    """OpenAI error body (same shape as vLLM's ``ErrorResponse``)."""
    return json.dumps({"error": {"message": message, "type": err_type, "param": None, "code": code}}).encode()


class FailoverMiddleware:
    """See the module docstring. Holds configuration only; per-request state lives in ``__call__``."""

    def __init__(self, app, retries: int = 2, backoff_s: float = 0.5, max_body_bytes: int = 8 << 20) -> None:
        self.app = app
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"].startswith("/-/"):
            await self.app(scope, receive, send)
            return
        body, more, disconnected = await self._buffer(receive)
        if more:  # too large to buffer: stream it through once, no retry
            await self.app(scope, replay_body(body, receive, more, disconnected), send)
            return
        for attempt in range(self.retries + 1):
            state = {"started": False, "ended": False, "sse": False}
            try:
                await self.app(scope, replay_body(body, receive, False, disconnected), _tracked(send, state, attempt))
            except Exception:
                if state["started"]:
                    raise
            if state["started"]:
                if not state["ended"]:
                    await _close_broken_stream(send, state["sse"])
                return
            if disconnected["seen"]:
                return  # the client is gone: nobody to answer
            if attempt < self.retries:
                await asyncio.sleep(self.backoff_s * (attempt + 1))
        payload = error_json(
            f"no replica could complete the request after {self.retries + 1} attempts "
            "(replica failed or restarting); retry later"
        )
        await send(
            {
                "type": "http.response.start",
                "status": 503,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                    (b"retry-after", b"5"),
                    (b"x-vtoken-retries", str(self.retries).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload, "more_body": False})

    async def _buffer(self, receive):
        chunks, size, disconnected = [], 0, {"seen": False}
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                disconnected["seen"] = True
                return b"".join(chunks), False, disconnected
            chunk = message.get("body", b"")
            chunks.append(chunk)
            size += len(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), False, disconnected
            if size > self.max_body_bytes:
                return b"".join(chunks), True, disconnected


def _tracked(send, state: dict, attempt: int):
    async def tracked(message) -> None:
        if message["type"] == "http.response.start":
            state["started"] = True
            headers = list(message.get("headers", []))
            state["sse"] = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)
            if attempt:
                message = {**message, "headers": headers + [(b"x-vtoken-retries", str(attempt).encode())]}
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            state["ended"] = True
        await send(message)

    return tracked


async def _close_broken_stream(send, sse: bool) -> None:
    tail = b""
    if sse:
        tail = b"data: " + error_json("the replica serving this stream failed; the output is incomplete") + b"\n\n"
    with contextlib.suppress(Exception):  # the client may be gone already
        await send({"type": "http.response.body", "body": tail, "more_body": False})


def proxy_middlewares() -> list:
    """Serve's HTTP proxy callback (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``): the middleware list."""
    from starlette.middleware import Middleware

    return [
        Middleware(
            FailoverMiddleware,
            retries=int(os.environ.get("VTOKEN_FAILOVER_RETRIES", "2")),
            backoff_s=float(os.environ.get("VTOKEN_FAILOVER_BACKOFF_S", "0.5")),
            max_body_bytes=int(os.environ.get("VTOKEN_FAILOVER_MAX_BODY_BYTES", str(8 << 20))),
        )
    ]
