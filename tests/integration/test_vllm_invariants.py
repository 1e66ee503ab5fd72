"""The always-on KV invariants (vtoken/vllm/scheduling/invariants.py) on vLLM's real ``BlockPool``, and in the engine
with a deliberately leaking copy of the block release (it must fire: logged and counted, or raised)."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

from vtoken.core.config import VTokenConfig
from vtoken.core.token_table import TokenTable
from vtoken.errors import ConfigError, IntegrityError
from vtoken.vllm.config import EngineSettings
from vtoken.vllm.offline.launch import scheduler_of
from vtoken.vllm.scheduling.invariants import pool_violations, table_violations


def pool(n: int = 16):
    from vllm.v1.core.block_pool import BlockPool

    return BlockPool(num_gpu_blocks=n, enable_caching=True, hash_block_size=32)


def test_a_consistent_pool_has_no_violation_and_shared_blocks_count_each_holder():
    p = pool()
    a, b = p.get_new_blocks(3), p.get_new_blocks(2)
    p.touch(a[:1])  # request c shares a's first block (prefix hit): ref_cnt 2
    rows = {"a": a, "b": b, "c": a[:1]}
    assert pool_violations(p, rows.items(), []) == []
    deferred = rows.pop("b")  # vLLM holds b's blocks for a later free
    assert pool_violations(p, rows.items(), [deferred]) == []


def test_a_leaked_block_and_a_miscounted_one_are_named():
    p = pool()
    a = p.get_new_blocks(3)
    leaked = a.pop()  # dropped from the row, never freed
    found = pool_violations(p, [("a", a)], [])
    assert len(found) == 1 and "leaked" in found[0] and str(leaked.block_id) in found[0]
    p.touch(a[:1])  # a reference nobody holds
    found = pool_violations(p, [("a", a + [leaked])], [])
    assert any("ref_cnt is not their holder count" in f and "request a" in f for f in found)


def test_vllm_free_count_off_is_a_violation():
    p = pool()
    a = p.get_new_blocks(2)
    p.free_block_queue.num_free_blocks -= 1  # the queue lost count
    found = pool_violations(p, [("a", a)], [])
    assert any("free blocks" in f for f in found)


def test_table_violations_name_the_request():
    p = pool()
    t = TokenTable(block_size=4)
    t.place(6)  # needs 2 blocks
    row = p.get_new_blocks(3)  # holds one too many
    found = table_violations({"r": row}, {"r": t}, {"r": []})
    assert found == ["request r: holds 3 blocks, its token table accounts for 2"]
    assert table_violations({"r": row[:2]}, {"r": t}, {"r": []}) == []


@pytest.mark.parametrize(
    "bad,needle",
    [({"invariants": "loud"}, "valid values: off, log, fatal"), ({"invariant_period": -1}, "invariant_period")],
)
def test_bad_invariant_settings_are_named(bad, needle):
    with pytest.raises(ConfigError, match=needle):
        EngineSettings(cfg=VTokenConfig(), **bad)


# --------------------------------------------------------------------------------------- in the engine
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from vtoken.models.tiny import tiny_model
    from vtoken.vllm.offline.launch import start_engine

    llm = start_engine(
        str(tiny_model("llama")), 32, str(tmp_path_factory.mktemp("inv")), max_model_len=512, recent=8, check=False
    )  # invariants: log (the serving default)
    yield llm
    llm.llm_engine.engine_core.shutdown()


def run(llm, n: int = 4, seed: int = 0):
    from vllm import SamplingParams

    rng = np.random.default_rng(seed)
    prompts = [{"prompt_token_ids": rng.integers(10, 500, 120).tolist()} for _ in range(n)]
    params = SamplingParams(
        max_tokens=48, temperature=0.0, ignore_eos=True, extra_args={"vtoken": {"policy": "h2o", "budget": 0.3}}
    )
    llm.generate(prompts, [params] * n, use_tqdm=False)


@pytest.mark.slow
def test_idle_check_runs_clean_then_fires_on_a_leaking_copy(engine, monkeypatch, caplog):
    sched = scheduler_of(engine)
    run(engine)
    c0 = sched.vtoken_stats().counters
    assert c0.invariant_checks >= 1 and c0.invariant_violations == 0  # idle after the batch: checked, clean
    assert c0.evicted_tokens > 0 and c0.reclaimed_blocks > 0  # repack released blocks: the path under test

    block_pool = sched.kv_cache_manager.block_pool
    real_free = block_pool.free_blocks
    leaked = []

    def leaky_free(blocks):  # the broken copy: repack's release keeps the last block of every batch
        blocks = list(blocks)
        if blocks:
            leaked.append(blocks.pop())
        real_free(blocks)

    monkeypatch.setattr(block_pool, "free_blocks", leaky_free)
    monkeypatch.setattr(
        "vtoken.vllm.scheduling.blocks.release", lambda bp, blocks: leaky_free(blocks) if blocks else None
    )
    with caplog.at_level(logging.ERROR, logger="vtoken.vllm"):
        run(engine, seed=1)
    c1 = sched.vtoken_stats().counters
    assert leaked, "the leaking copy never ran"
    assert c1.invariant_violations > c0.invariant_violations, "the leak went unseen"
    assert any("KV invariant violated (idle)" in r.getMessage() and "leaked" in r.getMessage() for r in caplog.records)
    assert c1.invariant_seconds > c0.invariant_seconds
    # fatal (tests): the same state raises
    monkeypatch.setattr(sched, "vt", dataclasses.replace(sched.vt, invariants="fatal"))
    with pytest.raises(IntegrityError, match="7: KV invariants"):
        sched._vt_check_invariants({}, idle=True)
    counted = sched.vtoken_stats().counters.invariant_violations
    assert counted > c1.invariant_violations  # counted before it raised
    # repair the pool for whoever runs next on this engine: clean again
    monkeypatch.undo()
    block_pool.free_blocks(leaked)
    sched._vt_check_invariants({}, idle=True)
    assert sched.vtoken_stats().counters.invariant_violations == counted
