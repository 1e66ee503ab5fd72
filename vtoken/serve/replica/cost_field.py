"""Each completion says what eviction cost it: a top-level ``vtoken`` object, the way vLLM extends OpenAI's
response bodies with its own top-level fields (``kv_transfer_params``, ``prompt_logprobs``, …).

The engine puts the request's cost (vtoken/core/cost.py) into vLLM's per-request pass-through,
``kv_transfer_params["vtoken"]`` (vtoken/vllm/stats.py ``cost_params``); vLLM copies that dict into
non-streaming ``/v1/completions`` and ``/v1/chat/completions`` bodies. This send-side wrapper lifts it out
to the top level and gives ``kv_transfer_params`` back its usual ``null`` when nothing else is in it::

    {"id": "cmpl-…", "choices": [...], "usage": {...},
     "vtoken": {"evicted_tokens": 96, "context_tokens": 160, "evicted_share": 0.6,
                "evicted_attention_mass": 0.031}}

(``evicted_attention_mass`` is ``null`` for a policy that collects no attention statistics.) OpenAI's
clients keep unknown fields (``completion.model_extra["vtoken"]`` in the Python SDK). Streaming responses do
not carry it: vLLM's streaming path drops ``kv_transfer_params``; the cost histograms (docs/metrics.md)
count streamed requests too. A request vToken does not manage (mode ``none``) gets no field.

Side effects: a JSON response is held until its body is complete (these bodies are small), then sent once
with a corrected ``content-length``; every other response passes through unchanged.
"""

from __future__ import annotations

import json
from typing import Any

from vtoken.vllm.stats import RESPONSE_KEY as FIELD  # the same key in kv_transfer_params and the response

PATHS = ("/v1/completions", "/v1/chat/completions")


def lift(body: bytes) -> bytes:
    """``body`` with ``kv_transfer_params.vtoken`` moved to a top-level ``vtoken`` (pure; anything that is
    not such a JSON object comes back unchanged)."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return body
    params = parsed.get("kv_transfer_params") if isinstance(parsed, dict) else None
    if not isinstance(params, dict) or FIELD not in params:
        return body
    rest = {k: v for k, v in params.items() if k != FIELD}
    parsed = {**parsed, "kv_transfer_params": rest or None, FIELD: params[FIELD]}
    return json.dumps(parsed, ensure_ascii=False, separators=(",", ":")).encode()


def lift_cost(send):
    """An ASGI ``send`` that applies ``lift`` to a JSON response body (see the module docstring)."""
    held: dict[str, Any] = {}

    async def wrapped(message) -> None:
        if message["type"] == "http.response.start":
            headers = dict(message.get("headers", []))
            if headers.get(b"content-type", b"").startswith(b"application/json"):
                held["start"], held["body"] = message, b""
                return
        elif message["type"] == "http.response.body" and "start" in held:
            held["body"] += message.get("body", b"")
            if message.get("more_body", False):
                return
            start, body = held.pop("start"), lift(held.pop("body"))
            headers = [(k, v) for k, v in start.get("headers", []) if k != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        await send(message)

    return wrapped
