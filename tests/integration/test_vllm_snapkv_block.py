"""SnapKV and block-granular eviction in vLLM's real engine (CPU, in-process, tiny Llama, fp32) against the
HF masked reference (``vtoken.vllm.offline.verify.run_cases``) and the paired run of another mode.

Two engines of a few seconds each: one without chunked prefill for the verify cases, one that prefills 64
tokens per step (so the prompt's last chunk, the observation window, is shorter than 32 queries).
"""

from __future__ import annotations

import numpy as np
import pytest
from support.engine import MODES, assert_exact_and_paired, check_against_reference, shutdown, sp, verify_on_engine

from vtoken.vllm.offline.launch import start_engine
from vtoken.vllm.offline.verify import VerifyCase
from vtoken.vllm.scheduling.trace import RequestTrace

pytestmark = pytest.mark.slow
SINKS = 4  # start_engine's default


def first_victims(trace: RequestTrace) -> np.ndarray:
    """The tokens the request's first eviction round removed (ascending)."""
    ev = np.asarray(trace.epochs[0].evicted_round)
    return np.flatnonzero(ev == ev[ev >= 0].min())


def oldest_first(victims: np.ndarray) -> bool:
    """Whether ``victims`` are just the oldest unprotected tokens (what SnapKV does without its window)."""
    return np.array_equal(victims, np.arange(SINKS, SINKS + victims.size))


def test_snapkv_and_block_granularity_match_the_reference(tmp_path):
    """SnapKV (window measured once, on the prompt's last step) × every mode, and the block-granular
    baseline (H2O, SnapKV) × {naive, repack}: greedy tokens == the HF masked reference and the paired run of
    another mode; block-granular runs evict whole original blocks only (twice: the prompt, then a block the
    recent window left) and their naive run holds exactly the packing bound in vLLM's pool; SnapKV's first
    victims are not simply the oldest tokens."""
    from vtoken.models.tiny import tiny_model

    path, B = tiny_model("llama"), 32
    cases = [VerifyCase("snapkv", m, 0.3) for m in MODES]
    cases += [VerifyCase(p, m, 0.3, granularity="block") for p in ("h2o", "snapkv") for m in ("naive", "repack")]
    for r in verify_on_engine(start_engine(str(path), B, str(tmp_path)), path, B, cases, tmp_path, 7 * B):
        assert_exact_and_paired(r)
        key = r.case.key()
        trace = RequestTrace.read(tmp_path / f"{key}.json")
        held, bound = np.asarray(trace.held_blocks), np.asarray(trace.packing_bound)
        evicted = np.asarray(trace.epochs[0].evicted_round)
        if r.case.granularity == "block":
            assert set(np.bincount(np.flatnonzero(evicted >= 0) // B).tolist()) <= {0, B}, key  # whole blocks
            assert np.unique(evicted[evicted >= 0]).size >= 2, key  # evicted in two rounds
            assert np.array_equal(held, bound), key  # naive too: an evicted block leaves the row
        else:
            assert not oldest_first(first_victims(trace)), key  # ranked by the window, not by age


def test_snapkv_window_from_a_short_last_prefill_chunk(tmp_path):
    """Chunked prefill (64 tokens per step): a 150-token prompt ends with a 22-query chunk, which is the
    observation window (fewer queries than 32). The 140-token budget lets the prefill finish unevicted;
    SnapKV then ranks by that window at its first eviction and stays exact."""
    from vtoken.models.hf_reference import load_reference_model
    from vtoken.models.tiny import tiny_model

    path = tiny_model("llama")
    llm = start_engine(str(path), 32, str(tmp_path), max_num_batched_tokens=64, max_model_len=512)
    try:
        prompt = np.random.default_rng(6).integers(10, 500, 150).tolist()
        out = llm.generate(
            [{"prompt_token_ids": prompt}],
            [sp(24, policy="snapkv", mode="repack", budget=140, trace_id="chunk")],
            use_tqdm=False,
        )[0]
    finally:
        shutdown(llm)
    trace = RequestTrace.read(tmp_path / "chunk.json")
    assert sorted(set(trace.epochs[0].placed_round[:150])) == [0, 1, 2]  # the prompt took three steps
    check_against_reference(load_reference_model(path), prompt, out, trace)
    victims = first_victims(trace)
    assert victims.size > 0 and not oldest_first(victims)
