"""Fidelity to the full cache on long generations (short prompt, long answer: decode-time eviction).

Task-independent, so it holds for any model. Per prompt (a short window of prose):

1. the full cache generates ``tokens`` greedy tokens — the *teacher* continuation;
2. every point generates greedily too: **tokens until the first divergence** from the teacher;
3. teacher forcing: prompt + teacher continuation as one prompt, fed in chunks of one block so the
   policy evicts as the continuation grows (between chunks, as it does between decode steps), with the
   top-``k`` log-probabilities of every position; per continuation position, **top-1 agreement** with
   the full cache's teacher-forced run and a **KL lower bound** KL(full ‖ point). The request's
   ``prompt_len`` is the short prompt's, so the continuation's tokens are evictable as generated ones
   (``scope: generated``, ``prompt_tail`` and question-aware scores see the prompt the greedy run has;
   before 2026-12-03 they saw prompt + continuation as the prompt, so decode-only points evicted nothing
   here).

The KL bound: both runs return their own top-k; the tokens in both sets stay separate bins and every
other token goes to one "rest" bin. KL of the coarse-grained distributions is ≤ the true KL (data
processing inequality), so the figure never flatters a policy by more than the bins hide.

The pure metric functions are here; the runner needs an engine (``run_fidelity``).
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import replace

from vtoken.bench.quality.requests import blocks_summary, run_on_engine
from vtoken.bench.quality.tasks import TextWindow, bos_ids, prose_sources

TOP_K = 20  # vLLM's default max_logprobs
FIDELITY_TOP1_BOUND = 0.9  # stated before measuring: a point keeps fidelity when its mean top-1 agreement ≥ this


def fidelity_prompts(tokenizer, tokens: int, count: int, seed: int) -> list[TextWindow]:
    """``count`` prompts of ``tokens`` tokens, round-robin over the prose sources at seeded offsets (pure)."""
    rng = random.Random(seed)
    sources = prose_sources()
    names = list(sources)  # held-out passages first
    ids = {n: tokenizer(sources[n], add_special_tokens=False)["input_ids"] for n in names}
    out, bos = [], bos_ids(tokenizer)  # Gemma 3: <bos> first, in place of the window's first token
    for i in range(count):
        name = names[i % len(names)]
        offset = rng.randint(0, len(ids[name]) - tokens)
        out.append(TextWindow(f"fid-{i}", name, offset, tuple(bos + ids[name][offset : offset + tokens - len(bos)])))
    return out


def first_divergence(teacher: list[int] | tuple[int, ...], tokens: list[int] | tuple[int, ...]) -> int:
    """Tokens generated before the first one that differs from the teacher's (all of them if none does)."""
    for i, (a, b) in enumerate(zip(teacher, tokens)):
        if a != b:
            return i
    return min(len(teacher), len(tokens))


def _top1(dist: dict[int, float]) -> int:
    return max(dist, key=dist.get)


def kl_lower_bound(full: dict[int, float], point: dict[int, float]) -> float:
    """KL(full ‖ point) of the two top-k log-probability maps coarse-grained to (shared tokens, rest)."""
    shared = full.keys() & point.keys()
    kl = 0.0
    for t in shared:
        p = math.exp(full[t])
        kl += p * (full[t] - point[t])
    p_rest = max(0.0, 1.0 - sum(math.exp(full[t]) for t in shared))
    q_rest = max(1e-12, 1.0 - sum(math.exp(point[t]) for t in shared))
    if p_rest > 0:
        kl += p_rest * math.log(p_rest / q_rest)
    return max(0.0, kl)


def teacher_forced(full: list[dict[int, float]], point: list[dict[int, float]]) -> dict:
    """Per-position comparison of two teacher-forced runs over the same continuation."""
    agree = [_top1(f) == _top1(p) for f, p in zip(full, point)]
    kls = [kl_lower_bound(f, p) for f, p in zip(full, point)]
    return {"top1_agreement": statistics.fmean(agree), "kl_lower_bound": statistics.fmean(kls)}


def _dists(output, start: int) -> list[dict[int, float]]:
    """The prompt log-probability maps from position ``start`` on (``{token: logprob}`` per position)."""
    return [{t: lp.logprob for t, lp in d.items()} for d in output.prompt_logprobs[start:]]


def run_fidelity(setup, tokenizer, pts, on_phase) -> dict:
    """Both runs for every point (``setup.fidelity_prompts`` prompts of ``fidelity_prompt_tokens``, then
    ``fidelity_tokens`` generated); ``{"prompts": [...], "points": {key: {...}}}``."""
    from vllm import SamplingParams

    prompts = fidelity_prompts(tokenizer, setup.fidelity_prompt_tokens, setup.fidelity_prompts, setup.seed)
    n_gen = setup.fidelity_tokens
    max_len = setup.fidelity_prompt_tokens + n_gen + 8
    on_phase(f"fidelity: {len(pts)} points × {len(prompts)} prompts, {n_gen} tokens generated")

    def greedy(extra, case):
        return SamplingParams(max_tokens=n_gen, temperature=0.0, ignore_eos=True, extra_args=extra)

    def forced(extra, case):  # the teacher's tokens count as generated: scope, tail and window as in ``greedy``
        extra = {"vtoken": {**extra["vtoken"], "prompt_len": setup.fidelity_prompt_tokens}}
        return SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=TOP_K, extra_args=extra)

    generated = run_on_engine(setup, prompts, pts, greedy, max_model_len=max_len)
    full_key = pts[0].key  # the full cache comes first (quality.points)
    teacher = {p.name: tuple(generated[(full_key, p.name)][0].outputs[0].token_ids) for p in prompts}
    forced_cases = [replace(p, prompt_ids=p.prompt_ids + teacher[p.name]) for p in prompts]
    # one block per prefill chunk: the policy evicts as the teacher's continuation grows
    scored = run_on_engine(
        setup,
        forced_cases,
        pts,
        forced,
        max_model_len=max_len,
        max_num_batched_tokens=setup.block_size,
        enable_chunked_prefill=True,
    )
    start = setup.fidelity_prompt_tokens
    full_dists = {p.name: _dists(scored[(full_key, p.name)][0], start) for p in prompts}
    out = {}
    for pt in pts:
        div = [first_divergence(teacher[p.name], generated[(pt.key, p.name)][0].outputs[0].token_ids) for p in prompts]
        per = [teacher_forced(full_dists[p.name], _dists(scored[(pt.key, p.name)][0], start)) for p in prompts]
        top1 = statistics.fmean(r["top1_agreement"] for r in per)
        out[pt.key] = {
            "tokens_to_divergence_median": statistics.median(div),
            "tokens_to_divergence_mean": round(statistics.fmean(div), 2),
            "top1_agreement": round(top1, 4),
            "kl_lower_bound_mean": round(statistics.fmean(r["kl_lower_bound"] for r in per), 5),
            "keeps_fidelity": top1 >= FIDELITY_TOP1_BOUND,
            **blocks_summary([generated[(pt.key, p.name)][1] for p in prompts]),
        }
    return {
        "prompts": [{"name": p.name, "source": p.source, "offset": p.offset} for p in prompts],
        "tokens": n_gen,
        "top1_bound": FIDELITY_TOP1_BOUND,
        "points": out,
    }
