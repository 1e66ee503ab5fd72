"""In-process engines shared by several test modules (each module builds its own: no state crosses modules):
the shortage tests' pool, sampling params, shutdown and the check against the HF masked reference."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from vtoken.vllm.offline.verify import VerifyCase, VerifyResult
    from vtoken.vllm.scheduling.trace import RequestTrace

# the fidelity matrix's policies and modes, and its log-prob tolerance (fp32)
POLICIES = ["h2o", "tova", "scissorhands", "knorm", "random", "streamingllm", "rkv"]
MODES = ["naive", "repack", "reuse+repack"]
TOL = 1e-4


def shutdown(llm) -> None:
    """Stop an in-process ``LLM``'s engine core and free it."""
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def engine_session(tmp_path_factory, build: Callable[[str], Any]) -> Iterator[tuple[Any, Path]]:
    """For a module-scoped fixture to ``yield from``: makes a fresh trace folder, builds the engine with
    ``build(folder)``, yields ``(llm, folder)`` and shuts the engine down once the module is done."""
    d = tmp_path_factory.mktemp("traces")
    llm = build(str(d))
    yield llm, d
    shutdown(llm)


def sp(max_tokens: int, **vt):
    """Greedy sampling params with logprobs, ``vt`` as the request's vtoken settings."""
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True, extra_args={"vtoken": vt} if vt else None
    )


def sp_uncached(max_tokens: int, **vt):
    """``sp`` for a request that reads nothing from the prefix cache (it computes its whole prompt itself, so
    runs of one prompt one after another decide alike)."""
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        logprobs=0,
        ignore_eos=True,
        skip_reading_prefix_cache=True,
        extra_args={"vtoken": vt},
    )


def verify_on_engine(
    llm, path, block_size: int, cases: list[VerifyCase], trace_dir, prompt_len: int, max_tokens: int = 24, ref=None
) -> list[VerifyResult]:
    """``run_cases`` of ``cases`` on ``llm`` (traces written under ``trace_dir``) against the HF masked
    reference ``ref`` (loaded from ``path`` when not given); shuts ``llm`` down afterwards, pass or fail."""
    from vtoken.models.hf_reference import load_reference_model
    from vtoken.vllm.offline.verify import run_cases

    try:
        return run_cases(
            path,
            block_size,
            cases,
            llm=llm,
            trace_dir=str(trace_dir),
            prompt_len=prompt_len,
            max_tokens=max_tokens,
            reference_model=load_reference_model(path) if ref is None else ref,
        )
    finally:
        shutdown(llm)


def assert_exact_and_paired(result: VerifyResult, tol: float = TOL) -> None:
    """A verify case matched the HF masked reference (greedy tokens, log-probs within ``tol``) and its paired
    naive run, and evicted tokens (else it would prove nothing)."""
    key = result.case.key()
    assert result.match and result.max_abs_logprob_diff <= tol, (key, result.max_abs_logprob_diff)
    assert result.paired_naive_match, f"{key}: tokens differ from the paired naive run"
    assert result.evicted_tokens > 0, key


def check_against_reference(ref_model, prompt, out, trace: RequestTrace):
    """The greedy tokens of ``out`` equal the HF masked reference's, and their log-probs are within ``TOL``."""
    from vtoken.vllm.offline.verify import reference_scores

    tokens = list(out.outputs[0].token_ids)
    lps = np.array([d[t].logprob for d, t in zip(out.outputs[0].logprobs, tokens)])
    top, ref_lp = reference_scores(ref_model, list(prompt), tokens, trace)
    assert np.array_equal(top, tokens), "greedy tokens differ from the HF masked reference"
    assert np.max(np.abs(lps - ref_lp)) <= TOL
    return tokens


def preempted_pair(llm, trace_dir: Path, ref_model, tag: str, x_tokens: int, y_tokens: int) -> RequestTrace:
    """Runs X (64 random prompt tokens, no eviction, ``x_tokens`` generated) beside Y (96 prompt tokens,
    repack at a 48-token budget, ``y_tokens`` generated) on ``llm`` — X's growth is to make vLLM preempt Y —
    with traces ``{tag}-x`` / ``{tag}-y`` under ``trace_dir``. Checks that Y was preempted (two epochs at
    least) and that both outputs equal the HF masked reference of the epoch that produced each token;
    returns Y's trace."""
    from vtoken.vllm.scheduling.trace import RequestTrace

    rng = np.random.default_rng(3)
    px, py = rng.integers(10, 500, 64).tolist(), rng.integers(10, 500, 96).tolist()
    outs = llm.generate(
        [{"prompt_token_ids": px}, {"prompt_token_ids": py}],
        [sp(x_tokens, mode="none", trace_id=f"{tag}-x"), sp(y_tokens, mode="repack", budget=48, trace_id=f"{tag}-y")],
        use_tqdm=False,
    )
    ty = RequestTrace.read(trace_dir / f"{tag}-y.json")
    assert len(ty.epochs) >= 2, "Y was expected to be preempted"
    check_against_reference(ref_model, px, outs[0], RequestTrace.read(trace_dir / f"{tag}-x.json"))
    check_against_reference(ref_model, py, outs[1], ty)
    return ty


def small_pool_engine(trace_dir: str):
    """An in-process tiny-Llama engine with 11 usable KV blocks of 32 tokens (max_model_len 352), chunked
    prefill (64 tokens a step) and prefix caching: the shortage tests' pool. The caller shuts it down."""
    from vtoken.models.tiny import tiny_model
    from vtoken.vllm.offline.launch import start_engine

    return start_engine(
        str(tiny_model("llama")),
        32,
        trace_dir,
        enable_prefix_caching=True,
        max_num_batched_tokens=64,
        max_model_len=352,
        num_gpu_blocks_override=12,
        recent=8,
    )
