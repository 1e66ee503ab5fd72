"""``vtoken bench soak``'s client (vtoken/bench/served/soak_client.py): its request mix and outcome accounting, on
httpx's mock transport. The short soak on the real served stack is tests/e2e/test_bench_soak.py."""

from __future__ import annotations

import json

import httpx
import pytest

from vtoken.bench.served.soak_client import ABORTED, COMPLETED, ERROR, UNACCOUNTED, SoakRequest, draw, send

POLICIES, MODES = ("h2o", "tova"), ("repack", "none")


def test_draw_is_a_pure_function_of_seed_and_index_and_mixes_the_kinds():
    a = [draw(i, 7, "m", POLICIES, MODES, 0.3, 100) for i in range(200)]
    assert a == [draw(i, 7, "m", POLICIES, MODES, 0.3, 100) for i in range(200)]
    assert a != [draw(i, 8, "m", POLICIES, MODES, 0.3, 100) for i in range(200)]
    kinds = {(r.body["stream"], r.body["n"], r.greedy, r.aborts, r.body["vllm_xargs"]["vtoken.mode"]) for r in a}
    assert len(kinds) >= 12  # streaming x n x greedy x abort x mode all occur
    assert all(r.body["n"] == 1 for r in a if r.greedy)


def _client(handler) -> httpx.Client:
    return httpx.Client(transport=httpx.MockTransport(handler))


def _sse(*events) -> bytes:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events).encode()


def req(stream: bool, n: int = 1, abort_after=None, timeout=None) -> SoakRequest:
    return SoakRequest(0, {"prompt": "x", "stream": stream, "n": n, "max_tokens": 4}, abort_after, timeout)


@pytest.mark.parametrize(
    "case,response,expected",
    [
        ("plain ok", httpx.Response(200, json={"choices": [{"text": "a", "finish_reason": "length"}]}), COMPLETED),
        (
            "plain n=2 one unfinished",
            httpx.Response(
                200, json={"choices": [{"text": "a", "finish_reason": "stop"}, {"text": "b", "finish_reason": None}]}
            ),
            UNACCOUNTED,
        ),
        ("clean 503", httpx.Response(503, json={"error": {"code": 503, "message": "replica died"}}), ERROR),
        ("html 502", httpx.Response(502, text="<html>bad gateway</html>"), UNACCOUNTED),
    ],
)
def test_plain_outcomes(case, response, expected):
    n = 2 if "n=2" in case else 1
    out = send(_client(lambda request: response), "http://t/v1/completions", req(False, n), 5)
    assert out.outcome == expected, (case, out)


def test_stream_outcomes():
    done = _sse(
        {"choices": [{"index": 0, "text": "a", "finish_reason": None}]},
        {"choices": [{"index": 0, "text": "b", "finish_reason": "length"}]},
        "[DONE]",
    )
    ok = send(_client(lambda r: httpx.Response(200, content=done)), "http://t", req(True), 5)
    assert ok.outcome == COMPLETED and ok.texts == ["ab"]
    cut = _sse({"choices": [{"index": 0, "text": "a", "finish_reason": None}]})  # no [DONE]: never ended
    assert send(_client(lambda r: httpx.Response(200, content=cut)), "http://t", req(True), 5).outcome == UNACCOUNTED
    err = _sse({"choices": [{"index": 0, "text": "a", "finish_reason": None}]}, {"error": {"code": 503}})
    assert send(_client(lambda r: httpx.Response(200, content=err)), "http://t", req(True), 5).outcome == ERROR
    many = _sse(*[{"choices": [{"index": 0, "text": "a", "finish_reason": None}]}] * 5, "[DONE]")
    assert (
        send(_client(lambda r: httpx.Response(200, content=many)), "http://t", req(True, abort_after=2), 5).outcome
        == ABORTED
    )


def test_timeouts_are_aborts_only_when_the_client_meant_them():
    def slow(request):
        raise httpx.ReadTimeout("slow", request=request)

    assert send(_client(slow), "http://t", req(False, timeout=0.05), 5).outcome == ABORTED
    hung = send(_client(slow), "http://t", req(False), 5)
    assert hung.outcome == UNACCOUNTED and "hung" in hung.detail
