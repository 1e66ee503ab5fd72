"""The buffered-query scoring path (vtoken/vllm/runner/score_capture.py) inside a real vLLM engine on the CPU.

The CPU platform runs no CUDA graphs, so ``engine_setup.captures_queries`` answers False there and the
per-layer hook scores. This test forces the answer to True for one engine (in-process, so the worker reads
the patched function), so vLLM's real CPU attention calls the copying wrappers, and the runner scores the
buffers after the forward: its decisions and tokens must equal a hook-path engine's for the same requests
(the GPU-side replay of a captured forward is tests/unit/vllm/test_vllm_full_graphs.py)."""

from __future__ import annotations

import numpy as np
import pytest
from support.engine import shutdown, sp_uncached

from vtoken.vllm.scheduling.trace import RequestTrace

pytestmark = pytest.mark.slow


def _run(tmp, monkeypatch, buffered: bool):
    from vtoken.models.tiny import tiny_model
    from vtoken.vllm import engine_setup
    from vtoken.vllm.offline.launch import start_engine

    if buffered:
        monkeypatch.setattr(
            engine_setup,
            "captures_queries",
            lambda cfg, s: (
                engine_setup.needs_attention_scores(s)
                and not engine_setup.scores_every_layer(s, engine_setup.model_depth(cfg))
            ),
        )
    llm = start_engine(str(tiny_model("llama")), 32, str(tmp), max_num_batched_tokens=64, max_model_len=512, recent=8)
    try:
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        assert (runner._vt_capture is not None) == buffered
        prompt = np.random.default_rng(3).integers(10, 500, 150).tolist()
        outs, evicted = {}, {}
        for policy in ("h2o", "tova", "snapkv"):
            params = sp_uncached(40, policy=policy, mode="repack", budget=0.3, salt=11, trace_id=policy)
            out = llm.generate([{"prompt_token_ids": prompt}], [params], use_tqdm=False)[0]
            outs[policy] = list(out.outputs[0].token_ids)
            trace = RequestTrace.read(tmp / f"{policy}.json")
            assert trace.evicted > 0
            evicted[policy] = np.asarray(trace.epochs[0].evicted_round)
        return outs, evicted
    finally:
        shutdown(llm)
        monkeypatch.undo()


def test_buffered_queries_evict_like_the_per_layer_hook_in_a_cpu_engine(tmp_path, monkeypatch):
    """h2o, tova and snapkv (score_layers = 1 of 2, the default) in two engines, one scoring through the
    query buffers: the same victims round by round, the same tokens."""
    (tmp_path / "hook").mkdir()
    (tmp_path / "buf").mkdir()
    hook_tokens, hook_evicted = _run(tmp_path / "hook", monkeypatch, buffered=False)
    buf_tokens, buf_evicted = _run(tmp_path / "buf", monkeypatch, buffered=True)
    for policy in hook_tokens:
        assert np.array_equal(buf_evicted[policy], hook_evicted[policy]), policy
        assert buf_tokens[policy] == hook_tokens[policy], policy
