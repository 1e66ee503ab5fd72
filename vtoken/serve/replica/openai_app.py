"""vLLM's own OpenAI-compatible FastAPI app, built around a running engine, behind a small guard.

Routes, request/response models, validation and error bodies are vLLM's (``vllm serve`` builds the very
same app with ``build_app`` + ``init_app_state``): ``/v1/completions``, ``/v1/chat/completions``
(SSE when ``stream: true``), ``/v1/models``, ``/health``, ``/tokenize``, … The ``RequestGuard`` in front
adds only what vLLM lacks for a shared endpoint::

    client ─▶ RequestGuard ─────────────────────────────────▶ vLLM FastAPI app ─▶ AsyncLLM
              │ 401  missing/wrong Bearer key (if configured)
              │ 413  body larger than limits.max_body_bytes
              │ 400  max_tokens / n / prompt chars over the limits
              │ GET /ready → replica + KV snapshot (JSON)
              │ completions: the request's eviction cost as a top-level ``vtoken`` field (cost_field.py)
              └ adds headers x-vtoken-replica / x-vtoken-rank to every response

All guard errors use vLLM's ``ErrorResponse`` model (``{"error": {"message", "type", "param", "code"}}``).
A request without ``max_tokens`` gets ``limits.max_tokens`` as its default through vLLM's own
``--override-generation-config '{"max_new_tokens": N}'``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from vtoken.serve.config import ServeAppConfig
from vtoken.serve.replica.asgi import replay_body
from vtoken.serve.replica.cost_field import PATHS as COST_PATHS
from vtoken.serve.replica.cost_field import CostBook, lift_cost
from vtoken.serve.replica.errors import error_body, openai_errors, sse_errors

GUARD_EXEMPT = ("/health", "/ready", "/ping")  # liveness/readiness probes need no key
_LIMITED_BODIES = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


def vllm_cli_args(cfg: ServeAppConfig, model_path: str) -> list[str]:
    """The ``vllm serve`` flags that shape the app (the engine itself is built from AsyncEngineArgs)."""
    return [
        "--model",
        model_path,
        "--served-model-name",
        cfg.model_name,
        "--max-model-len",
        str(cfg.engine.max_model_len),
        "--override-generation-config",
        json.dumps({"max_new_tokens": cfg.limits.max_tokens}),
        "--disable-uvicorn-access-log",
    ]


async def build_vllm_app(engine: Any, cfg: ServeAppConfig, model_path: str):
    """vLLM's FastAPI app wired to ``engine`` (an ``AsyncLLM``); same calls as ``vllm serve``."""
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(vllm_cli_args(cfg, model_path))
    supported_tasks = await engine.get_supported_tasks()
    app = build_app(args, supported_tasks, engine.model_config)
    await init_app_state(engine, app.state, args, supported_tasks)
    return app


def limit_violation(path: str, body: Any, cfg: ServeAppConfig) -> tuple[str, str] | None:
    """``(message, param)`` if a JSON request body exceeds a configured limit, else None (pure).

    Only well-typed fields are checked; anything malformed is left to vLLM's own validation.
    """
    if not isinstance(body, dict) or not path.startswith(_LIMITED_BODIES):
        return None
    lim = cfg.limits
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > lim.max_tokens:
            return f"{key} {value} exceeds this server's limit of {lim.max_tokens}", key
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > lim.max_n:
        return f"n {n} exceeds this server's limit of {lim.max_n}", "n"
    chars = _prompt_chars(body)
    if chars > lim.max_prompt_chars:
        return f"prompt has {chars} characters; this server's limit is {lim.max_prompt_chars}", "prompt"
    return None


def _prompt_chars(body: dict) -> int:
    total = 0
    for key in ("prompt", "input"):
        total += _text_len(body.get(key))
    messages = body.get("messages")
    if isinstance(messages, list):
        for msg in messages:
            if isinstance(msg, dict):
                total += _text_len(msg.get("content"))
    return total


def _text_len(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(
            _text_len(v) if isinstance(v, (str, list)) else _text_len(v.get("text")) if isinstance(v, dict) else 0
            for v in value
        )
    return 0


class RequestGuard:
    """Pure ASGI middleware: API key, body/parameter limits, ``/ready``, replica header.

    ``ready_info`` is called for ``GET /ready`` and must return a JSON-serialisable dict; ``cost_book``:
    where the engine records each finished request's eviction cost (``cost_field.recording``). Stateless per
    request; the body is read once (bounded) and replayed to the inner app.
    """

    def __init__(
        self,
        app,
        cfg: ServeAppConfig,
        api_key: str | None,
        replica_headers: dict[str, str],
        ready_info: Callable[[], dict],
        cost_book: CostBook | None = None,
    ) -> None:
        from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

        self.app = app
        self.cfg = cfg
        self._auth = AuthenticationMiddleware(app, [api_key]) if api_key else None  # reuse its check
        self._headers = [(k.lower().encode(), str(v).encode()) for k, v in replica_headers.items()]
        self._ready_info = ready_info
        self._costs = cost_book  # filled by the engine's recording generate (cost_field.py)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        send = sse_errors(openai_errors(send))
        if path.startswith(COST_PATHS):
            send = lift_cost(send, self._costs)  # the request's eviction cost as a top-level vtoken field
        send = self._tagging(send)
        if scope.get("method") != "OPTIONS" and self._auth is not None and not path.startswith(GUARD_EXEMPT):
            from starlette.datastructures import Headers

            if not self._auth.verify_token(Headers(scope=scope)):
                await _reply(
                    send,
                    HTTPStatus.UNAUTHORIZED,
                    "missing or invalid API key (Authorization: Bearer <key>)",
                    "AuthenticationError",
                    extra=[(b"www-authenticate", b"Bearer")],
                )
                return
        if path == "/ready" and scope.get("method") == "GET":
            await _reply_json(send, HTTPStatus.OK, json.dumps(self._ready_info()).encode())
            return
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        body = await _read_body(scope, receive, self.cfg.limits.max_body_bytes)
        if body is None:
            await _reply(
                send,
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"request body exceeds {self.cfg.limits.max_body_bytes} bytes",
                "BadRequestError",
            )
            return
        violation = None
        with contextlib.suppress(ValueError, RecursionError):  # not JSON: vLLM answers with its own 400
            violation = limit_violation(path, json.loads(body), self.cfg)
        if violation is not None:
            await _reply(send, HTTPStatus.BAD_REQUEST, violation[0], "BadRequestError", param=violation[1])
            return
        await self.app(scope, replay_body(body, receive), send)

    def _tagging(self, send):
        extra = self._headers

        async def tagged(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": list(message.get("headers", [])) + extra}
            await send(message)

        return tagged


async def _read_body(scope, receive, limit: int) -> bytes | None:
    """The whole request body, or None once it exceeds ``limit`` bytes (Content-Length checked first)."""
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                if int(value) > limit:
                    return None
            except ValueError:
                pass
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


async def _reply(
    send, status: HTTPStatus, message: str, err_type: str, param: str | None = None, extra: list | None = None
) -> None:
    await _reply_json(send, status, error_body(message, status, err_type, param), extra)


async def _reply_json(send, status: HTTPStatus, payload: bytes, extra: list | None = None) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": int(status), "headers": headers + (extra or [])})
    await send({"type": "http.response.body", "body": payload, "more_body": False})
