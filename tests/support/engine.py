"""In-process engines shared by several test modules (each module builds its own: no state crosses modules):
the shortage tests' pool, sampling params, shutdown and the check against the HF masked reference."""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
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


def sp(max_tokens: int, **vt):
    """Greedy sampling params with logprobs, ``vt`` as the request's vtoken settings."""
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True, extra_args={"vtoken": vt} if vt else None
    )


def check_against_reference(ref_model, prompt, out, trace: RequestTrace):
    """The greedy tokens of ``out`` equal the HF masked reference's, and their log-probs are within ``TOL``."""
    from vtoken.vllm.offline.verify import reference_scores

    tokens = list(out.outputs[0].token_ids)
    lps = np.array([d[t].logprob for d, t in zip(out.outputs[0].logprobs, tokens)])
    top, ref_lp = reference_scores(ref_model, list(prompt), tokens, trace)
    assert np.array_equal(top, tokens), "greedy tokens differ from the HF masked reference"
    assert np.max(np.abs(lps - ref_lp)) <= TOL
    return tokens


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
