"""``trigger: pressure`` in the real engine (vtoken/vllm/scheduling/pressure.py), tiny Llama, one shared engine:
11 usable KV blocks of 32 tokens, chunked prefill (64 tokens a step), prefix caching on.

With memory to spare nothing is evicted and the output is stock vLLM's token for token; under a forced
shortage the same workload that makes vLLM preempt runs with no preemption, no request below its floor, and
every token exact against the masked HF reference (the evicted sets come from the traces). Configurations
pressure does not support are refused when the engine is constructed, by name."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
from support.engine import check_against_reference, engine_session, small_pool_engine, sp

from vtoken.errors import ConfigError
from vtoken.vllm.offline.launch import scheduler_of
from vtoken.vllm.scheduling.trace import RequestTrace

FLOOR = 0.3


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    yield from engine_session(tmp_path_factory, small_pool_engine)


def pressure(tag: str, n: int, mode: str = "repack", **extra):
    return sp(n, mode=mode, trigger="pressure", budget=FLOOR, policy="h2o", scope="all", trace_id=tag, **extra)


def run(llm, prompts, params, tag):
    """Step the engine over ``prompts`` until done; after every step, check that no pressure request is below
    its floor. Returns (outputs by request, vToken's preemption count of the run, the engine steps (of this
    run) at which a pressure round ran)."""
    eng, sched = llm.llm_engine, scheduler_of(llm)
    pre, at = sched.vtoken_stats().counters.preemptions, []
    for i, (p, s) in enumerate(zip(prompts, params)):
        eng.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, s)
    outs = {}
    for step in range(3000):
        if not eng.has_unfinished_requests():
            break
        before = sched.vtoken_stats().counters.pressure_rounds
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        at += [step] * (sched.vtoken_stats().counters.pressure_rounds - before)
        for st in sched._vt_reqs.values():
            cfg, t = st.settings.cfg, st.table
            if t is not None and cfg.trigger.value == "pressure":
                assert t.live >= cfg.kept_live(t.seen, t.prompt_len), "a request went below its floor"
    return [outs[f"{tag}-{i}"] for i in range(len(prompts))], sched.vtoken_stats().counters.preemptions - pre, at


def test_memory_to_spare_nothing_is_evicted_and_output_is_stock(engine):
    """Two requests that fit (≈ 4 blocks each of 11): pressure evicts nothing, takes no round, and its
    greedy tokens equal a stock (mode none) request's on the same prompt."""
    llm, d = engine
    p = np.random.default_rng(1).integers(10, 500, 96).tolist()
    outs, pre, rounds = run(llm, [p, p], [sp(40, mode="none", trace_id="spare-none"), pressure("spare-p", 40)], "spare")
    assert list(outs[1].outputs[0].token_ids) == list(outs[0].outputs[0].token_ids)
    assert RequestTrace.read(d / "spare-p.json").evicted == 0 and rounds == [] and pre == 0


@pytest.fixture(scope="module")
def short_prompts():
    """Three 96-token prompts sharing their first 64 tokens (prefix cache); with 150 generated tokens each
    they want 24 blocks of the 11."""
    rng = np.random.default_rng(2)
    head = rng.integers(10, 500, 64).tolist()
    return [head + rng.integers(10, 500, 32).tolist() for _ in range(3)]


def test_the_shortage_makes_stock_vllm_preempt(engine, short_prompts):
    llm, _ = engine
    _, stock_pre, _ = run(
        llm, short_prompts, [sp(150, mode="none", trace_id=f"short-none-{i}") for i in range(3)], "stock"
    )
    assert stock_pre > 0, "the workload was meant to make stock vLLM preempt"


@pytest.mark.parametrize("mode", ["repack", "reuse+repack", "naive"])
def test_shortage_evicts_instead_of_preempting_and_stays_exact(engine, ref_llama, short_prompts, mode):
    """The workload that makes stock vLLM preempt (the test above): with pressure (floor 30 %) it runs with
    no preemption, never below a floor, rounds never on consecutive steps, every token exact against the
    masked reference. Chunked prefill, a shared cached prefix; naive (the paired baseline) counts its blocks
    by the naive rule, so it needs more victims for the same blocks but does not preempt either."""
    llm, d = engine
    tag = f"short-{mode.replace('+', '-')}"
    outs, pre, rounds = run(llm, short_prompts, [pressure(f"{tag}-{i}", 150, mode) for i in range(3)], tag)
    assert pre == 0 and rounds
    assert all(b - a > 1 for a, b in itertools.pairwise(rounds)), f"rounds on consecutive steps: {rounds}"
    for i, (p, out) in enumerate(zip(short_prompts, outs)):
        trace = RequestTrace.read(d / f"{tag}-{i}.json")
        assert trace.evicted > 0 and len(trace.epochs) == 1
        check_against_reference(ref_llama, p, out, trace)


def recorded_victims(trace: RequestTrace) -> dict[int, np.ndarray]:
    """``{table size at the decision: logical positions evicted}`` of a one-epoch trace (pure)."""
    (epoch,) = trace.epochs
    placed, ev = np.asarray(epoch.placed_round), np.asarray(epoch.evicted_round)
    return {int(np.count_nonzero(placed < r)): np.flatnonzero(ev == r) for r in np.unique(ev[ev >= 0])}


def replaying(sched, plan: dict[int, np.ndarray]):
    """A pressure round for ``sched`` that evicts from its running request exactly ``plan[table.seen]``
    (when the table has that size) through the scheduler's own victim path, and nothing else."""
    from vtoken.vllm.scheduling import blocks

    def round_(work) -> None:
        start = len(work.release)
        for request in sched.running:
            st = sched._vt_reqs.get(request.request_id)
            victims = None if st is None or st.table is None else plan.pop(st.table.seen, None)
            if victims is not None:
                sched._vt_decide(request, st, work, victims=victims, cfg=sched._vt_protect(request, st))
        blocks.release(sched.kv_cache_manager.block_pool, work.release[start:])

    return round_


def test_naive_evict_replaying_the_pressure_victims_is_token_paired(engine, short_prompts):
    """The paired Naive-Evict run under pressure. Naive and repack take different rounds (the same victims
    free fewer blocks by the naive rule), so the pair is made by replay: each request runs alone in naive
    mode and evicts, at the same table sizes, exactly the tokens the repack run's pressure rounds took (its
    trace records them), through the scheduler's victim path. Tokens equal, logprobs within 1e-4."""
    llm, d = engine
    sched = scheduler_of(llm)
    outs, pre, rounds = run(llm, short_prompts, [pressure(f"pair-r-{i}", 150) for i in range(3)], "pair-r")
    assert pre == 0 and rounds
    for i, (p, out) in enumerate(zip(short_prompts, outs)):
        trace = RequestTrace.read(d / f"pair-r-{i}.json")
        plan = recorded_victims(trace)
        assert plan and min(plan) >= len(p), "replay by table size needs decisions after the prompt"
        sched._vt_pressure = replaying(sched, plan)
        try:
            (paired,), _, _ = run(llm, [p], [pressure(f"pair-n-{i}", 150, "naive")], f"pair-n-{i}")
        finally:
            del sched._vt_pressure  # the class's own round again
        assert plan == {}, f"request {i}: decisions never replayed at table sizes {sorted(plan)}"
        assert RequestTrace.read(d / f"pair-n-{i}.json").evicted == trace.evicted
        assert list(paired.outputs[0].token_ids) == list(out.outputs[0].token_ids)
        lp = [
            np.array([d_[t].logprob for d_, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in (out, paired)
        ]
        assert np.max(np.abs(lp[0] - lp[1])) <= 1e-4


def test_pressure_refusal_names_the_option():
    from vtoken.vllm.scheduling.pressure import pressure_refusal

    def cfg(tp=1, asy=False):
        return SimpleNamespace(
            parallel_config=SimpleNamespace(tensor_parallel_size=tp),
            scheduler_config=SimpleNamespace(async_scheduling=asy),
        )

    one, two = 1, 2  # KV cache groups
    assert pressure_refusal(cfg(), one) is None
    assert "tensor_parallel_size=2" in pressure_refusal(cfg(tp=2), one)
    assert "async_scheduling=True" in pressure_refusal(cfg(asy=True), one)
    assert "hybrid model (2 KV cache groups)" in pressure_refusal(cfg(), two)


def test_engine_with_pressure_and_async_scheduling_is_refused_at_construction():
    """The scheduler vLLM's engine core builds (CUDA's default async scheduling; the CPU platform forces it
    off, so it is built by hand as tests/support/scheduler.py does) refuses an engine-level
    ``trigger: pressure`` by the option's name; with ``trigger: step`` the same engine starts."""
    from support.scheduler import make_scheduler

    with pytest.raises(ConfigError, match=r"trigger 'pressure' is not supported with async_scheduling=True"):
        make_scheduler(async_scheduling=True, vtoken={"trigger": "pressure"})
    make_scheduler(async_scheduling=True, vtoken={"trigger": "step"})
    make_scheduler(async_scheduling=False, vtoken={"trigger": "pressure"})


def test_a_pressure_request_on_an_engine_that_cannot_run_it_fails_alone():
    """On an async-scheduling engine (trigger 'step'), a request asking for ``trigger: pressure`` is refused
    like any invalid override (finished with an error at the next update); another request is admitted."""
    from support.scheduler import make_request, make_scheduler

    sched = make_scheduler(async_scheduling=True)
    sched.add_request(make_request("bad", 16, 4, trigger="pressure"))
    sched.add_request(make_request("good", 16, 4))
    assert "bad" in sched.grammar_compile_error_reqs and "bad" not in sched._vt_reqs and "good" in sched._vt_reqs


def test_a_queue_longer_than_the_floors_allow_preempts_only_at_the_floors(engine, ref_llama):
    """Six requests (80 + 120 tokens) whose floors alone (2 blocks each) exceed the 11 blocks: pressure evicts
    to admit the queue, and vLLM preempts only after a round that found every request at its floor; all
    exact. (Near the floors rounds come every step, a few tokens each: the floors bind, not the margin.)"""
    llm, d = engine
    sched = scheduler_of(llm)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(10, 500, 80).tolist() for _ in range(6)]
    at_floor = sched.vtoken_stats().counters.pressure_at_floor
    outs, pre, rounds = run(llm, prompts, [pressure(f"q-{i}", 120) for i in range(6)], "q")
    assert rounds and pre <= sched.vtoken_stats().counters.pressure_at_floor - at_floor
    for i, (p, out) in enumerate(zip(prompts, outs)):
        check_against_reference(ref_llama, p, out, RequestTrace.read(d / f"q-{i}.json"))


def test_a_hybrid_engine_with_pressure_is_refused_at_construction():
    """Tiny Gemma 3 (sliding-window groups beside the global one, one shared pool): an engine-level
    ``trigger: pressure`` fails while the engine is built, naming the hybrid model, before any request."""
    import os

    from vllm import LLM

    from vtoken.core.config import VTokenConfig
    from vtoken.models.tiny import tiny_model
    from vtoken.vllm import engine_kwargs
    from vtoken.vllm.offline.launch import scoped_env

    kw = engine_kwargs(VTokenConfig(policy="h2o", budget=0.3, trigger="pressure", block_size=32))
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
    }
    with scoped_env(**env), pytest.raises(Exception) as e:
        LLM(model=str(tiny_model("gemma3")), dtype="float32", enforce_eager=True, max_model_len=448, **kw)
    err = e.value
    while err is not None and not isinstance(err, ConfigError):
        err = err.__cause__ or err.__context__
    assert err is not None and "hybrid model" in str(err) and "trigger 'pressure'" in str(err)


def test_a_wider_pressure_margin_takes_fewer_larger_rounds():
    """The engine setting ``pressure_margin`` (blocks per running request a round leaves free) reaches the
    decision: on the same shortage (hand-built scheduler, fake model; 4 requests of 24 + 120 tokens need 72
    blocks of 8, the pool has 40; floors at a quarter, never reached) margin 0 evicts just enough on nearly
    every step, 1 and 3 in ever fewer rounds that each take more, and nothing is preempted; a negative margin
    is refused by name when the engine is built."""
    from support.scheduler import drive_scheduler, make_request, make_scheduler

    def run_with(margin):
        sched = make_scheduler(
            async_scheduling=False,
            num_blocks=40,
            max_batched=256,
            vtoken={"policy": "random", "trigger": "pressure", "budget": 0.25, "pressure_margin": margin},
        )
        _, generated = drive_scheduler(sched, [make_request(f"m{i}", 24, 120) for i in range(4)], 1, lambda so: 0.01)
        assert [len(generated[f"m{i}"]) for i in range(4)] == [120] * 4
        return sched.vtoken_stats().counters

    runs = [run_with(m) for m in (0, 1, 3)]
    assert all(c.preemptions == 0 and c.pressure_at_floor == 0 for c in runs)
    rounds = [c.pressure_rounds for c in runs]
    assert rounds[0] > rounds[1] > rounds[2] > 0, rounds
    per_round = [c.pressure_evicted_tokens / c.pressure_rounds for c in runs]
    assert per_round[0] < per_round[1] < per_round[2], per_round
    with pytest.raises(ConfigError, match=r"pressure_margin must be a non-negative block count.*-1"):
        make_scheduler(async_scheduling=False, vtoken={"trigger": "pressure", "pressure_margin": -1})
