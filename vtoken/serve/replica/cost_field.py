"""Each completion says what eviction cost it: a top-level ``vtoken`` object, the way vLLM extends OpenAI's
response bodies with its own top-level fields (``kv_transfer_params``, ``prompt_logprobs``, …).

The engine puts a finished request's cost (vtoken/core/reporting/request_cost.py) into vLLM's per-request pass-through,
``kv_transfer_params["vtoken"]`` (vtoken/vllm/gauges.py ``cost_params``), which reaches the request's last
``RequestOutput``. Two pieces of the replica carry it to the client::

    AsyncLLM.generate ──(recording)──▶ CostBook[engine request id] = cost      (engine side, in-process)
    vLLM's OpenAI app ──▶ lift_cost(send) ──▶ client                             (ASGI send side)
        JSON body:   kv_transfer_params.vtoken removed (``null`` again when empty), ``vtoken`` added
        SSE stream:  the usage chunk (``stream_options.include_usage``; ``choices: []``) gets ``vtoken``

    {"id": "cmpl-…", "choices": [...], "usage": {...},
     "vtoken": {"evicted_tokens": 96, "context_tokens": 160, "evicted_share": 0.6,
                "evicted_attention_mass": 0.031}}

The book is keyed by the id the OpenAI layer gives the engine: the response's ``id`` itself (chat), or
``<id>-<i>`` / ``<id>_<i>`` for the i-th prompt of a request with several; a response with several gets a
list, in prompt order. ``evicted_attention_mass`` is ``null`` for a policy that does not score every step.
OpenAI's clients keep unknown fields (``completion.model_extra["vtoken"]`` in the Python SDK). A streamed
response without ``include_usage`` has no chunk to carry it (the cost histograms, docs/metrics.md, count it);
a request vToken does not manage (mode ``none``) gets no field.

Side effects: the book is bounded (the oldest costs go first); a JSON response is held until its body is
complete (these bodies are small), then sent once with a corrected ``content-length``; SSE chunks are
rewritten one by one; every other response passes through unchanged. One event loop: no locking.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

from vtoken.vllm.gauges import RESPONSE_KEY as FIELD  # the same key in kv_transfer_params and the response
from vtoken.vllm.gauges import cost_from

PATHS = ("/v1/completions", "/v1/chat/completions")
KEEP = 4096  # costs the book holds for responses not sent yet; a burst larger than this loses the oldest


class CostBook:
    """Finished requests' costs by engine request id, until the response that owns them takes them."""

    def __init__(self, keep: int = KEEP) -> None:
        self._costs: OrderedDict[str, Any] = OrderedDict()
        self._keep = keep

    def record(self, request_id: str, cost: dict) -> None:
        """Remember ``cost`` (mutates; drops the oldest beyond ``keep``)."""
        self._costs[request_id] = cost
        self._costs.move_to_end(request_id)
        while len(self._costs) > self._keep:
            self._costs.popitem(last=False)

    def take(self, response_id: str) -> Any:
        """The cost of the response ``response_id`` (a list, in prompt order, when it had several prompts),
        removed from the book; ``None`` when none is known."""
        if response_id in self._costs:
            return self._costs.pop(response_id)
        found = []
        while True:
            key = next((k for sep in "-_" if (k := f"{response_id}{sep}{len(found)}") in self._costs), None)
            if key is None:
                break
            found.append(self._costs.pop(key))
        return found[0] if len(found) == 1 else (found or None)


def recording(generate, book: CostBook):
    """``AsyncLLM.generate`` that also records each finished output's cost in ``book`` (same signature and
    outputs; assign it to the engine instance the OpenAI app serves from)."""

    async def generate_recording(*args, **kwargs):
        request_id = kwargs.get("request_id", args[2] if len(args) > 2 else None)
        async for out in generate(*args, **kwargs):
            if out.finished and request_id is not None:
                cost = cost_from(getattr(out, "kv_transfer_params", None))
                if cost is not None:
                    book.record(request_id, cost)
            yield out

    return generate_recording


def lift(body: bytes, book: CostBook | None = None) -> bytes:
    """A JSON completion ``body`` with its cost as a top-level ``vtoken`` (from ``book`` when it has the
    response's, else lifted out of ``kv_transfer_params``), ``kv_transfer_params.vtoken`` removed. Anything
    that is not such an object comes back unchanged. Takes the response's entries from ``book``."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return body
    if not isinstance(parsed, dict) or "id" not in parsed:
        return body
    params = parsed.get("kv_transfer_params")
    inline = params.get(FIELD) if isinstance(params, dict) else None
    cost = (book.take(str(parsed["id"])) if book is not None else None) or inline
    if cost is None:
        return body
    if isinstance(params, dict) and FIELD in params:
        rest = {k: v for k, v in params.items() if k != FIELD}
        parsed["kv_transfer_params"] = rest or None
    parsed[FIELD] = cost
    return json.dumps(parsed, ensure_ascii=False, separators=(",", ":")).encode()


def lift_events(chunk: bytes, state: dict, book: CostBook) -> bytes:
    """One SSE body chunk with ``vtoken`` added to its usage chunk (``choices: []`` and a ``usage``); the
    response id is taken from the first event that has one (``state`` keeps it). Pure but for the book."""
    if b'"usage"' not in chunk and "id" in state:
        return chunk
    events = chunk.split(b"\n\n")
    for i, event in enumerate(events):
        if not event.startswith(b"data: {"):
            continue
        try:
            data = json.loads(event[len(b"data: ") :])
        except ValueError:
            continue
        state.setdefault("id", data.get("id"))
        if data.get("usage") and data.get("choices") == [] and state.get("id") is not None:
            cost = book.take(str(state["id"]))
            if cost is not None:
                data[FIELD] = cost
                events[i] = b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()
    return b"\n\n".join(events)


def lift_cost(send, book: CostBook | None = None):
    """An ASGI ``send`` that applies ``lift`` to a JSON response body and ``lift_events`` to an event
    stream (see the module docstring)."""
    held: dict[str, Any] = {}
    stream: dict[str, Any] = {}

    async def wrapped(message) -> None:
        if message["type"] == "http.response.start":
            content = dict(message.get("headers", [])).get(b"content-type", b"")
            if content.startswith(b"application/json"):
                held["start"], held["body"] = message, b""
                return
            stream["on"] = content.startswith(b"text/event-stream") and book is not None
        elif message["type"] == "http.response.body" and "start" in held:
            held["body"] += message.get("body", b"")
            if message.get("more_body", False):
                return
            start, body = held.pop("start"), lift(held.pop("body"), book)
            headers = [(k, v) for k, v in start.get("headers", []) if k != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        elif message["type"] == "http.response.body" and stream.get("on") and message.get("body"):
            message = {**message, "body": lift_events(message["body"], stream, book)}
        await send(message)

    return wrapped
