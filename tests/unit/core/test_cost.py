"""What eviction cost a request (vtoken/core/reporting/request_cost.py): the record, the engine's histograms, their trip
through vLLM's SchedulerStats, the response field and the autoscaler's trimmed share. No engine: the
engine's side is tests/integration/test_vllm_engine.py::test_each_output_says_what_eviction_cost_it, the served
side tests/e2e/test_serve_e2e.py::test_a_completion_says_what_eviction_cost_it."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import numpy as np
import pytest

from vtoken import metric_names as names
from vtoken.core.config import Mode
from vtoken.core.reporting.engine_kv import KVSnapshot
from vtoken.core.reporting.request_cost import CostStats, Histogram, RequestCost
from vtoken.core.token_table import TokenTable
from vtoken.serve.control.autoscaling import ScalingParams, decide
from vtoken.serve.replica.cost_field import CostBook, lift, lift_cost, lift_events, recording
from vtoken.serve.telemetry.stat_logger import trimmed_since
from vtoken.vllm import gauges as vstats


def table_with(seen: int, dead: list[int], acc: np.ndarray | None = None) -> TokenTable:
    t = TokenTable(block_size=4, mode=Mode.REPACK)
    t.place(seen)
    if acc is not None:
        t.accumulated[:seen] = acc
    t.evict(np.asarray(dead, np.int64))
    return t


def test_request_cost_is_read_off_the_table():
    acc = np.array([4.0, 1.0, 1.0, 2.0, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0])
    t = table_with(10, [1, 3, 4], acc)
    cost = RequestCost.of_table(t, with_mass=True)
    assert (cost.evicted_tokens, cost.context_tokens) == (3, 10)
    assert cost.evicted_share == pytest.approx(0.3)
    assert cost.evicted_mass == pytest.approx(3.0 / 10.0)  # dead 1, 3, 4 hold 1 + 2 + 0 of 10
    assert RequestCost.of_table(t, with_mass=False).evicted_mass is None
    assert RequestCost.of_table(None, with_mass=False) == RequestCost(0, 0, None)
    assert RequestCost.of_table(table_with(5, []), with_mass=True).evicted_mass == 0.0  # no scores yet
    d = cost.as_dict()
    assert d == {"evicted_tokens": 3, "context_tokens": 10, "evicted_share": 0.3, "evicted_attention_mass": 0.3}


def test_histograms_are_cumulative_with_the_declared_buckets():
    stats = CostStats().add(RequestCost(0, 50)).add(RequestCost(30, 100, 0.04)).add(RequestCost(900, 1000, 0.5))
    assert stats.share.bounds == names.REQUEST_EVICTED_SHARE.buckets
    assert stats.share.count == 3 and stats.trimmed == 2
    assert dict(stats.share.buckets())["0.0"] == 1 and dict(stats.share.buckets())["0.3"] == 2
    assert dict(stats.share.buckets())["+Inf"] == 3 and stats.share.total == pytest.approx(1.2)
    assert stats.tokens.total == 930 and dict(stats.tokens.buckets())["64.0"] == 2
    assert stats.mass.count == 2  # the request without scores is not in the mass histogram
    with pytest.raises(ValueError, match="increase"):
        Histogram((0.1, 0.1))
    with pytest.raises(ValueError, match="buckets"):
        names.Metric("vtoken:x", names.HISTOGRAM, "no buckets")


def test_costs_survive_the_scheduler_stats_dict_and_old_engines_decode():
    snap = KVSnapshot(
        pool_blocks=10, costs=CostStats().add(RequestCost(3, 9, 0.125)).add(RequestCost(0, 4)), source="vtoken"
    )
    items = vstats.encode(snap)
    assert all(isinstance(v, int) for v in items.values())
    back = vstats.decode(items)
    assert back is not None
    for (_, got), (_, sent) in zip(back.costs.by_metric(), snap.costs.by_metric(), strict=True):
        assert (got.bounds, got.counts, got.count) == (sent.bounds, sent.counts, sent.count)
        assert got.total == pytest.approx(sent.total, abs=1e-6)  # sums travel in millionths
    gauges = {k: v for k, v in items.items() if not k.startswith(vstats.COST)}
    assert vstats.decode(gauges).costs == CostStats()  # an engine that sends no costs: empty histograms


def test_cost_params_keep_vllms_own_entries():
    cost = RequestCost(2, 8)
    assert vstats.cost_params(None, cost) == {"vtoken": cost.as_dict()}
    assert vstats.cost_params({"x": 1}, cost) == {"x": 1, "vtoken": cost.as_dict()}
    assert vstats.cost_from({"vtoken": {"evicted_tokens": 2}}) == {"evicted_tokens": 2}
    assert vstats.cost_from(None) is None


def test_the_response_field_is_lifted_to_the_top_level():
    cost = {"evicted_tokens": 3, "context_tokens": 10}
    out = json.loads(lift(json.dumps({"id": "c", "kv_transfer_params": {"vtoken": cost}}).encode()))
    assert out == {"id": "c", "kv_transfer_params": None, "vtoken": cost}
    out = json.loads(lift(json.dumps({"id": "c", "kv_transfer_params": {"vtoken": cost, "other": 1}}).encode()))
    assert out == {"id": "c", "kv_transfer_params": {"other": 1}, "vtoken": cost}
    for body in (b'{"id": "c", "kv_transfer_params": null}', b"not json", b"[1, 2]", b'{"error": {}}'):
        assert lift(body) == body
    book = CostBook()
    book.record("cmpl-x-0", {"evicted_tokens": 1})
    book.record("cmpl-x-1", {"evicted_tokens": 2})
    out = json.loads(lift(json.dumps({"id": "cmpl-x", "kv_transfer_params": {"vtoken": cost}}).encode(), book))
    assert out["vtoken"] == [{"evicted_tokens": 1}, {"evicted_tokens": 2}]  # every prompt's, in prompt order
    assert out["kv_transfer_params"] is None and book.take("cmpl-x") is None  # taken


def test_the_book_is_keyed_as_vllms_openai_layer_names_engine_requests_and_bounded():
    book = CostBook(keep=3)
    for key in ("chatcmpl-a", "chatcmpl-b_0", "chatcmpl-b_1", "cmpl-c-0"):
        book.record(key, {"k": key})
    assert book.take("chatcmpl-a") is None  # the oldest went when a fourth came
    assert book.take("chatcmpl-b") == [{"k": "chatcmpl-b_0"}, {"k": "chatcmpl-b_1"}]
    assert book.take("cmpl-c") == {"k": "cmpl-c-0"} and book.take("cmpl-c") is None  # one prompt: no list


def test_recording_generate_books_the_finished_outputs_cost():
    book = CostBook()

    async def generate(prompt, params, request_id, **kwargs):
        yield SimpleNamespace(finished=False, kv_transfer_params=None)
        yield SimpleNamespace(finished=True, kv_transfer_params={"vtoken": {"evicted_tokens": 4}})

    async def drain():
        return [o async for o in recording(generate, book)("p", None, "cmpl-r-0", priority=0)]

    assert len(asyncio.run(drain())) == 2 and book.take("cmpl-r") == {"evicted_tokens": 4}


def test_a_stream_gets_the_cost_in_its_usage_chunk():
    book = CostBook()
    book.record("chatcmpl-s", {"evicted_tokens": 5})
    state: dict = {}
    first = b'data: {"id":"chatcmpl-s","choices":[{"delta":{"content":"a"}}]}\n\n'
    assert lift_events(first, state, book) == first and state["id"] == "chatcmpl-s"
    last = b'data: {"id":"chatcmpl-s","choices":[],"usage":{"total_tokens":9}}\n\ndata: [DONE]\n\n'
    events = lift_events(last, state, book).split(b"\n\n")
    assert json.loads(events[0][len(b"data: ") :])["vtoken"] == {"evicted_tokens": 5}
    assert events[1] == b"data: [DONE]"


def test_lift_cost_sends_one_body_with_its_length():
    sent = []

    async def send(message):
        sent.append(message)

    body = json.dumps({"id": "c", "kv_transfer_params": {"vtoken": {"evicted_tokens": 1}}}).encode()
    wrapped = lift_cost(send)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]

    async def respond():
        await wrapped({"type": "http.response.start", "status": 200, "headers": headers})
        await wrapped({"type": "http.response.body", "body": body[:10], "more_body": True})
        await wrapped({"type": "http.response.body", "body": body[10:], "more_body": False})

    asyncio.run(respond())
    start, last = sent
    out = last["body"]
    assert json.loads(out)["vtoken"] == {"evicted_tokens": 1} and not last["more_body"]
    assert dict(start["headers"])[b"content-length"] == str(len(out)).encode()
    sent.clear()
    stream = lift_cost(send)  # a stream passes through as it comes
    sse = [(b"content-type", b"text/event-stream")]
    asyncio.run(stream({"type": "http.response.start", "status": 200, "headers": sse}))
    asyncio.run(stream({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True}))
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]


def test_trimmed_share_since_the_previous_report_and_the_autoscaler_scales_on_it():
    a = CostStats().add(RequestCost(1, 10))
    b = a.add(RequestCost(0, 10)).add(RequestCost(5, 10)).add(RequestCost(0, 10)).add(RequestCost(2, 10))
    assert trimmed_since(a, b) == pytest.approx(0.5)
    assert trimmed_since(b, b) == 0.0 and trimmed_since(b, CostStats()) == 0.0  # nothing new; a restart
    on = ScalingParams(upscale_trimmed_share=0.2)
    kv = {"r1": 0.5, "r2": 0.5}  # inside the band: only trimming can scale up
    assert decide(2, kv, {}, on, 1, 4, trimmed={"r1": 0.3, "r2": 0.2}).reason == "up"
    assert decide(2, kv, {}, on, 1, 4, trimmed={"r1": 0.1, "r2": 0.1}).reason == "hold"
    assert decide(2, kv, {}, ScalingParams(), 1, 4, trimmed={"r1": 1.0}).reason == "hold"  # unset: not used
    with pytest.raises(ValueError, match="upscale_trimmed_share"):
        ScalingParams(upscale_trimmed_share=0.0)


def test_autoscaling_policy_reads_the_replicas_trimmed_share():
    from vtoken.serve.control.autoscaling import KVAutoscalingPolicy
    from vtoken.serve.telemetry.stat_logger import KV_UTILIZATION, TRIMMED_SHARE

    ctx = SimpleNamespace(
        aggregated_metrics={KV_UTILIZATION: {"a": 0.5}, TRIMMED_SHARE: {"a": 0.6, "gone": 0.0}},
        running_replicas=["a"],
        current_num_replicas=1,
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=3,
        target_num_replicas=1,
    )
    desired, info = KVAutoscalingPolicy(upscale_trimmed_share=0.5)(ctx)
    assert desired == 2 and info["vtoken"]["trimmed"] == pytest.approx(0.6)
