"""``vtoken verify --gpu``: vToken on vLLM's production CUDA path, checked against stock vLLM.

``vtoken verify`` (``verify.py``) proves exactness in fp32 with eager execution, against a masked Hugging Face
reference. On a GPU that is not the path users run: bf16, vLLM's default attention backend (FlashAttention),
its default CUDA graphs. This check runs that path, one prompt, greedy, and compares engines with each other
(no HF reference: bf16 on different kernels is not bit-comparable with it)::

    (a) stock    vLLM with no vToken class (its defaults; the reference)
    (b) none     the vToken engine, the request in mode none          tokens == (a)
    (c) full     the vToken engine, repack at budget 1.0 (no eviction) tokens == (a)
    (d) paired   repack and naive at the asked budget, one batch       same evicted sets at every step, and
                                                                       tokens equal or parting at a near-tie

Every engine is built with ``VLLM_GPU_SYNC_CHECK=error``, so a device→host synchronisation inside a captured
or hot region raises instead of passing silently. Side effects: builds two engines on the current CUDA device
(one after the other; the first is dropped before the second is built). On a platform other than CUDA it
refuses before building anything (``require_cuda``). Never run on a GPU yet (docs/gpu.md).
"""

from __future__ import annotations

import gc
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from vtoken.core.config import Mode, VTokenConfig
from vtoken.errors import ConfigError

NEAR_TIE_NATS = 0.05  # two candidates this close in bf16 log-probability may swap between layouts


def gpu_env() -> dict[str, str]:
    """The environment every engine of the check is built under (pure): in-process engine, sync check on."""
    return {"VLLM_GPU_SYNC_CHECK": "error", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def require_cuda(device_type: str) -> None:
    """Raise ``ConfigError`` unless ``device_type`` (``vllm.platforms.current_platform.device_type``) is cuda."""
    if device_type != "cuda":
        raise ConfigError(
            f"verify --gpu needs vLLM's CUDA platform; this vLLM runs on {device_type!r} (the lent "
            "H200 has no vLLM: docs/gpu.md); run `vtoken verify` without --gpu here"
        )


def production_kwargs(cfg: VTokenConfig | None, trace_dir: str | None, max_model_len: int) -> dict:
    """``vllm.LLM`` keyword arguments of the production path (pure): bf16, vLLM's default backend and CUDA
    graphs (no ``enforce_eager``), prefix caching off so the paired requests keep private blocks. ``cfg``
    ``None``: stock vLLM (no scheduler, worker or ``additional_config``)."""
    kw: dict = {
        "dtype": "bfloat16",
        "max_model_len": max_model_len,
        "enable_prefix_caching": False,
        "gpu_memory_utilization": 0.6,
        "seed": 0,
    }
    if cfg is not None:
        from vtoken.vllm import engine_kwargs

        kw.update(engine_kwargs(cfg, trace_dir=trace_dir, check=True, invariants="fatal"))
    return kw


@dataclass(frozen=True)
class PairedVerdict:
    """Two greedy runs that should make the same decisions (repack and naive), compared step by step."""

    tokens_equal: bool
    first_divergence: int | None  # first position where the tokens differ
    near_tie: bool  # at that position, the two best candidates were within NEAR_TIE_NATS in both runs
    max_abs_logprob_diff: float  # over the positions before the divergence (all if none)

    @property
    def ok(self) -> bool:
        return self.tokens_equal or self.near_tie


def compare_paired(
    a: list[int], a_lp: list[float], a_gap: list[float], b: list[int], b_lp: list[float], b_gap: list[float]
) -> PairedVerdict:
    """Compare two runs' tokens, their log-probabilities and the gap between each step's best two candidates
    (pure). Equal runs pass; runs that part pass only where the parting step was a near-tie in both."""
    n = min(len(a), len(b))
    diff = next((i for i in range(n) if a[i] != b[i]), None)
    end = n if diff is None else diff
    lp = float(np.max(np.abs(np.subtract(a_lp[:end], b_lp[:end])))) if end else 0.0
    tie = diff is not None and a_gap[diff] <= NEAR_TIE_NATS and b_gap[diff] <= NEAR_TIE_NATS
    equal = diff is None and len(a) == len(b)
    return PairedVerdict(tokens_equal=equal, first_divergence=diff, near_tie=tie, max_abs_logprob_diff=lp)


def evicted_sets_equal(trace_a, trace_b, steps: int) -> bool:
    """Whether two traces evicted the same tokens at the same rounds, over the rounds before ``steps`` (pure;
    ``rounds_before``): the decisions were paired while the outputs agreed."""
    ea = [np.asarray(e.evicted_round) for e in trace_a.epochs]
    eb = [np.asarray(e.evicted_round) for e in trace_b.epochs]
    if len(ea) != len(eb):
        return False
    for x, y in zip(ea, eb, strict=True):
        n = min(x.size, y.size)
        xs, ys = np.where(x[:n] < steps, x[:n], -1), np.where(y[:n] < steps, y[:n], -1)
        if not np.array_equal(xs, ys):
            return False
    return True


def rounds_before(trace, prompt_len: int, divergence: int | None) -> int:
    """The trace round that placed generated token ``divergence`` (pure): decisions made in earlier rounds
    precede the parting; every round when the runs never part."""
    if divergence is None:
        return np.iinfo(np.int64).max
    return int(trace.epochs[-1].placed_round[prompt_len + divergence])


def _outputs(llm, prompt: list[int], vt: Sequence[Mapping[str, object] | None], max_tokens: int):
    from vllm import SamplingParams

    params = [
        SamplingParams(
            max_tokens=max_tokens, temperature=0.0, logprobs=2, ignore_eos=True, extra_args={"vtoken": v} if v else None
        )
        for v in vt
    ]
    outs = llm.generate([{"prompt_token_ids": prompt}] * len(vt), params, use_tqdm=False)
    res = []
    for out in outs:
        c = out.outputs[0]
        toks = list(c.token_ids)
        lps = [d[t].logprob for d, t in zip(c.logprobs, toks, strict=True)]
        gaps = [
            top[0] - top[1] if len(top := sorted((x.logprob for x in d.values()), reverse=True)) > 1 else float("inf")
            for d in c.logprobs
        ]
        res.append((toks, lps, gaps))
    return res


def run_gpu_verify(model: str, cfg: VTokenConfig, prompt: list[int], max_tokens: int) -> dict:
    """Run checks (a)–(d) of the module docstring on ``prompt``; the report (``ok``: every check held)."""
    from vllm import LLM

    from vtoken.vllm.offline.launch import scoped_env
    from vtoken.vllm.scheduling.trace import RequestTrace

    max_len = len(prompt) + max_tokens + 64
    with scoped_env(**gpu_env()):
        stock = LLM(model=model, **production_kwargs(None, None, max_len))
    # two requests, as the vToken engine's (b) and (c) run together: the same batch shape, so bf16 kernels
    # see the same shapes (vLLM is not batch-invariant across shapes)
    stock_a, stock_b = (out[0] for out in _outputs(stock, prompt, [None, None], max_tokens))
    del stock
    gc.collect()
    budget = cfg.budget.to_json()
    with tempfile.TemporaryDirectory(prefix="vtoken-gpu-verify-") as d:
        with scoped_env(**gpu_env()):
            llm = LLM(model=model, **production_kwargs(cfg, d, max_len))
        base = {"policy": cfg.policy, "sinks": cfg.sinks, "recent": cfg.recent, "seed": cfg.seed, "salt": 1}
        runs = [
            {**base, "mode": Mode.NONE.value, "trace_id": "none"},
            {**base, "mode": Mode.REPACK.value, "budget": 1.0, "trace_id": "full"},
            {**base, "mode": Mode.REPACK.value, "budget": budget, "trace_id": "repack"},
            {**base, "mode": Mode.NAIVE.value, "budget": budget, "trace_id": "naive"},
        ]
        none, full = _outputs(llm, prompt, runs[:2], max_tokens)
        repack, naive = _outputs(llm, prompt, runs[2:], max_tokens)
        paired = compare_paired(*repack, *naive)
        ta, tb = RequestTrace.read_id(d, "repack"), RequestTrace.read_id(d, "naive")
        same_sets = evicted_sets_equal(ta, tb, rounds_before(ta, len(prompt), paired.first_divergence))
        evicted = ta.evicted
        del llm
    report = {
        "model": model,
        "policy": cfg.policy,
        "budget": str(cfg.budget),
        "dtype": "bfloat16",
        "prompt_tokens": len(prompt),
        "max_tokens": max_tokens,
        "none_equals_stock": none[0] == stock_a,
        "full_equals_stock": full[0] == stock_b,
        "paired_tokens_equal": paired.tokens_equal,
        "paired_first_divergence": paired.first_divergence,
        "paired_divergence_at_near_tie": paired.near_tie,
        "paired_max_abs_logprob_diff": paired.max_abs_logprob_diff,
        "paired_evicted_sets_equal": same_sets,
        "evicted_tokens": int(evicted),
    }
    report["ok"] = bool(
        report["none_equals_stock"] and report["full_equals_stock"] and paired.ok and same_sets and evicted > 0
    )
    return report
