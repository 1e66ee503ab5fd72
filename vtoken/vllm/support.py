"""Which engine configurations vToken runs, checked when the engine is built (never on a request).

``check_supported`` raises ``ConfigError`` naming the unsupported setting; the vToken scheduler calls it
from its constructor, so ``LLM(...)`` / ``vllm serve`` fail at start-up with the message.
"""

from __future__ import annotations

from vtoken.errors import ConfigError


def check_supported(vllm_config, kv_cache_config) -> None:
    """Refuse configurations vToken cannot keep exact (raises ``ConfigError``)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from vtoken.vllm.internals import is_vtoken_worker

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec) or isinstance(
        groups[0].kv_cache_spec, SlidingWindowSpec
    ):
        raise ConfigError("vToken supports models with one full-attention KV cache group only")
    if vllm_config.speculative_config is not None:
        raise ConfigError("vToken does not support speculative decoding (drafters compute logical slots)")
    pc = vllm_config.parallel_config
    if pc.tensor_parallel_size > 1 or pc.pipeline_parallel_size > 1:
        raise ConfigError("vToken runs with tensor/pipeline parallel size 1 only (scores are not all-reduced yet)")
    if vllm_config.kv_transfer_config is not None:
        raise ConfigError("vToken does not support KV connectors (they assume append-only block rows)")
    if not is_vtoken_worker(pc.worker_cls):
        raise ConfigError(
            f"vToken's scheduler needs vToken's worker, got worker_cls={pc.worker_cls!r}; "
            "pass worker_cls='vtoken.vllm.worker.VTokenWorker' (see vtoken.vllm.engine_kwargs)"
        )
