"""The soak's clients: a seeded mix of requests, each sent once and accounted for exactly once.

Every request is drawn from the seed (``draw``): one of a few shared system prompts plus its own text (prefix
cache hits), streaming or not, ``n`` of 1 or 2, greedy or sampled, a ``max_tokens`` up to a long generation,
the replica's vToken settings overridden per request (policy and mode), and for some a client abort after a
random number of stream chunks or a client timeout. ``send`` returns one ``Outcome``::

    completed   200 with every choice finished (finish_reason set; a stream ended with [DONE])
    error       a clean error: an HTTP status >= 400 with an OpenAI error body, or a stream whose last event
                is an error object (e.g. 503 when a replica died mid-stream)
    aborted     the client gave up on purpose (closed the stream, or its deliberate short timeout fired)
    unaccounted anything else: a stream that ended without [DONE] or error, a 200 without finish reasons, a
                connection reset without an error, a non-JSON error body — what the soak must never see

Pure apart from the HTTP call in ``send``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

import httpx

SYSTEM_PROMPTS = (
    "You are a careful assistant. Answer briefly and cite the passage you used. " * 6,
    "System: the following is a transcript of a meeting about storage systems and their failure modes. " * 5,
    "Instruction: summarise the text below in plain words for a reader new to the field. " * 6,
)
WORDS = (
    "cache",
    "block",
    "token",
    "river",
    "engine",
    "paper",
    "window",
    "signal",
    "garden",
    "number",
    "table",
    "stream",
    "memory",
    "replica",
    "router",
    "queue",
    "budget",
    "policy",
    "metric",
    "node",
)
COMPLETED, ERROR, ABORTED, UNACCOUNTED = "completed", "error", "aborted", "unaccounted"
OUTCOMES = (COMPLETED, ERROR, ABORTED, UNACCOUNTED)


@dataclass(frozen=True)
class SoakRequest:
    """One drawn request: its body and how the client treats it (``abort_after``: stream chunks read before
    the client closes it; ``client_timeout_s``: a deliberately short read timeout, else None)."""

    index: int
    body: dict
    abort_after: int | None = None
    client_timeout_s: float | None = None

    @property
    def greedy(self) -> bool:
        return self.body.get("temperature", 1.0) == 0.0

    @property
    def aborts(self) -> bool:
        return self.abort_after is not None or self.client_timeout_s is not None


@dataclass
class Outcome:
    index: int
    outcome: str
    status: int | None = None
    detail: str = ""
    texts: list[str] = field(default_factory=list)  # per choice, when completed


def draw(
    index: int,
    seed: int,
    model: str,
    policies: tuple[str, ...],
    modes: tuple[str, ...],
    abort_rate: float,
    max_tokens: int,
) -> SoakRequest:
    """Request ``index`` of the soak with ``seed`` (pure: the same arguments give the same request)."""
    rng = random.Random(seed * 1_000_003 + index)
    user = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 120)))
    greedy = rng.random() < 0.6
    body = {
        "model": model,
        "prompt": rng.choice(SYSTEM_PROMPTS) + f"Request {index}: " + user,
        "max_tokens": rng.choice((8, 32, 64, max_tokens)),
        "stream": rng.random() < 0.5,
        "n": 1 if greedy or rng.random() < 0.6 else 2,
        "ignore_eos": rng.random() < 0.7,
        "temperature": 0.0 if greedy else 0.8,
        "seed": index,
        "vllm_xargs": {"vtoken.policy": rng.choice(policies), "vtoken.mode": rng.choice(modes)},
    }
    abort_after = timeout = None
    if rng.random() < abort_rate:
        if body["stream"]:
            abort_after = rng.randint(1, 6)
        else:
            timeout = rng.choice((0.05, 0.3))
    return SoakRequest(index, body, abort_after, timeout)


def _error_body(text: str) -> bool:
    try:
        return isinstance(json.loads(text).get("error"), dict)
    except (ValueError, AttributeError):
        return False


def send(client: httpx.Client, url: str, req: SoakRequest, timeout_s: float) -> Outcome:
    """Send ``req`` once and classify it (see the module docstring); never raises."""
    timeout = req.client_timeout_s or timeout_s
    try:
        if not req.body["stream"]:
            r = client.post(url, json=req.body, timeout=timeout)
            if r.status_code >= 400:
                ok = _error_body(r.text)
                return Outcome(req.index, ERROR if ok else UNACCOUNTED, r.status_code, r.text[:200])
            choices = r.json().get("choices", [])
            if len(choices) == req.body["n"] and all(c.get("finish_reason") for c in choices):
                return Outcome(req.index, COMPLETED, 200, texts=[c["text"] for c in choices])
            return Outcome(req.index, UNACCOUNTED, 200, f"choices without finish reasons: {choices}"[:200])
        return _stream(client, url, req, timeout)
    except httpx.TimeoutException as exc:
        if req.client_timeout_s is not None:
            return Outcome(req.index, ABORTED, None, "client timeout")
        return Outcome(req.index, UNACCOUNTED, None, f"hung: {type(exc).__name__} after {timeout} s")
    except httpx.HTTPError as exc:
        return Outcome(req.index, UNACCOUNTED, None, f"{type(exc).__name__}: {exc}"[:200])


def _stream(client: httpx.Client, url: str, req: SoakRequest, timeout: float) -> Outcome:
    with client.stream("POST", url, json=req.body, timeout=timeout) as r:
        if r.status_code >= 400:
            text = r.read().decode(errors="replace")
            return Outcome(req.index, ERROR if _error_body(text) else UNACCOUNTED, r.status_code, text[:200])
        texts: dict[int, str] = {}
        finished: set[int] = set()
        last = ""
        for n_chunks, line in enumerate(line for line in r.iter_lines() if line.startswith("data: ")):
            if req.abort_after is not None and n_chunks >= req.abort_after:
                return Outcome(req.index, ABORTED, 200, f"closed after {n_chunks} chunks")
            last = line[len("data: ") :]
            if last == "[DONE]":
                break
            event = json.loads(last)
            if "error" in event:
                return Outcome(req.index, ERROR, event["error"].get("code"), last[:200])
            for c in event.get("choices", []):
                texts[c["index"]] = texts.get(c["index"], "") + c.get("text", "")
                if c.get("finish_reason"):
                    finished.add(c["index"])
        if last == "[DONE]" and len(finished) == req.body["n"]:
            return Outcome(req.index, COMPLETED, 200, texts=[texts[i] for i in sorted(texts)])
        return Outcome(req.index, UNACCOUNTED, 200, f"stream ended with {last[:80]!r}, finished {sorted(finished)}")
