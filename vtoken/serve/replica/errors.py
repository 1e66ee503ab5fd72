"""OpenAI-format errors for the replica's ASGI app (send-side wrappers; no request state is kept).

``error_body`` builds ``{"error": {"message", "type", "param", "code"}}`` with vLLM's own
``ErrorResponse`` model. ``openai_errors`` rewrites framework bodies such as FastAPI's
``{"detail": "Not Found"}``; ``sse_errors`` turns a stream whose *first* event is an error into a plain
HTTP error. Both wrap an ASGI ``send`` callable and pass every other message through unchanged.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any


def error_body(message: str, status: HTTPStatus, err_type: str | None = None, param: str | None = None) -> bytes:
    """An OpenAI-format error body, built with vLLM's own ``ErrorResponse`` model."""
    from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse

    info = ErrorInfo(
        message=message,
        type=err_type or status.phrase.replace(" ", "") + "Error",
        param=param,
        code=int(status),
    )
    return ErrorResponse(error=info).model_dump_json().encode()


def sse_errors(send):
    """A stream whose *first* event is an error (vLLM validates some parameters only after the SSE
    response started, e.g. out-of-vocabulary token ids) becomes a plain HTTP error with that body, so
    clients see a 4xx instead of ``200`` + an error event. Streams that produced output pass through."""
    state: dict[str, Any] = {"mode": "pass"}

    async def wrapped(message) -> None:
        kind, mode = message["type"], state["mode"]
        if mode == "drop":
            return
        if kind == "http.response.start":
            headers = dict(message.get("headers", []))
            if message["status"] == 200 and headers.get(b"content-type", b"").startswith(b"text/event-stream"):
                state["mode"], state["start"] = "hold", message
                return
        elif kind == "http.response.body" and mode == "hold":
            chunk, more = message.get("body", b""), message.get("more_body", False)
            if not chunk and more:
                return
            error = _leading_error_event(chunk)
            if error is None:
                state["mode"] = "pass"
                await send(state.pop("start"))
                await send(message)
                return
            status, payload = error
            start = state.pop("start")
            headers = [(k, v) for k, v in start.get("headers", []) if k not in (b"content-type", b"content-length")]
            headers += [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
            ]
            state["mode"] = "drop" if more else "pass"
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": payload, "more_body": False})
            return
        await send(message)

    return wrapped


def _leading_error_event(chunk: bytes) -> tuple[int, bytes] | None:
    """``(status, body)`` if ``chunk`` starts with an SSE ``data: {"error": {...}}`` event."""
    if not chunk.startswith(b'data: {"error"'):
        return None
    event = chunk[len(b"data: ") :].split(b"\n\n", 1)[0]
    try:
        err = json.loads(event)["error"]
        code = int(err.get("code", 500))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return (code if 400 <= code < 600 else 500), json.dumps({"error": err}).encode()


def openai_errors(send):
    """Rewrite framework error bodies (``{"detail": ...}``, e.g. FastAPI's 404/405) into the OpenAI
    format; every other response passes through untouched."""
    held: dict[str, Any] = {}

    async def wrapped(message) -> None:
        if message["type"] == "http.response.start":
            headers = dict(message.get("headers", []))
            if message["status"] >= 400 and headers.get(b"content-type", b"").startswith(b"application/json"):
                held["start"], held["body"] = message, b""
                return
        elif message["type"] == "http.response.body" and "start" in held:
            held["body"] += message.get("body", b"")
            if message.get("more_body", False):
                return
            start, body = held.pop("start"), held.pop("body")
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict) and "detail" in parsed and "error" not in parsed:
                status = HTTPStatus(start["status"])
                body = error_body(str(parsed["detail"]), status)
                start = {
                    **start,
                    "headers": [(k, v) for k, v in start.get("headers", []) if k != b"content-length"]
                    + [(b"content-length", str(len(body)).encode())],
                }
            await send(start)
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        await send(message)

    return wrapped
