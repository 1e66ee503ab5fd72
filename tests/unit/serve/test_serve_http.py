"""The replica's RequestGuard and the proxy's FailoverMiddleware around small real ASGI apps.

The real engine path (vLLM's app behind the guard, Serve's proxy behind failover) is exercised in
test_serve_e2e.py; here each middleware's contract is checked in isolation and fast.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from vtoken.serve.config import ServeAppConfig
from vtoken.serve.control.failover import FailoverMiddleware
from vtoken.serve.replica.openai_app import RequestGuard, limit_violation

CFG = ServeAppConfig.model_validate(
    {"limits": {"max_body_bytes": 4096, "max_tokens": 100, "max_n": 2, "max_prompt_chars": 200}}
)


async def echo_app(scope, receive, send):
    """Answers 200 with the request body; 404 {"detail"} for /missing (FastAPI's shape)."""
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    status, payload = (404, b'{"detail":"Not Found"}') if scope["path"] == "/missing" else (200, body or b"{}")
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": payload})


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def run(coro):
    return asyncio.run(coro)


def guarded(api_key=None):
    return RequestGuard(
        echo_app,
        CFG,
        api_key,
        {"x-vtoken-replica": "rep-1", "x-vtoken-rank": "0"},
        lambda: {"status": "ready"},
    )


def assert_openai_error(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["message"] and err["code"] == status and "type" in err
    return err


def test_limits_answer_400_with_the_parameter_named():
    async def go():
        async with client(guarded()) as c:
            ok = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 100, "n": 2})
            assert ok.status_code == 200 and ok.json()["prompt"] == "hi"
            assert ok.headers["x-vtoken-replica"] == "rep-1"
            err = assert_openai_error(await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 101}), 400)
            assert err["param"] == "max_tokens" and "limit of 100" in err["message"]
            assert assert_openai_error(await c.post("/v1/chat/completions", json={"n": 3}), 400)["param"] == "n"
            long_chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 201}]}]}
            assert assert_openai_error(await c.post("/v1/chat/completions", json=long_chat), 400)["param"] == "prompt"
            assert_openai_error(await c.post("/v1/completions", content=b"x" * 5000), 413)
            # malformed JSON is passed through to vLLM's own validation
            assert (await c.post("/v1/completions", content=b"{bad")).status_code == 200

    run(go())


def test_api_key_required_except_probes():
    async def go():
        async with client(guarded("s3cret")) as c:
            assert_openai_error(await c.post("/v1/completions", json={}), 401)
            assert_openai_error(await c.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
            assert_openai_error(await c.get("/v1/models", headers={"Authorization": "Basic s3cret"}), 401)
            ok = await c.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
            assert ok.status_code == 200
            assert (await c.get("/ready")).json() == {"status": "ready"}
            assert (await c.get("/health")).status_code == 200

    run(go())


def test_framework_errors_are_rewritten_to_openai_format():
    async def go():
        async with client(guarded()) as c:
            err = assert_openai_error(await c.get("/missing"), 404)
            assert err["message"] == "Not Found"

    run(go())


@pytest.mark.parametrize("body", [[1, 2], "text", {"max_tokens": "9999"}, {"n": 99.5}, {"messages": "x" * 999}])
def test_limit_check_ignores_malformed_fields(body):
    """Wrong types are vLLM's to reject (with its own message), not the guard's."""
    assert limit_violation("/v1/chat/completions", body, CFG) is None


class FlakyProxy:
    """Stands in for Serve's proxy: the first ``failures`` attempts end without a response (what the
    proxy does when the replica actor dies); ``broken_stream`` starts an SSE response then stops."""

    def __init__(self, failures: int, broken_stream: bool = False) -> None:
        self.failures, self.broken_stream, self.calls, self.bodies = failures, broken_stream, 0, []

    async def __call__(self, scope, receive, send):
        self.calls += 1
        self.bodies.append((await receive())["body"])
        if self.broken_stream:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")],
                }
            )
            await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
            return
        if self.calls <= self.failures:
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def test_failover_retries_with_the_same_body_then_answers_503():
    async def go():
        proxy = FlakyProxy(failures=2)
        async with client(FailoverMiddleware(proxy, retries=2, backoff_s=0.01)) as c:
            r = await c.post("/v1/completions", content=b'{"prompt": "p"}')
            assert r.status_code == 200 and r.text == "ok" and r.headers["x-vtoken-retries"] == "2"
        assert proxy.bodies == [b'{"prompt": "p"}'] * 3
        dead = FlakyProxy(failures=99)
        async with client(FailoverMiddleware(dead, retries=1, backoff_s=0.01)) as c:
            r = await c.post("/v1/completions", json={})
            err = assert_openai_error(r, 503)
            assert r.headers["retry-after"] == "5" and "attempts" in err["message"] and dead.calls == 2

    run(go())


def test_failover_closes_a_broken_stream_with_an_error_event():
    async def go():
        async with client(FailoverMiddleware(FlakyProxy(0, broken_stream=True), retries=2, backoff_s=0.01)) as c:
            r = await c.post("/v1/chat/completions", json={"stream": True})
            assert r.status_code == 200
            events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
            assert events[-1]["error"]["code"] == 503

    run(go())
