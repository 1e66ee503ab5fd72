"""In-process engines shared by several test modules (each module builds its own: no state crosses modules)."""

from __future__ import annotations


def small_pool_engine(trace_dir: str):
    """An in-process tiny-Llama engine with 11 usable KV blocks of 32 tokens (max_model_len 352), chunked
    prefill (64 tokens a step) and prefix caching: the shortage tests' pool. The caller shuts it down."""
    from vtoken.models.tiny import tiny_model
    from vtoken.vllm.launch import start_engine

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
