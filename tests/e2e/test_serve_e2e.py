"""Real Ray Serve + real vLLM engines (tiny Llama, 72-block KV pool, vToken repack/H2O), 2 replicas.

One Ray cluster and one application for the whole module (≈10 s + ≈60 s to start on 2 cores); the
destructive replica-kill test runs last. Everything targets 127.0.0.1 and every load is bounded in
requests and time. Measured numbers are printed (run with -s to see them) and recorded in
docs/serving.md.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
from support.serve import PrometheusServer, malformed_cases, vllm_cli_command, wait_for

from vtoken.serve.config import ServeAppConfig
from vtoken.serve.launch import procs
from vtoken.serve.launch.local import LocalCluster, free_port
from vtoken.serve.replica.deployment import FAULT_FILE_ENV

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
LIMITS = {"max_tokens": 1600, "max_n": 4, "max_prompt_chars": 8000, "max_body_bytes": 65536}
PROMPT = "It is a truth universally acknowledged, that a single man in possession of a good fortune "


def app_config(metrics_port: int) -> ServeAppConfig:
    return ServeAppConfig.model_validate(
        {
            "model": "tiny-llama",
            "vtoken": {"mode": "repack", "policy": "h2o", "budget": 0.5, "sinks": 4, "recent": 16, "scope": "all"},
            "engine": {"kv_cache_blocks": 72, "max_model_len": 2048, "max_num_seqs": 8},
            "slo": {"ttft_ms": 2000, "tpot_ms": 200, "admission": True},  # loose for the tiny model: exports
            # vtoken:admission_limit (the SLA dashboard's queue panel) without holding anyone back
            "limits": {**LIMITS, "api_key": API_KEY},
            "deployment": {"num_replicas": 2, "num_cpus": 0.5, "health_check_period_s": 2.0},
            "router": {"stats_period_s": 0.5, "stale_after_s": 3.0},
            "metrics": {"port": metrics_port, "port_span": 2},
        }
    )


# Ray 2.60's raylet ends a dead worker's process group (and, as a subreaper, unknown children): on a node
# whose raylet lives it would end a killed replica's engine processes by itself. Off here, so the
# replica-kill test proves vToken's own guarantee (vtoken/vllm/lifetime.py), the only one left when the
# raylet is gone too.
RAY_ORPHAN_CLEANUP_OFF = {
    "RAY_process_group_cleanup_enabled": "0",
    "RAY_kill_child_processes_on_worker_exit": "0",
    "RAY_kill_child_processes_on_worker_exit_with_raylet_subreaper": "0",
}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    metrics_port = free_port(n=4)
    cfg = app_config(metrics_port)
    fault_file = tmp_path_factory.mktemp("fault") / "fault.json"
    fault_file.write_text("{}")
    with LocalCluster(
        http_port=free_port(),
        num_cpus=2,
        extra_env={FAULT_FILE_ENV: str(fault_file), **RAY_ORPHAN_CLEANUP_OFF},
    ) as cluster:
        started = time.monotonic()
        cluster.deploy(cfg)
        print(f"\n[serve] 2 replicas ready in {time.monotonic() - started:.1f} s")
        with httpx.Client(base_url=cluster.url, headers=AUTH, timeout=120) as http:
            yield SimpleNamespace(
                cfg=cfg,
                cluster=cluster,
                url=cluster.url,
                http=http,
                metrics_port=metrics_port,
                fault_file=fault_file,
            )


def complete(http: httpx.Client, max_tokens: int = 2, prompt: str = "hello", **extra) -> httpx.Response:
    return http.post(
        "/v1/completions", json={"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, **extra}
    )


def replica_samples(app, name: str) -> dict[str, float]:
    """``{replica id: value}`` of the series ``name`` scraped from every replica's metrics endpoint now."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for i in range(2):
        text = httpx.get(f"http://127.0.0.1:{app.metrics_port + i}/metrics", timeout=10).text
        for fam in text_string_to_metric_families(text):
            for sample in fam.samples:
                if sample.name == name:
                    out[sample.labels["replica"]] = sample.value
    return out


def polls_after(app, replicas: list[str], extra: int = 2) -> None:
    """Wait until Serve has polled ``record_routing_stats`` of every replica in ``replicas`` at least
    ``extra`` more times: the router then holds stats taken after everything that happened before."""
    start = replica_samples(app, "vtoken:routing_stats_polls_total")
    wait_for(
        lambda: all(
            replica_samples(app, "vtoken:routing_stats_polls_total").get(r, 0) >= start.get(r, 0) + extra
            for r in replicas
        ),
        f"{extra} routing-stats polls of {replicas}",
    )


def replicas_by_rank(app, tries: int = 30) -> dict[int, str]:
    """``{rank: replica id}`` of both replicas. The router first sees both idle (two fresh polls of each: stats
    taken while an earlier test's requests still ran would steer every request to the other one), then
    ``tries`` sequential requests name the replicas that answer; if only one answered (its KV ranked first
    every time), the other id is the one left among the replicas' metrics endpoints, and the other rank."""
    everyone = sorted(replica_samples(app, "vtoken:routing_stats_polls_total"))
    polls_after(app, everyone)
    seen: dict[int, str] = {}
    for _ in range(tries):
        r = complete(app.http)
        seen[int(r.headers["x-vtoken-rank"])] = r.headers["x-vtoken-replica"]
        if len(seen) == 2:
            return seen
    (rank, replica), (other,) = next(iter(seen.items())), [x for x in everyone if x not in seen.values()]
    return {rank: replica, 1 - rank: other}


def replica_actor_name(app, replica_id: str = "") -> str:
    """Ray's name of a replica actor of the app's deployment (with ``""``: the prefix of them all)."""
    return f"SERVE_REPLICA::{app.cfg.app_name}#{app.cfg.deployment.name}#{replica_id}"


def live_replicas(app) -> set[str]:
    """Replica ids of the deployment's live replica actors, from Ray's named-actor registry (not
    through the router, whose choice depends on load)."""
    import ray

    prefix = replica_actor_name(app)
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return {n[len(prefix) :] for n in names if n.startswith(prefix)}


# ---------------------------------------------------------------------------------------------- API
def test_openai_client_completions_chat_streaming_and_probes(app):
    import openai

    client = openai.OpenAI(base_url=f"{app.url}/v1", api_key=API_KEY, timeout=120, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]
    # temperature 0: the tiny model's greedy output never contains EOS, so lengths are exact
    done = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=8, temperature=0)
    assert done.usage.completion_tokens == 8 and isinstance(done.choices[0].text, str)
    chat = client.chat.completions.create(
        model="tiny-llama",
        max_tokens=8,
        temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 8
    chunks = list(
        client.chat.completions.create(
            model="tiny-llama",
            max_tokens=8,
            stream=True,
            temperature=0,
            stream_options={"include_usage": True},
            messages=[{"role": "user", "content": "Hi"}],
        )
    )
    assert chunks[-1].usage.completion_tokens == 8
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    streamed = list(
        client.completions.create(model="tiny-llama", prompt="hi", max_tokens=5, stream=True, temperature=0)
    )
    assert len([c for c in streamed if c.choices and c.choices[0].text is not None]) >= 5
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{app.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{app.url}/health").status_code == 200  # probes need no key
    ready = httpx.get(f"{app.url}/ready").json()
    assert ready["status"] == "ready" and ready["mode"] == "repack" and ready["vtoken:pool_blocks"] == 71
    assert httpx.get(f"{app.url}/-/healthz").status_code == 200  # Serve's proxy


def test_a_completion_says_what_eviction_cost_it(app):
    """A completion (and chat completion) carries a top-level ``vtoken`` object
    (vtoken/serve/replica/cost_field.py; ``kv_transfer_params`` back to null): the tokens it lost equal what
    the replicas' ``vtoken:evicted_tokens_total`` rose by, its context is prompt + completion − 1, and the
    replicas' ``vtoken:request_evicted_share`` histogram counted it once. The same request streamed with
    ``include_usage`` (greedy: the same tokens, the same evictions) has it in its usage chunk."""
    ev0 = replica_samples(app, "vtoken:evicted_tokens_total")
    n0 = replica_samples(app, "vtoken:request_evicted_share_count")
    r = complete(app.http, max_tokens=24, prompt=PROMPT * 3, temperature=0)
    body = r.json()
    cost, usage = body["vtoken"], body["usage"]
    assert r.status_code == 200 and body["kv_transfer_params"] is None
    assert cost["context_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] - 1
    assert cost["evicted_tokens"] > 0  # H2O at budget 0.5 over every token (app_config)
    assert cost["evicted_share"] == pytest.approx(cost["evicted_tokens"] / cost["context_tokens"], abs=1e-6)
    assert 0.0 < cost["evicted_attention_mass"] < 1.0

    def delta(name: str, start: dict) -> float:
        return sum(v - start.get(k, 0.0) for k, v in replica_samples(app, name).items())

    wait_for(lambda: delta("vtoken:request_evicted_share_count", n0) == 1, "the replica's histogram counted it")
    assert delta("vtoken:evicted_tokens_total", ev0) == cost["evicted_tokens"]
    chat = app.http.post(
        "/v1/chat/completions",
        json={"model": "tiny-llama", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
    ).json()
    assert chat["vtoken"]["context_tokens"] == chat["usage"]["total_tokens"] - 1
    body = {"prompt": PROMPT * 3, "max_tokens": 24, "temperature": 0, "stream": True}
    with app.http.stream(
        "POST", "/v1/completions", json={"model": "tiny-llama", **body, "stream_options": {"include_usage": True}}
    ) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    usage = events[-1]  # the usage chunk carries the cost; the text chunks do not
    assert usage["choices"] == [] and all("vtoken" not in e for e in events[:-1])
    same = ("evicted_tokens", "context_tokens", "evicted_share")  # greedy: the same tokens and evictions
    assert {k: usage["vtoken"][k] for k in same} == {k: cost[k] for k in same}
    # the prompt now hits the prefix cache: its tokens' attention statistics start from other queries
    assert 0.0 < usage["vtoken"]["evicted_attention_mass"] < 1.0


def test_pressure_with_memory_to_spare_is_stock_vllm_and_costs_nothing(app):
    """Through the served stack: a request with ``trigger: pressure`` (its budget is only a floor) on a pool
    with room to spare evicts nothing and its greedy text equals a request vToken leaves alone (mode none)."""
    body = {"prompt": PROMPT * 3, "max_tokens": 24, "temperature": 0}
    stock = complete(app.http, **body, vllm_xargs={"vtoken.mode": "none"}).json()
    pressed = complete(app.http, **body, vllm_xargs={"vtoken.trigger": "pressure"}).json()
    assert pressed["choices"][0]["text"] == stock["choices"][0]["text"]
    assert pressed["vtoken"]["evicted_tokens"] == 0 and pressed["vtoken"]["evicted_share"] == 0.0
    assert pressed["vtoken"]["context_tokens"] == stock["vtoken"]["context_tokens"] > 24


def test_malformed_requests_get_4xx_with_openai_errors_and_never_5xx(app):
    cases = malformed_cases("tiny-llama", API_KEY, LIMITS)
    assert len(cases) >= 200
    statuses, bad = Counter(), []
    started = time.monotonic()
    for case in cases:
        r = httpx.request(case.method, f"{app.url}{case.path}", content=case.content, headers=case.headers, timeout=60)
        statuses[r.status_code // 100 * 100] += 1
        try:
            err = r.json()["error"]
            ok = 400 <= r.status_code < 500 and err["message"] and "type" in err and err["code"] == r.status_code
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            bad.append(f"{case.name}: {r.status_code} {r.text[:200]}")
    print(f"\n[fuzz] {len(cases)} malformed requests in {time.monotonic() - started:.1f} s: {dict(statuses)}")
    assert statuses[500] == 0, bad
    assert not bad, "\n".join(bad)
    assert complete(app.http, max_tokens=3).status_code == 200  # still serving


# ------------------------------------------------------------------------------------------ routing
def test_router_steers_new_requests_to_the_replica_with_more_free_kv(app):
    """Each replica runs one long generation, so queue lengths are equal (1 and 1) and Serve's default
    power-of-two router splits new requests ≈50/50. One of the two requests has a ≈1000-token prompt,
    the other a 2-token one: short requests sent meanwhile must go to the replica with more free KV."""
    done = threading.Event()
    holders: dict[str, str] = {}
    started = {"big": threading.Event(), "small": threading.Event()}

    def generate(kind: str, prompt: str) -> None:
        body = {
            "model": "tiny-llama",
            "prompt": prompt,
            "max_tokens": 900,
            "stream": True,
            "ignore_eos": True,
        }
        with (
            httpx.Client(headers=AUTH, timeout=300) as c,
            c.stream("POST", f"{app.url}/v1/completions", json=body) as r,
        ):
            holders[kind] = r.headers["x-vtoken-replica"]
            for _ in r.iter_lines():
                started[kind].set()
        done.set()

    big = threading.Thread(target=generate, args=("big", PROMPT * 40), daemon=True)
    big.start()
    assert started["big"].wait(120)
    # the big request's KV is in its replica's stats, and the router has polled them since
    wait_for(
        lambda: replica_samples(app, "vtoken:held_blocks").get(holders["big"], 0) >= 8,
        "the big request's blocks in its replica's stats",
    )
    polls_after(app, [holders["big"]])
    small = threading.Thread(target=generate, args=("small", "hi"), daemon=True)
    small.start()
    assert started["small"].wait(120)
    assert holders["big"] != holders["small"]
    polls_after(app, [holders["big"], holders["small"]])  # the router knows both replicas are busy
    targets = []
    for _ in range(30):
        r = complete(app.http, max_tokens=2)
        assert r.status_code == 200
        if done.is_set():
            break
        targets.append(r.headers["x-vtoken-replica"])
    big.join(300)
    small.join(300)
    to_free = sum(t == holders["small"] for t in targets)
    print(
        f"\n[router] equal queues (1 and 1), unequal KV: {to_free}/{len(targets)} short requests went to the "
        "replica with more free KV (power of two would split about 50/50)"
    )
    assert len(targets) >= 6, "the long requests finished too early to measure"
    assert to_free / len(targets) >= 0.8


def test_stale_or_missing_stats_do_not_break_routing(app):
    ranks = replicas_by_rank(app)
    assert sorted(ranks) == [0, 1] and len(set(ranks.values())) == 2, ranks
    try:
        # rank 1 reports stats polled an hour ago: it drops to the last rank, rank 0 takes the traffic
        app.fault_file.write_text(json.dumps({"stats_fault": {"ranks": [1], "mode": "stale"}}))
        polls_after(app, [ranks[1]])  # a poll that read the fault file has reached the router
        targets = [complete(app.http).headers["x-vtoken-replica"] for _ in range(12)]
        fresh = sum(t == ranks[0] for t in targets)
        print(f"\n[router] stale stats on rank 1: {fresh}/12 requests to the fresh replica")
        assert fresh >= 10, f"fresh replica {ranks[0]}, stale {ranks[1]}: targets {targets}"
        # no replica reports stats: power-of-two-choices, both replicas still serve
        app.fault_file.write_text(json.dumps({"stats_fault": {"ranks": [0, 1], "mode": "missing"}}))
        polls_after(app, [ranks[0], ranks[1]])
        responses = [complete(app.http) for _ in range(16)]
        assert all(r.status_code == 200 for r in responses)
        spread = Counter(r.headers["x-vtoken-replica"] for r in responses)
        print(f"[router] no stats at all: fallback spread {sorted(spread.values())}")
        assert len(spread) == 2, f"power-of-two fallback sent all 16 to {spread}"
    finally:
        app.fault_file.write_text("{}")


# ------------------------------------------------------------------------------------------ metrics
def test_prometheus_scrapes_kv_and_sla_series_that_move(app):
    targets = [f"127.0.0.1:{app.metrics_port + i}" for i in range(4)]
    with PrometheusServer(targets, port=free_port()) as prom:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(prom.query("vtoken:kv_utilization")) < 2:
            time.sleep(1)
        before = {
            q: _value(prom, q)
            for q in (
                "sum(vtoken:requests_total)",
                "sum(vtoken:evicted_tokens_total)",
                "sum(vtoken:ttft_seconds_count)",
            )
        }
        body = {"model": "tiny-llama", "prompt": PROMPT * 6, "max_tokens": 300, "ignore_eos": True}
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda _: app.http.post("/v1/completions", json=body), range(4)))
        assert all(r.status_code == 200 for r in results)
        # Prometheus has scraped every replica after the requests: its request counter moved by all four
        total = "sum(vtoken:requests_total)"
        wait_for(lambda: _value(prom, total) >= before[total] + 4, "Prometheus to scrape the four requests", 60, 0.5)
        replicas = {s["metric"]["replica"] for s in prom.query("vtoken:kv_utilization")}
        assert len(replicas) == 2
        for name in (
            "vtoken:live_tokens",
            "vtoken:held_blocks",
            "vtoken:packing_bound_blocks",
            "vtoken:naive_blocks",
            "vtoken:fragmentation_ratio",
            "vtoken:free_kv_tokens",
            "vtoken:slo_met_total",
            "vtoken:reclaimed_blocks_total",
            "vtoken:repack_moves_total",
            "vtoken:repack_seconds_bucket",
            "vtoken:tpot_seconds_bucket",
            "vllm:kv_cache_usage_perc",
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:generation_tokens_total",
        ):
            series = prom.query(name)
            assert series and all({"replica", "deployment", "application"} <= s["metric"].keys() for s in series), name
        assert _value(prom, "max(max_over_time(vtoken:held_blocks[2m]))") > 0
        assert _value(prom, "max(max_over_time(vtoken:kv_utilization[2m]))") > 0
        assert _value(prom, "max(max_over_time(vllm:kv_cache_usage_perc[2m]))") > 0
        after = {q: _value(prom, q) for q in before}
        print(f"\n[prometheus] before {before} after {after}")
        assert after["sum(vtoken:requests_total)"] >= before["sum(vtoken:requests_total)"] + 4
        assert after["sum(vtoken:ttft_seconds_count)"] >= before["sum(vtoken:ttft_seconds_count)"] + 4
        assert after["sum(vtoken:evicted_tokens_total)"] > before["sum(vtoken:evicted_tokens_total)"]
        # every Grafana panel (dashboards/build.py) returns data against this real app's Prometheus
        from support.ops import load_module
        from support.paths import ROOT

        build = load_module(ROOT / "dashboards" / "build.py")
        empty = [
            (name, title)
            for name, model in build.dashboards().items()
            for title, expr in build.panel_queries(model)
            if not prom.query(build.concrete(expr, rate="1m", range_="5m"))
        ]
        assert not empty, f"dashboard panels without data: {empty}"


def _value(prom: PrometheusServer, promql: str) -> float:
    result = prom.query(promql)
    return float(result[0]["value"][1]) if result else 0.0


# --------------------------------------------------------------------------------------- KV pressure
BURST, BURST_PROMPT, BURST_TOKENS = 16, PROMPT * 30, 300  # 840 + 300 tokens each (tiny Llama's tokenizer)


def pool_bound(sample: dict[str, float], max_num_seqs: int) -> bool:
    """A replica's scrape where only the KV pool can be what holds requests back: some wait, while fewer run
    than ``max_num_seqs`` and than the admission limit (``vtoken:admission_limit``; absent = no limit)."""
    running, waiting = sample.get("vllm:num_requests_running", 0.0), sample.get("vllm:num_requests_waiting", 0.0)
    return waiting >= 1 and running < max_num_seqs and running < sample.get("vtoken:admission_limit", math.inf)


def test_pool_bound_needs_waiting_below_both_caps():
    assert pool_bound({"vllm:num_requests_running": 3, "vllm:num_requests_waiting": 5}, 8)
    assert not pool_bound({"vllm:num_requests_running": 8, "vllm:num_requests_waiting": 5}, 8)  # max_num_seqs
    assert not pool_bound(
        {"vllm:num_requests_running": 3, "vllm:num_requests_waiting": 5, "vtoken:admission_limit": 3}, 8
    )  # the admission limit holds them
    assert not pool_bound({"vllm:num_requests_running": 3, "vllm:num_requests_waiting": 0}, 8)


def test_kv_pool_exhaustion_queues_or_preempts_and_every_request_completes(app):
    """16 concurrent distinct 840-token prompts (27 blocks each before eviction, ≈16 with H2O 50 % while they decode)
    on two 71-block pools: each pool runs 3-4 of them, fewer than ``max_num_seqs`` (8) and the admission
    limit, so the requests that wait are held back by the pool alone — and every one completes."""

    def body(i: int) -> dict:  # a distinct first block each: no prefix-cache hit shares the prompts' blocks
        return {
            "model": "tiny-llama",
            "prompt": f"Request {i}. {BURST_PROMPT}",
            "max_tokens": BURST_TOKENS,
            "ignore_eos": True,
        }

    names = (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vtoken:admission_limit",
        "vtoken:kv_utilization",
    )
    max_num_seqs = app.cfg.engine.max_num_seqs
    scrapes: list[dict[str, float]] = []
    stop = threading.Event()

    def watch() -> None:  # every replica's gauges while the burst runs (the metrics endpoints, 5 Hz)
        while not stop.is_set():
            per_name = {name: replica_samples(app, name) for name in names}
            for replica in per_name["vtoken:kv_utilization"]:
                scrapes.append({name: v[replica] for name, v in per_name.items() if replica in v})
            time.sleep(0.2)

    preempted0 = sum(replica_samples(app, "vllm:num_preemptions_total").values())
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    started = time.monotonic()
    try:
        with ThreadPoolExecutor(BURST) as pool:
            results = list(
                pool.map(lambda i: app.http.post("/v1/completions", json=body(i), timeout=600), range(BURST))
            )
    finally:
        stop.set()
        watcher.join(10)
    assert [r.status_code for r in results] == [200] * BURST
    assert all(r.json()["usage"]["completion_tokens"] == BURST_TOKENS for r in results)
    spread = sorted(Counter(r.headers["x-vtoken-replica"] for r in results).values())
    preempted = sum(replica_samples(app, "vllm:num_preemptions_total").values()) - preempted0
    bound = [s for s in scrapes if pool_bound(s, max_num_seqs)]
    peak_kv = max((s.get("vtoken:kv_utilization", 0.0) for s in scrapes), default=0.0)
    print(
        f"\n[kv] {BURST} x (≈{results[0].json()['usage']['prompt_tokens']}+{BURST_TOKENS}) tokens on 2 x 71 "
        f"blocks: all done in {time.monotonic() - started:.1f} s, spread {spread}, peak kv_utilization "
        f"{peak_kv:.2f}, preemptions {preempted:.0f}, pool-bound scrapes {len(bound)} of {len(scrapes)} "
        f"(peak running there {max((s['vllm:num_requests_running'] for s in bound), default=0):.0f})"
    )
    assert peak_kv >= 0.8, "the burst never filled a pool: the test would prove nothing"
    # ≥ 2 s of scrapes (5 Hz) with requests waiting that neither max_num_seqs nor admission held back
    assert len(bound) >= 10, f"the pool alone never held requests back: {scrapes[:: max(len(scrapes) // 20, 1)]}"
    # the engines went idle after the burst: each checked its KV invariants (pool, tables) and found none broken
    checks = wait_for(
        lambda: (
            (v := replica_samples(app, "vtoken:invariant_checks_total")) and len(v) == 2 and min(v.values()) >= 1 and v
        ),
        "an idle KV invariant check on both replicas",
        30,
        0.5,
    )
    violations = replica_samples(app, "vtoken:invariant_violations_total")
    print(f"[kv] invariant checks {checks}, violations {violations}")
    assert set(violations) == set(checks) and not any(violations.values()), violations


def test_vllm_bench_serve_gets_completions(app):
    """`vllm bench serve` (vLLM's own load generator) pointed at the Serve app."""
    from vtoken.models.tiny import tiny_model

    cmd = vllm_cli_command(
        sys.executable,
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        app.url,
        "--endpoint",
        "/v1/completions",
        "--model",
        "tiny-llama",
        "--tokenizer",
        str(tiny_model("llama")),
        "--dataset-name",
        "random",
        "--random-input-len",
        "64",
        "--random-output-len",
        "16",
        "--num-prompts",
        "8",
        "--max-concurrency",
        "4",
        "--ignore-eos",
        "--goodput",
        "ttft:2000",
        "tpot:200",
    )
    env = {**os.environ, "OPENAI_API_KEY": API_KEY}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    summary = [
        line
        for line in out.stdout.splitlines()
        if line.startswith(("Successful requests", "Request goodput", "Output token throughput"))
    ]
    print("\n[bench] " + "\n[bench] ".join(summary))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert any(line.split()[-1] == "8" for line in summary if "Successful requests" in line)


# ------------------------------------------------------------------------------------------- faults
ENGINE_EXIT_BOUND_S = 20.0  # lifetime.py: a 1 s poll, then SIGTERM (vLLM's shutdown), os._exit 5 s later


def test_replica_killed_under_load_is_retried_or_503_and_serve_restores_it(app):
    import ray
    from ray import serve

    replicas = live_replicas(app)
    assert len(replicas) == 2, replicas
    victim = min(replicas)
    outcomes: list[str] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        body = {
            "model": "tiny-llama",
            "prompt": PROMPT,
            "max_tokens": 200,
            "stream": i % 4 == 0,
            "ignore_eos": True,
        }
        try:
            with httpx.Client(headers=AUTH, timeout=180) as c:
                if body["stream"]:
                    with c.stream("POST", f"{app.url}/v1/completions", json=body) as r:
                        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
                    last = lines[-1] if lines else ""
                    outcome = (
                        "200"
                        if last == "data: [DONE]"
                        else ("503-stream" if '"code": 503' in last else f"broken-stream:{r.status_code}:{last[:80]}")
                    )
                else:
                    r = c.post(f"{app.url}/v1/completions", json=body)
                    outcome = str(r.status_code) + ("-retried" if r.headers.get("x-vtoken-retries") else "")
                    if r.status_code == 503:
                        assert r.json()["error"]["code"] == 503
        except Exception as exc:  # noqa: BLE001 - every failure mode is recorded and asserted below
            outcome = f"exception:{type(exc).__name__}"
        with lock:
            outcomes.append(outcome)

    handle = ray.get_actor(replica_actor_name(app, victim), namespace="serve")
    replica_pid = ray.get(handle.__ray_call__.remote(lambda replica: os.getpid()), timeout=30)
    below = procs.with_descendants([replica_pid], procs.snapshot()) - {replica_pid}
    tree = [(pid, procs.comm(pid), procs.title(pid)) for pid in sorted(below)]
    print(f"\n[kill] below the replica: {tree}")
    # VLLM::EngineCore, its VLLM::Worker and multiprocessing's resource tracker: every one must exit. Named
    # by title, not only by comm: a CI run once showed the worker's comm still "python"
    assert any(procs.title(pid).startswith("VLLM::EngineCore") for pid in below), tree
    descendants = sorted(below)
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(one, i) for i in range(48)]
        wait_for(
            lambda: replica_samples(app, "vllm:num_requests_running").get(victim, 0) >= 1,
            "the victim replica to be running requests",
            60,
            0.1,
        )  # killed under load, not idle
        killed_at = time.monotonic()
        os.kill(replica_pid, signal.SIGKILL)  # the replica's process alone (issue 29), not its group
        # its engine processes exit on their own (vtoken/vllm/lifetime.py), before Serve's replacement needs
        # room: timed from the kill, while the clients still run
        # (procs.alive: not a zombie — an exited process only waits for its new parent to reap it)
        wait_for(
            lambda: not procs.alive(descendants),
            "the killed replica's engine processes to exit",
            ENGINE_EXIT_BOUND_S,
            0.2,
            lambda: [(pid, procs.title(pid)) for pid in procs.alive(descendants)],
        )
        engine_gone_s = time.monotonic() - killed_at
        for f in futures:
            f.result()
    recovered = None
    while time.monotonic() - killed_at < 240:
        status = serve.status().applications[app.cfg.app_name]
        dep = status.deployments[app.cfg.deployment.name]
        if status.status == "RUNNING" and dep.replica_states.get("RUNNING", 0) == 2:
            now = live_replicas(app)
            answered = {complete(app.http).headers.get("x-vtoken-replica") for _ in range(4)}
            if len(now) == 2 and victim not in now and answered <= now:
                recovered = time.monotonic() - killed_at
                break
        time.sleep(1)
    tally = Counter(outcomes)
    print(
        f"\n[kill] outcomes {dict(tally)}; processes {descendants} gone "
        f"{engine_gone_s:.1f} s after the SIGKILL; replica replaced and serving after "
        f"{recovered if recovered is None else round(recovered, 1)} s"
    )
    assert set(tally) <= {"200", "200-retried", "503", "503-stream"}, tally
    assert tally["200"] + tally["200-retried"] >= 24
    assert recovered is not None
    assert complete(app.http).status_code == 200
