"""Which engine configurations vToken runs, checked when the engine is built (never on a request).

Three checks, each raising ``ConfigError`` with a message that names the model or engine feature and says
what vToken supports (docs/support.md lists every feature):

``check_engine_config(vllm_config)``   what the config alone decides: pipeline / context parallelism,
                                       dual-batch overlap / micro-batching, speculative decoding, KV
                                       connectors, quantized (fp8) KV caches, pooling runners, MLA,
                                       mm-prefix LMs, the vToken worker. Called by the vToken worker's
                                       constructor (before the model loads), by the scheduler, and by
                                       ``vtoken serve`` before it starts anything (``preflight``).
``check_supported(vllm_config, kv)``   the above plus the KV cache spec vLLM built from the model: one group,
                                       or one full-attention group beside sliding-window groups (hybrid
                                       models; ``full_attention_group``); that group exactly
                                       ``FullAttentionSpec`` (not MLA or another subclass), no
                                       sliding window, no chunked local attention, no non-causal layers,
                                       K and V of one head size, no packed or quantized pages. Called by the
                                       vToken scheduler's constructor.
``check_attention_layer(name, impl)``  each attention layer's implementation, when the worker's KV cache is
                                       built: no ALiBi, soft-capping, attention sinks, sliding window,
                                       quantized cache, cross/encoder attention. Called by the runner's
                                       ``_vt_setup`` (``initialize_kv_cache``), with the layout probe.

vLLM raises these from engine construction, so ``LLM(...)`` / ``AsyncLLM`` / ``vllm serve`` fail at start-up
and no request ever reaches a configuration vToken cannot keep exact. Pure: reads the objects only.
"""

from __future__ import annotations

import os

from vtoken.errors import REFUSAL_PREFIX, ConfigError

SUPPORTED = (
    "vToken supports decoder-only generation models whose layers use causal full attention "
    "(sliding-window layers beside one group of full-attention layers: vToken manages the full ones) "
    "over one unquantized KV cache (fp32/fp16/bf16), tensor parallelism, pipeline parallel size 1; "
    "see docs/support.md"
)
# FullAttentionSpec fields that may take any value (sizes and bookkeeping vToken reads through the layout)
SPEC_FREE_FIELDS = frozenset(
    {
        "block_size",
        "block_stride_alignment",
        "num_kv_heads",
        "head_size",
        "dtype",
        "head_size_v",
        "dcp_sharded",
        "max_tp_shards",
        "page_size_padded",
    }
)


# A file the refusal is also appended to (set by the Serve replica before it starts an engine): vLLM re-raises
# an engine core's start-up failure as "Engine core initialization failed" without the cause's message.
REFUSAL_FILE_ENV = "VTOKEN_REFUSAL_FILE"


def refuse(feature: str) -> None:
    """Raise ``ConfigError`` naming ``feature``; side effect: with ``$VTOKEN_REFUSAL_FILE`` set, the message
    is appended to that file first (one line), so the process that started the engine can report it."""
    message = f"{REFUSAL_PREFIX}: {feature}. {SUPPORTED}"
    path = os.environ.get(REFUSAL_FILE_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(message.replace("\n", " ") + "\n")
    raise ConfigError(message)


def check_engine_config(vllm_config) -> None:
    """Refuse what the engine's config alone shows vToken cannot keep exact (raises ``ConfigError``)."""
    from vtoken.vllm.internals import is_vtoken_worker

    pc, mc, cc = vllm_config.parallel_config, vllm_config.model_config, vllm_config.cache_config
    if pc.pipeline_parallel_size > 1:
        refuse(
            f"pipeline parallelism (pipeline_parallel_size={pc.pipeline_parallel_size}): the step's "
            "moves, truncations and score reduction are implemented per tensor-parallel group only; "
            "use tensor parallelism"
        )
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(pc, name, 1) > 1:
            refuse(f"context parallelism ({name}={getattr(pc, name)}) shards a request's tokens over ranks")
    if getattr(pc, "enable_dbo", False) or getattr(pc, "ubatch_size", 0) > 1:
        option = (
            "dual-batch overlap (enable_dbo=True)"
            if getattr(pc, "enable_dbo", False)
            else f"micro-batching (ubatch_size={pc.ubatch_size})"
        )
        refuse(
            f"{option}: each micro-batch's attention sees a micro-batch-local query while vToken's "
            "score accumulator indexes it with whole-batch offsets (and counts each layer once per "
            "micro-batch), and vLLM splits the batch by logical num_computed_tokens, which rows "
            "compacted by eviction no longer match; unset enable_dbo and ubatch_size"
        )
    if vllm_config.speculative_config is not None:
        refuse("speculative decoding (drafters compute logical slots)")
    if vllm_config.kv_transfer_config is not None:
        refuse("KV connectors (they assume append-only block rows)")
    if str(cc.cache_dtype) != "auto":
        refuse(
            f"a quantized KV cache (kv_cache_dtype={cc.cache_dtype!r}): slot moves and scores read "
            "unquantized K/V; use kv_cache_dtype='auto'"
        )
    if mc is not None and getattr(mc, "runner_type", "generate") != "generate":
        refuse(
            f"a {mc.runner_type!r} runner (embedding/pooling models): eviction shortens the sequence "
            "the pooler waits for; serve pooling models without vToken (mode 'none')"
        )
    if mc is not None and mc.use_mla:
        refuse("multi-head latent attention (MLA) caches one latent per token, not per-head K/V")
    if mc is not None and getattr(mc, "is_mm_prefix_lm", False):
        refuse(
            "an mm-prefix language model (model_config.is_mm_prefix_lm: bidirectional attention over "
            "multimodal prefix spans): vLLM gives those spans as logical token ranges, which rows "
            "compacted by eviction no longer match, and vToken's scores assume causal attention"
        )
    if not is_vtoken_worker(pc.worker_cls):
        raise ConfigError(
            f"vToken's scheduler needs vToken's worker, got worker_cls={pc.worker_cls!r}; "
            "pass worker_cls='vtoken.vllm.worker.VTokenWorker' (see vtoken.vllm.engine_kwargs)"
        )


def check_kv_spec(spec) -> None:
    """Refuse a KV cache spec other than plain causal full attention (raises ``ConfigError``)."""
    import dataclasses

    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode

    if type(spec) is not FullAttentionSpec:
        refuse(
            f"the model's attention layers use {type(spec).__name__} (sliding window, chunked local, "
            "MLA, Mamba and other KV cache kinds are not supported)"
        )
    if spec.sliding_window is not None:
        refuse(
            f"sliding-window attention (window {spec.sliding_window}; a full-attention KV cache with a "
            "window, e.g. with the hybrid KV cache manager disabled)"
        )
    if spec.attention_chunk_size is not None:
        refuse(f"chunked local attention (attention_chunk_size={spec.attention_chunk_size})")
    if spec.non_causal:
        refuse("non-causal (bidirectional / prefix-LM) attention layers")
    if spec.kv_quant_mode != KVQuantMode.NONE:
        refuse(f"a quantized KV cache ({spec.kv_quant_mode.name})")
    if spec.head_size_v != spec.head_size:
        refuse(f"different K and V head sizes ({spec.head_size} / {spec.head_size_v})")
    default = FullAttentionSpec(
        block_size=spec.block_size, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size, dtype=spec.dtype
    )
    for f in dataclasses.fields(spec):
        if f.name not in SPEC_FREE_FIELDS and getattr(spec, f.name) != getattr(default, f.name):
            refuse(f"a KV cache spec variant vToken has not proven ({f.name}={getattr(spec, f.name)!r})")


def check_supported(vllm_config, kv_cache_config) -> int:
    """Refuse configurations vToken cannot keep exact (raises ``ConfigError``); see the module docstring.
    Returns the index of the KV cache group vToken manages (``full_attention_group``)."""
    check_engine_config(vllm_config)
    return full_attention_group(kv_cache_config.kv_cache_groups)


def full_attention_group(groups) -> int:
    """The index of the one KV cache group vToken manages: the only group, or, on a hybrid model (vLLM's
    hybrid KV cache manager: sliding-window layers in their own groups), the single full-attention group
    beside groups that are all ``SlidingWindowSpec`` (left to vLLM). Refuses other mixes (raises
    ``ConfigError`` naming the groups' kinds). Pure."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    kinds = [type(g.kv_cache_spec) for g in groups]
    if len(groups) == 1:
        check_kv_spec(groups[0].kv_cache_spec)
        return 0
    names = ", ".join(sorted({k.__name__ for k in kinds}))
    other = sorted({k.__name__ for k in kinds if k not in (FullAttentionSpec, SlidingWindowSpec)})
    if other:
        refuse(
            f"{len(groups)} KV cache groups ({names}): hybrid models with {', '.join(other)} layers "
            "(Mamba, chunked local, cross attention) are not supported; sliding-window + full attention is"
        )
    full = [i for i, k in enumerate(kinds) if k is FullAttentionSpec]
    if len(full) != 1:
        refuse(
            f"{len(groups)} KV cache groups ({names}) with {len(full)} full-attention groups: vToken keeps "
            "one token table per request on exactly one full-attention group (a hybrid model whose global "
            "layers fill more than one group)"
        )
    check_kv_spec(groups[full[0]].kv_cache_spec)
    return full[0]


def describe_groups(groups) -> list[dict]:
    """The KV cache groups as reports state them: per group ``kind`` (``full`` or ``sliding_window``, else the
    spec's class name), ``layers`` and, for a window, ``window`` (tokens). Pure."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    out = []
    for g in groups:
        spec = g.kv_cache_spec
        if type(spec) is SlidingWindowSpec:
            out.append({"kind": "sliding_window", "layers": len(g.layer_names), "window": spec.sliding_window})
        else:
            kind = "full" if type(spec) is FullAttentionSpec else type(spec).__name__
            out.append({"kind": kind, "layers": len(g.layer_names)})
    return out


def check_attention_layer(name: str, impl) -> None:
    """Refuse an attention layer implementation whose attention vToken's scores or layout cannot reproduce
    (raises ``ConfigError``); ``impl`` is the layer's ``AttentionImpl`` (``layer.impl``)."""
    if getattr(impl, "alibi_slopes", None) is not None:
        refuse(f"ALiBi position biases (layer {name})")
    if getattr(impl, "logits_soft_cap", None) not in (None, 0, 0.0):
        refuse(f"attention logit soft-capping (layer {name}, soft cap {impl.logits_soft_cap})")
    if getattr(impl, "sinks", None) is not None:
        refuse(f"learned attention sinks (layer {name})")
    window = getattr(impl, "sliding_window", None)
    if window not in (None, -1, (-1, -1)):
        refuse(f"sliding-window attention (layer {name}, window {window})")
    if str(getattr(impl, "kv_cache_dtype", "auto")) != "auto":
        refuse(f"a quantized KV cache (layer {name}, kv_cache_dtype={impl.kv_cache_dtype!r})")
    attn_type = str(getattr(impl, "attn_type", "decoder")).lower()
    if "decoder" not in attn_type or "encoder" in attn_type:
        refuse(f"{attn_type} attention (layer {name}); only causal decoder self-attention is supported")
