"""Hybrid models (sliding-window + global layers) in the real vLLM engine: vToken on the full-attention KV
cache group, the sliding-window groups left to vLLM (issue 27).

The tiny Gemma 3 (3 sliding-window layers of 64 tokens, 1 global layer; 4 KV cache groups) runs the paths
that cross both kinds of group — prefix caching (a hit must cover every group), chunked prefill (64 tokens a
step) and preemption (the pool is shared by all groups) — each exact against the masked HF reference, whose
sliding layers see their logical window and global layers vToken's visibility. The real Gemma 3 270M
(window 512, 5 sliding : 1 global, 18 layers) runs every policy x {naive, repack} with a context shorter
and one longer than its window. The policy x mode matrix on the tiny model is in test_vllm_engine.py.
"""

from __future__ import annotations

import gc
import json
import shutil

import numpy as np
import pytest
from support.engine import POLICIES, TOL, check_against_reference, engine_session, preempted_pair, shutdown, sp

from vtoken.vllm.offline.launch import scheduler_of, start_engine
from vtoken.vllm.offline.verify import VerifyCase, run_cases
from vtoken.vllm.scheduling.trace import RequestTrace


@pytest.fixture(scope="module")
def gemma3_tiny():
    from vtoken.models.tiny import tiny_model

    return tiny_model("gemma3")


@pytest.fixture(scope="module")
def ref_gemma3(gemma3_tiny):
    from vtoken.models.hf_reference import load_reference_model

    return load_reference_model(gemma3_tiny)


@pytest.fixture(scope="module")
def hybrid_engine(gemma3_tiny, tmp_path_factory):
    """Prefix caching on, chunked prefill (64 tokens per step), block size 32, 30 blocks shared by the 4
    groups."""
    yield from engine_session(
        tmp_path_factory,
        lambda d: start_engine(
            str(gemma3_tiny),
            32,
            d,
            enable_prefix_caching=True,
            max_num_batched_tokens=64,
            max_model_len=448,
            num_gpu_blocks_override=30,
            recent=8,
            check=True,
        ),
    )


def test_the_engine_manages_the_full_attention_group_only(hybrid_engine):
    """vLLM built 4 groups (3 sliding, 1 full); vToken's scheduler rewrites the full group's rows only."""
    llm, _ = hybrid_engine
    sched = scheduler_of(llm)
    managers = sched.kv_cache_manager.coordinator.single_type_managers
    kinds = [type(m).__name__ for m in managers]
    assert sorted(kinds) == ["FullAttentionManager"] + ["SlidingWindowManager"] * 3, kinds
    assert type(sched._vt_manager).__name__ == "FullAttentionManager"


def test_pool_need_is_the_groups_vllm_built_and_the_smallest_pool_it_starts_on(hybrid_engine, gemma3_tiny, tmp_path):
    """``pool_need`` from the config alone names the groups vLLM built (3 sliding of 64, 1 full) and their
    need at max_model_len 448 with 64 tokens in flight — 14 + 3 x 5 + 1 = 30, the fixture's pool, on which
    the engine runs; one block fewer and vLLM refuses to start (what ``vtoken serve`` now says first)."""
    from vtoken.vllm.scheduling.pool_need import pool_shape

    llm, _ = hybrid_engine
    sched = scheduler_of(llm)
    shape = pool_shape(sched.vllm_config)
    built = [getattr(g.kv_cache_spec, "sliding_window", None) for g in sched.kv_cache_config.kv_cache_groups]
    assert sorted(shape.windows, key=str) == sorted(built, key=str) == [64, 64, 64, None]
    assert shape.need(448) == sched.kv_cache_config.num_blocks == 30
    with pytest.raises(ValueError, match="To serve at least one request"):
        start_engine(
            str(gemma3_tiny),
            32,
            str(tmp_path),
            max_num_batched_tokens=64,
            max_model_len=448,
            num_gpu_blocks_override=29,
        )


def test_window_blocks_make_the_free_count_the_whole_pools(hybrid_engine):
    """Mid-run, the snapshot's free blocks (pool − held − window) equal vLLM's own free-block count: the
    sliding groups' blocks are counted as taken (per group at most the window and a 64-token prefill chunk,
    ⌈(64 + 64) / 32⌉ + 1 blocks, then ⌈64/32⌉ + 1 while decoding; the null block stands in for the rest of
    the row); with nothing running both are back to the whole pool."""
    llm, _ = hybrid_engine
    eng, sched = llm.llm_engine, scheduler_of(llm)
    pool = sched.kv_cache_manager.block_pool
    prompt = np.random.default_rng(7).integers(10, 500, 200).tolist()
    eng.add_request("wb", {"prompt_token_ids": prompt}, sp(40, mode="repack", budget=64))
    seen = []
    while eng.has_unfinished_requests():
        eng.step()
        snap = sched.vtoken_stats()
        if snap.num_requests:
            seen.append((snap.window_blocks, snap.held_blocks, snap.free_blocks, pool.get_num_free_blocks()))
    assert seen and all(free == vllm_free for *_, free, vllm_free in seen), seen
    assert all(0 < window <= 3 * 5 for window, *_ in seen), seen  # 3 sliding groups, 64-token windows
    assert seen[-1][0] <= 3 * 3, seen  # decoding
    assert seen[-1][0] < 3 * -(-(200 + 40) // 32)  # the windows hold less than full rows would
    idle = sched.vtoken_stats()
    assert (idle.window_blocks, idle.held_blocks, idle.free_blocks) == (0, 0, pool.get_num_free_blocks())


def test_prefix_cache_hits_across_groups_and_stays_exact(hybrid_engine, ref_gemma3):
    """vLLM's hybrid prefix cache hits where every group cached the blocks: a sliding-window group caches
    the window at the end of a prompt, so a later prompt that extends an earlier one (multi-turn) hits it;
    a shared prefix that ends mid-prompt does not, with or without vToken. B runs; A (repack) extends B's
    prompt, hits its 5 full blocks in every group and evicts from them (copy on write: the cached blocks are
    replaced, never rewritten); C extends B's prompt too and hits the same 160 tokens. All exact."""
    llm, d = hybrid_engine
    rng = np.random.default_rng(1)
    pb = rng.integers(10, 500, 168).tolist()
    pa, pc = (pb + rng.integers(10, 500, 40).tolist() for _ in range(2))
    runs = {}
    for tag, prompt, params in (
        ("b", pb, sp(8, mode="none", trace_id="h-b")),
        ("a", pa, sp(80, mode="repack", budget=0.3, trace_id="h-a")),
        ("c", pc, sp(8, mode="none", trace_id="h-c")),
    ):
        out = llm.generate([{"prompt_token_ids": prompt}], [params], use_tqdm=False)[0]
        runs[tag] = RequestTrace.read(d / f"h-{tag}.json")
        check_against_reference(ref_gemma3, prompt, out, runs[tag])
    assert runs["a"].epochs[0].hits == 160 and runs["a"].evicted > 0 and runs["a"].cow_blocks > 0
    assert runs["c"].epochs[0].hits == 160  # nobody rewrote the cached blocks


def test_preemption_over_a_pool_the_groups_share_is_exact(hybrid_engine, ref_gemma3):
    """X (no eviction) grows until the 30-block pool (shared by the sliding groups' windows and the full
    group) forces vLLM to preempt Y (repack, 48-token budget); Y recomputes from its logical tokens and
    every generated token matches the HF reference of the epoch that produced it."""
    llm, d = hybrid_engine
    ty = preempted_pair(llm, d, ref_gemma3, "hp", 360, 300)
    assert ty.evicted > 0 and max(ty.live_tokens) <= 48 + 64


@pytest.mark.parametrize("window,kinds", [(48, "sfsf"), (96, "ssff")], ids=["alternating-48", "half-96"])
def test_other_windows_and_global_ratios_are_exact(window, kinds, gemma3_tiny, tmp_path):
    """Held-out shapes of the tiny Gemma 3: alternating sliding and global layers with a window of 48 (not a
    multiple of the block size) and a 2 : 2 split with a window of 96 — each one full-attention group beside
    one sliding-window group; every policy in naive and repack equals the masked HF reference and its pair."""
    from vtoken.models.hf_reference import load_reference_model

    path = tmp_path / "model"
    shutil.copytree(gemma3_tiny, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(
        sliding_window=window, layer_types=["sliding_attention" if k == "s" else "full_attention" for k in kinds]
    )
    (path / "config.json").write_text(json.dumps(cfg))
    llm = start_engine(str(path), 32, str(tmp_path), max_model_len=512)
    try:
        groups = scheduler_of(llm).kv_cache_manager.coordinator.single_type_managers
        assert sorted(type(m).__name__ for m in groups) == ["FullAttentionManager", "SlidingWindowManager"]
        results = run_cases(
            path,
            32,
            [VerifyCase(p, m, 0.3) for p in POLICIES for m in ("naive", "repack")],
            llm=llm,
            trace_dir=str(tmp_path),
            prompt_len=150,
            max_tokens=24,
            reference_model=load_reference_model(path),
        )
    finally:
        shutdown(llm)
    for r in results:
        assert r.match and r.max_abs_logprob_diff <= TOL and r.paired_naive_match, r.case.key()


@pytest.mark.slow
@pytest.mark.parametrize("prompt_len", [160, 700])
def test_gemma3_270m_every_policy_and_mode_is_exact(prompt_len, tmp_path):
    """The real hybrid model (window 512): with a context inside the window (160 + 16 tokens) and past it
    (700 + 16), every policy in repack and naive gives the masked HF reference's greedy tokens, and the
    two modes the same tokens (paired decisions); repack holds fewer blocks than naive for most policies.
    Each policy's pair runs on its own (as ``vtoken verify`` does): in a batch of 16 the CPU kernel's float
    sums depend on the batch, and Scissorhands' threshold counts at 700 tokens flip on such near-ties."""
    from vtoken.models.default import resolve_model
    from vtoken.models.hf_reference import load_reference_model

    path = resolve_model("gemma3-270m")
    reference = load_reference_model(path)
    llm = start_engine(str(path), 32, str(tmp_path), max_model_len=1024)
    results = []
    try:
        for policy in [*POLICIES, "snapkv"]:
            results += run_cases(
                path,
                32,
                [VerifyCase(policy, m, 0.3) for m in ("naive", "repack")],
                llm=llm,
                trace_dir=str(tmp_path),
                prompt_len=prompt_len,
                max_tokens=16,
                reference_model=reference,
            )
    finally:
        shutdown(llm)
        gc.collect()
    for r in results:
        key = r.case.key()
        assert r.match and r.max_abs_logprob_diff <= 10 * TOL, (key, r.max_abs_logprob_diff)
        assert r.paired_naive_match and r.evicted_tokens > 0, key
    by = {(r.case.policy, r.case.mode): r for r in results}
    assert (
        sum(
            by[(p, "repack")].retained_blocks_mean < by[(p, "naive")].retained_blocks_mean
            for p in [*POLICIES, "snapkv"]
        )
        >= 4
    )
