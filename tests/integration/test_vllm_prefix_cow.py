"""Shared prompts stay cached under eviction (issue 14): in vLLM's real engine with prefix caching on, a
request that evicts from prefix-cached blocks never rewrites them — it copies their live tokens into other
blocks (vtoken/core/cow.py, vtoken/vllm/blocks.rewrite_row) and the cached originals go back to vLLM's pool
with their hashes, so the next request with the same system prompt hits all of it, as without eviction.

Sequential requests share a 256-token system prompt (8 blocks of 32), each adds 64 user tokens and
generates 32; every (policy, mode) runs the same prompts after a prefix-cache reset. Exactness: each request
against the HF model with the same keys masked, repack and reuse+repack against the paired naive run (same
salts, so same decisions); blocks: ⌈live/B⌉ held at every step; ``check: true`` (token table and
prefix-cache hash checks) is on in every step.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.engine import check_against_reference, shutdown, sp

from vtoken.vllm.offline.launch import scheduler_of, start_engine
from vtoken.vllm.scheduling.trace import RequestTrace

pytestmark = pytest.mark.slow

B = 32
SYSTEM, USER, GEN, N = 256, 64, 32, 4
SEQUENCES = [
    ("h2o", "none"),
    ("h2o", "naive"),
    ("h2o", "repack"),
    ("h2o", "reuse+repack"),
    ("random", "naive"),
    ("random", "repack"),
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """Prefix caching on, whole prompts in one step (prompt blocks are hashed before the first eviction),
    1 GiB pool (a replacement block is always free: no fallback)."""
    from vtoken.models.tiny import tiny_model

    d = tmp_path_factory.mktemp("traces")
    llm = start_engine(
        str(tiny_model("llama")), B, str(d), enable_prefix_caching=True, max_model_len=512, recent=8, check=True
    )
    yield llm, d
    shutdown(llm)


def run_sequence(llm, policy: str, mode: str, prompts: list[list[int]]):
    """The prompts one after another (each finishes before the next arrives), from an empty prefix cache."""
    assert llm.reset_prefix_cache()
    outs = []
    for i, p in enumerate(prompts):
        params = sp(GEN, policy=policy, mode=mode, budget=0.3, salt=1000 + i, trace_id=f"{policy}-{mode}-{i}")
        outs.append(llm.generate([{"prompt_token_ids": p}], [params], use_tqdm=False)[0])
    return outs


def test_sequential_shared_prompt_hits_as_without_eviction(engine, ref_llama):
    llm, d = engine
    rng = np.random.default_rng(14)
    system = rng.integers(10, 500, SYSTEM).tolist()
    prompts = [system + rng.integers(10, 500, USER).tolist() for _ in range(N)]
    sched = scheduler_of(llm)
    before = sched.vtoken_stats().counters
    outs = {seq: run_sequence(llm, *seq, prompts) for seq in SEQUENCES}
    after = sched.vtoken_stats().counters

    hits = {seq: [o.num_cached_tokens for o in out] for seq, out in outs.items()}
    assert hits[("h2o", "none")] == [0] + [SYSTEM] * (N - 1)
    for seq in SEQUENCES:
        assert hits[seq] == hits[("h2o", "none")], (seq, hits[seq])

    for (policy, mode), out in outs.items():
        for i, o in enumerate(out):
            trace = RequestTrace.read(d / f"{policy}-{mode}-{i}.json")
            check_against_reference(ref_llama, prompts[i], o, trace)
            assert trace.epochs[0].hits == hits[(policy, mode)][i]
            if mode == "none":
                continue
            assert trace.evicted > 0 and trace.cow_blocks > 0 and trace.cow_moves > 0, (policy, mode, i)
            held, bound = np.asarray(trace.held_blocks), np.asarray(trace.packing_bound)
            if mode != "naive":
                assert np.array_equal(held, bound), (policy, mode, i)  # ⌈live/B⌉ at every step
        if mode in ("repack", "reuse+repack"):
            naive = outs[(policy, "naive")]
            for o, n in zip(out, naive):
                assert list(o.outputs[0].token_ids) == list(n.outputs[0].token_ids), (policy, mode)

    assert after.cow_blocks > before.cow_blocks and after.cow_moves > before.cow_moves
    assert after.cow_fallbacks == before.cow_fallbacks  # a replacement was always free
    assert after.repack_moves - before.repack_moves >= after.cow_moves - before.cow_moves
