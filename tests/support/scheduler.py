"""The vToken scheduler built by hand, without model weights, the way vLLM's own scheduler tests build theirs
(a ``VllmConfig`` and a ``KVCacheConfig``), requests for it, and vLLM's engine loop over it with a fake model
and a fake clock (``drive_scheduler``; tests/unit/vllm/test_vllm_async_scheduler.py,
tests/integration/test_vllm_admission.py, tests/integration/test_vllm_pressure.py)."""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

VOCAB = 500


def make_scheduler(
    block_size=8,
    num_blocks=64,
    async_scheduling=True,
    vtoken=None,
    max_num_seqs=8,
    max_batched=64,
    cudagraph_mode=None,
    prefix_caching=False,
):
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from vtoken.models.tiny import tiny_model
    from vtoken.vllm import WORKER_CLS
    from vtoken.vllm.scheduler import VTokenScheduler

    settings = {
        "policy": "h2o",
        "budget": 0.5,
        "mode": "repack",
        "sinks": 1,
        "recent": 0,
        "scope": "all",
        "check": True,
        **(vtoken or {}),
    }
    model = ModelConfig(
        model=str(tiny_model("llama")), dtype="float32", seed=0, skip_tokenizer_init=True, max_model_len=512
    )
    sched_cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_batched,
        max_model_len=512,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cfg = VllmConfig(
        model_config=model,
        scheduler_config=sched_cfg,
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
        additional_config={"vtoken": settings},
    )
    cfg.scheduler_config.async_scheduling = async_scheduling  # the CPU platform forces it off; CUDA's default
    cfg.parallel_config.worker_cls = WORKER_CLS
    if cudagraph_mode is not None:
        from vllm.config.compilation import CompilationMode

        cfg.compilation_config.mode = CompilationMode.VLLM_COMPILE
        cfg.compilation_config.cudagraph_mode = cudagraph_mode
        # CUDA's split (the CPU platform leaves splitting_ops empty): attention between captured pieces
        cfg.compilation_config.splitting_ops = list(cfg.compilation_config._attention_ops)
    cfg.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=16, dtype=torch.float32)
    kv = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
    )
    return VTokenScheduler(
        vllm_config=cfg,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(cfg),
        block_size=block_size,
        log_stats=True,
    )


def make_request(rid, prompt_len, max_tokens, prefix=(), block_size=8, **overrides):
    """A request with a random prompt (after ``prefix``) and vLLM's block hasher (prefix caching)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    rng = np.random.default_rng(abs(hash(rid)) % 2**32)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args={"vtoken": overrides})
    prompt = list(prefix) + rng.integers(10, VOCAB, prompt_len - len(prefix)).tolist()
    init_none_hash(sha256)
    return Request(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


class Clock:
    """A settable clock (vToken's scheduler reads ``_vt_clock``)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def execute(so, sched):
    """A model runner's output for ``so``: token 7 for every request that is not mid-prefill."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(so.num_scheduled_tokens)
    sampled = [[] if sched.requests[rid].is_prefill_chunk else [7] for rid in ids]
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled)


def drive_scheduler(sched, requests, in_flight, step_time, max_iters=2000):
    """vLLM's engine loop: ``in_flight`` 1 (``step``) or 2 (``step_with_batch_queue``, async scheduling).
    ``step_time(scheduler_output)``: the seconds the fake GPU takes for a step (the clock vToken's scheduler
    reads). Returns per step (running, waiting, cap, admitted) and each request's output token times."""
    clock, queue, log = Clock(), deque(), []
    sched._vt_clock = clock
    for r in requests:
        sched.add_request(r)
    generated: dict[str, list[float]] = {r.request_id: [] for r in requests}
    for _ in range(max_iters):
        if not sched.has_requests() and not queue:
            break
        if sched.has_requests():
            so = sched.schedule()
            cap = sched.admission_cap()
            log.append((len(sched.running), len(sched.waiting), cap, len(so.scheduled_new_reqs)))
            queue.append((so, execute(so, sched)))
            if len(queue) < in_flight and so.total_num_scheduled_tokens > 0 and sched.has_requests():
                continue
        so, out = queue.popleft()
        clock.t += step_time(so)  # the oldest step in flight completes now
        for eco in sched.update_from_output(so, out).values():
            for o in eco.outputs:
                generated[o.request_id] += [clock.t] * len(o.new_token_ids)
    assert not queue and not sched.has_requests(), "did not finish"
    return log, generated
