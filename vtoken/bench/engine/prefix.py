"""``vtoken bench prefix``: prefix-cache hits and TTFT of sequential chat-like requests that share a system
prompt, per reclamation mode, in one in-process vLLM engine (docs/vllm-integration.md, "Prefix caching").

Each request is a fixed system prompt plus its own user tokens; requests arrive one after another (each
finishes before the next is submitted), the light-load case in which no running request protects the
prompt's blocks. Per variant the prefix cache is reset, then the same prompts run with the variant's mode
set per request (``none`` = no eviction in the hooked engine). Per request: ``num_cached_tokens`` (vLLM's
prefix-cache hit count) and TTFT (submission to the first sampled token, the engine stepped by hand);
per variant: the engine's vToken counter deltas (moves, copy-on-write copies and blocks, fallbacks).
Variants are interleaved over ``repeats`` runs, after one unmeasured warm-up request. Side effects: starts one
engine in this process.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import numpy as np

from vtoken.bench.report import command_line
from vtoken.bench.settings import EVICTING
from vtoken.core.config import VTokenConfig

# the engine's config, declared once: every token may be evicted (scope all); the mode is set per request
# (``--modes``), so ``mode`` is the bench's own (``settings.configure``)
BASE = replace(EVICTING, budget=0.3)
OWN = {"mode": "--modes picks the modes, one per request"}
# the top-level keys ``run_prefix`` returns (``report.emit`` adds ``environment``); tests/integration/test_bench.py
# holds the committed prefix-*.json to them
REPORT_KEYS = frozenset(
    {
        "command",
        "model",
        "block_size",
        "policy",
        "budget",
        "requests",
        "system_len",
        "user_len",
        "gen_len",
        "repeats",
        "rows",
        "runs",
    }
)


def _one(llm, rid: str, prompt: list[int], params) -> tuple[float, int, list[int]]:
    """(TTFT seconds, prefix-cache hit tokens, generated ids) of one request run alone."""
    eng = llm.llm_engine
    t0 = time.perf_counter()
    eng.add_request(rid, {"prompt_token_ids": prompt}, params)
    ttft, hits, tokens = None, 0, []
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id != rid:
                continue
            if ttft is None and out.outputs and out.outputs[0].token_ids:
                ttft = time.perf_counter() - t0
            hits = out.num_cached_tokens or hits
            tokens = list(out.outputs[0].token_ids)
    return float(ttft or 0.0), int(hits), tokens


def run_prefix(
    model: str,
    cfg: VTokenConfig,
    modes: list[str],
    requests: int,
    system_len: int,
    user_len: int,
    gen_len: int,
    repeats: int,
    seed: int,
) -> dict:
    """Every mode ``repeats`` times on one engine with ``cfg``'s settings (module docstring); returns the report:
    ``REPORT_KEYS``."""
    from vllm import LLM, SamplingParams

    from vtoken.models.default import resolve_model
    from vtoken.vllm import engine_kwargs
    from vtoken.vllm.offline.launch import scheduler_of, scoped_env

    path = str(resolve_model(model))
    block_size, policy, budget = cfg.block_size, cfg.policy, cfg.budget.to_json()
    with scoped_env(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1"):
        llm = LLM(
            model=path,
            dtype="float32",
            enforce_eager=True,
            seed=seed,
            max_model_len=system_len + user_len + gen_len + block_size,
            enable_prefix_caching=True,
            max_num_batched_tokens=max(system_len + user_len, 256),
            **engine_kwargs(cfg),
        )
    sched = scheduler_of(llm)
    rng = np.random.default_rng(seed)
    system = rng.integers(10, 500, system_len).tolist()
    prompts = [system + rng.integers(10, 500, user_len).tolist() for _ in range(requests)]
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    warm = SamplingParams(
        max_tokens=gen_len,
        temperature=0.0,
        ignore_eos=True,
        extra_args={"vtoken": {"mode": modes[0], "policy": policy, "budget": budget}},
    )
    _one(llm, "warm-up", rng.integers(10, 500, system_len + user_len).tolist(), warm)  # not measured
    for rep in range(repeats):
        for mode in modes:
            assert llm.reset_prefix_cache()
            c0 = sched.vtoken_stats().counters
            per = []
            for i, p in enumerate(prompts):
                params = SamplingParams(
                    max_tokens=gen_len,
                    temperature=0.0,
                    ignore_eos=True,
                    extra_args={"vtoken": {"mode": mode, "policy": policy, "budget": budget, "salt": 1000 + i}},
                )
                ttft, hits, _ = _one(llm, f"{mode}-{rep}-{i}", p, params)
                per.append({"hits": hits, "ttft_s": ttft})
            c1 = sched.vtoken_stats().counters
            delta = {
                k: getattr(c1, k) - getattr(c0, k)
                for k in ("evicted_tokens", "repack_moves", "cow_blocks", "cow_moves", "cow_fallbacks")
            }
            runs[mode].append({"requests": per, **delta})
    rows = []
    for mode in modes:
        later = [r for run in runs[mode] for r in run["requests"][1:]]
        prompt_tokens = system_len + user_len
        rows.append(
            {
                "mode": mode,
                "hits_per_request": [r["hits"] for r in runs[mode][0]["requests"]],
                "hit_rate_after_first": sum(r["hits"] for r in later) / (len(later) * prompt_tokens) if later else 0.0,
                "ttft_p50_s_after_first": statistics.median(r["ttft_s"] for r in later) if later else 0.0,
                "ttft_min_s_after_first": min(r["ttft_s"] for r in later) if later else 0.0,
                **{
                    k: statistics.median(run[k] for run in runs[mode])
                    for k in ("evicted_tokens", "repack_moves", "cow_blocks", "cow_moves", "cow_fallbacks")
                },
            }
        )
    llm.llm_engine.engine_core.shutdown()
    return {
        "command": command_line(),
        "model": model,
        "block_size": block_size,
        "policy": policy,
        "budget": budget,
        "requests": requests,
        "system_len": system_len,
        "user_len": user_len,
        "gen_len": gen_len,
        "repeats": repeats,
        "rows": rows,
        "runs": runs,
    }
