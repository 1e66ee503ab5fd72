"""vToken in vLLM's default multiprocess engine, as ``vllm serve`` runs it: AsyncLLM (front end) → EngineCore
process (vToken scheduler) → worker process (vToken runner). Plans and scores cross both process
boundaries; the vToken gauges reach a stat logger in the front end on vLLM's own SchedulerStats."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytestmark = pytest.mark.slow


def test_async_llm_multiprocess(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.loggers import StatLoggerBase

    from vtoken.core.config import VTokenConfig
    from vtoken.core.reporting.engine_kv import KVSnapshot
    from vtoken.models.hf_reference import load_reference_model
    from vtoken.models.tiny import tiny_model
    from vtoken.vllm import engine_kwargs
    from vtoken.vllm.gauges import vtoken_stats_from
    from vtoken.vllm.offline.verify import reference_scores
    from vtoken.vllm.scheduling.trace import RequestTrace

    seen: list[KVSnapshot] = []

    class Capture(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            vt = vtoken_stats_from(scheduler_stats)
            if vt is not None:
                seen.append(vt)

        def log_engine_initialized(self):
            pass

    path = tiny_model("llama")
    cfg = VTokenConfig(policy="h2o", budget=0.3, mode="repack", block_size=32, sinks=4, recent=8, scope="all")
    args = AsyncEngineArgs(
        model=str(path),
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        enable_prefix_caching=False,
        **engine_kwargs(cfg, trace_dir=str(tmp_path)),
    )
    rng = np.random.default_rng(7)
    prompts = [rng.integers(10, 500, 150).tolist() for _ in range(3)]
    overrides = [{}, {"mode": "naive"}, {"policy": "tova", "mode": "reuse+repack", "budget": 0.5}]

    async def one(engine, i):
        params = SamplingParams(
            max_tokens=24,
            temperature=0.0,
            logprobs=0,
            ignore_eos=True,
            extra_args={"vtoken": {"trace_id": f"async-{i}", **overrides[i]}},
        )
        final = None
        async for out in engine.generate({"prompt_token_ids": prompts[i]}, params, request_id=f"async-{i}"):
            final = out
        return final

    async def main():
        engine = AsyncLLM.from_engine_args(args, stat_loggers=[Capture])
        try:
            return await asyncio.gather(*(one(engine, i) for i in range(3)))
        finally:
            engine.shutdown()

    outs = asyncio.run(main())
    ref = load_reference_model(path)
    for i, out in enumerate(outs):
        trace = RequestTrace.read(tmp_path / f"async-{i}.json")
        tokens = list(out.outputs[0].token_ids)
        lps = np.array([d[t].logprob for d, t in zip(out.outputs[0].logprobs, tokens)])
        top, ref_lp = reference_scores(ref, prompts[i], tokens, trace)
        assert np.array_equal(top, tokens) and np.max(np.abs(lps - ref_lp)) <= 1e-4, i
        assert trace.evicted > 0
    last = seen[-1]
    assert last.policy == "h2o" and last.mode == "repack" and last.block_size == 32 and last.pool_blocks > 0
    assert max(s.counters.evicted_tokens for s in seen) > 0
    assert last.counters.reclaimed_blocks > 0 and last.counters.repack_moves > 0 and last.counters.repack_seconds > 0
    busy = [s for s in seen if s.num_requests == 3]
    assert busy and all(s.held_blocks <= s.naive_blocks for s in busy)
    assert all(s.window_blocks == 0 for s in seen)  # one KV cache group: no sliding-window blocks
    assert any(s.held_blocks < s.naive_blocks for s in busy)
