"""Copy-on-write of blocks a repack must not write (vtoken/core/cow.py; vtoken/vllm/blocks.rewrite_row).

Pure part: a step's survivors and moves, addressed through the row before (sources) and after (destinations)
the replacements, reproduce exactly the live tokens at row slots 0..live-1 in physical memory, never write a
frozen block, read and write disjoint slots, and copy exactly the tokens whose physical address changes
(the lower bound). Block part: ``rewrite_row`` on vLLM's own ``BlockPool`` — replaced blocks go back cached
(a later lookup finds them), shared blocks get the pool's blocks first, and with nothing free a cached block
is un-hashed and rewritten in place (a fallback).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vtoken.core.config import Mode
from vtoken.core.cow import frozen_written, physical_moves, plan_cow, spare_tail
from vtoken.core.eviction import StepDecision
from vtoken.core.manager import physical_slots
from vtoken.core.token_table import NO_TOKEN, TokenTable

FREE = -1


def simulate(t: TokenTable, victims, frozen, reuse: bool, extra_blocks: int = 0):
    """Evict ``victims`` from a table whose row is blocks 100, 101, … (``frozen[k]``: row block k must not be
    written), plan and apply, replace the written frozen blocks (spare tail blocks first, then fresh ids
    200, 201, …), run the physical copies gather-then-scatter on a memory that held the table's tokens.
    Returns everything the assertions need (pure)."""
    B = t.block_size
    n_rows = -(-t.extent // B) + extra_blocks
    old_row = np.arange(100, 100 + n_rows, dtype=np.int64)
    mem = {int(p): int(tok) for p, tok in zip(physical_slots(old_row, np.arange(t.extent), B), t.token_at[: t.extent])}
    before = dict(mem)
    t.evict(np.asarray(sorted(victims), np.int64))
    placed = t.place(1) if reuse and t.holes().size else None
    plan = t.plan()
    t.apply(plan)
    decision = StepDecision(victims=np.asarray(sorted(victims), np.int64), placed=placed, plan=plan)
    keep = min(plan.keep_blocks, n_rows)
    frozen = np.asarray(frozen[:n_rows] + [False] * (n_rows - len(frozen[:n_rows])), bool)
    spares = spare_tail(plan, keep, n_rows, ~frozen)
    replaced = frozen_written(decision, keep, frozen)
    new_row, fresh = old_row.copy(), 200
    for b in replaced.tolist():
        if spares:
            new_row[b] = old_row[spares.pop(0)]
        else:
            new_row[b], fresh = fresh, fresh + 1
    cow = plan_cow(plan, placed, replaced)
    src, dst = physical_moves(plan, cow, old_row, new_row)
    values = [mem.get(int(s), FREE) for s in src]  # gather every source, then scatter
    for d, v in zip(dst.tolist(), values):
        mem[d] = v
    return SimpleNamespace(
        t=t,
        plan=plan,
        placed=placed,
        keep=keep,
        frozen=frozen,
        old_row=old_row,
        new_row=new_row,
        replaced=replaced,
        cow=cow,
        src=src,
        dst=dst,
        mem=mem,
        before=before,
        decision=decision,
    )


def check(r) -> None:
    B, t = r.t.block_size, r.t
    placed = set() if r.placed is None else set(np.asarray(r.placed).tolist())
    # the live tokens sit at row slots 0..live-1 through the new row (the placed hole: the forward writes it)
    for s in range(t.live):
        if s in placed:
            continue
        assert r.mem[int(physical_slots(r.new_row, [s], B)[0])] == t.token_at[s], s
    # no frozen block is written; every block the step writes in the kept row is writable
    frozen_ids = set(r.old_row[r.frozen].tolist())
    assert not (set((r.dst // B).tolist()) & frozen_ids)
    for b in r.decision.written_blocks(r.keep).tolist():
        assert int(r.new_row[b]) not in frozen_ids, b
    for p, tok in r.before.items():
        if p // B in frozen_ids:
            assert r.mem[p] == tok  # frozen blocks hold exactly what they held
    # sources and destinations disjoint: gather-all-then-scatter-all is exact in any order
    assert not (set(r.src.tolist()) & set(r.dst.tolist()))
    assert len(set(r.dst.tolist())) == r.dst.size
    # copies == the lower bound: every live token whose physical address changed, once
    old_phys = {int(tok): p for p, tok in r.before.items() if tok != NO_TOKEN}
    changed = sum(
        1
        for s in range(t.live)
        if s not in placed and int(physical_slots(r.new_row, [s], B)[0]) != old_phys[int(t.token_at[s])]
    )
    assert r.src.size == r.cow.lower_bound == r.plan.lower_bound + r.cow.num_copies == changed
    # the packing bound is unchanged: the row keeps the plan's blocks
    assert r.keep == min(r.plan.keep_blocks, r.old_row.size)


def test_docstring_picture():
    """vtoken/core/cow.py: B = 4, row [H0 H1 T2], H0 H1 cached; t5 and t11 evicted."""
    t = TokenTable(block_size=4, mode=Mode.REPACK)
    t.place(12)
    r = simulate(t, [5, 11], [True, True, False], reuse=False)
    assert r.plan.moves.tolist() == [[10, 5]] and r.keep == 3
    assert r.replaced.tolist() == [1]  # H1 holds a destination; H0 is not written; T2 is writable
    assert r.cow.survivors.tolist() == [4, 6, 7]
    R = 200
    assert r.new_row.tolist() == [100, R, 102]
    assert r.src.tolist() == [102 * 4 + 2, 101 * 4 + 0, 101 * 4 + 2, 101 * 4 + 3]
    assert r.dst.tolist() == [R * 4 + 1, R * 4 + 0, R * 4 + 2, R * 4 + 3]
    check(r)


def test_spare_tail_block_replaces_and_no_source_is_overwritten():
    """A tail block the plan frees serves as the replacement when no move reads it."""
    t = TokenTable(block_size=4, mode=Mode.REPACK)
    t.place(16)
    # live 8 after evicting 1..8 of 16: holes 1..7 below live take 15, 14, 13, 12, 11, 10, 9; block 3 is read
    r = simulate(t, list(range(1, 9)), [True, True, False, False], reuse=False)
    assert r.keep == 2 and r.replaced.tolist() == [0, 1]
    # blocks 2 and 3 are sources: no spare, both replacements fresh
    assert r.new_row.tolist()[:2] == [200, 201]
    check(r)
    t = TokenTable(block_size=4, mode=Mode.REPACK)
    t.place(12)
    r = simulate(t, [1, 2, 3], [True, False, False], reuse=False, extra_blocks=1)  # row 100..103, 103 empty
    assert r.replaced.tolist() == [0] and r.new_row[0] == 103  # the empty spare at row index 3
    check(r)


def test_reuse_hole_in_a_cached_block_is_not_a_survivor():
    t = TokenTable(block_size=4, mode=Mode.REUSE_REPACK)
    t.place(10)
    r = simulate(t, [2], [True, True, False], reuse=True)
    assert r.placed is not None and r.placed.tolist() == [2]
    assert 2 not in r.cow.survivors.tolist() and r.replaced.tolist()[0] == 0
    check(r)


@settings(max_examples=400, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4]),
    n=st.integers(1, 40),
    data=st.data(),
    mode=st.sampled_from([Mode.REPACK, Mode.REUSE_REPACK, Mode.NAIVE]),
    extra=st.integers(0, 2),
    prior=st.booleans(),
)
def test_copy_on_write_is_exact(block_size, n, data, mode, extra, prior):
    t = TokenTable(block_size=block_size, mode=mode)
    t.place(n)
    if prior and n > 2:  # an earlier repack: the row is dense but tokens are out of order
        first = data.draw(st.sets(st.integers(0, n - 1), max_size=n - 1))
        if first:
            t.evict(np.asarray(sorted(first), np.int64))
            t.apply(t.plan())
        t.place(data.draw(st.integers(0, 6)))
    live = t.live_logicals().tolist()
    victims = data.draw(st.sets(st.sampled_from(live), max_size=len(live) - 1)) if len(live) > 1 else set()
    n_rows = -(-t.extent // block_size) + extra
    frozen = data.draw(st.lists(st.booleans(), min_size=n_rows, max_size=n_rows))
    check(simulate(t, victims, frozen, reuse=mode == Mode.REUSE_REPACK, extra_blocks=extra))


# --------------------------------------------------------------------- vtoken/vllm/scheduling/blocks.py on vLLM's pool
def _pool(num_blocks: int, B: int = 4):
    from vllm.v1.core.block_pool import BlockPool

    return BlockPool(num_blocks, enable_caching=True, hash_block_size=B)


def _hash(pool, blk, i: int) -> None:
    from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

    pool._insert_block_hash(make_block_hash_with_group_id(BlockHash(bytes([i]) * 32), 0), blk, None)


def _decision(n: int, victims, B: int = 4) -> StepDecision:
    t = TokenTable(block_size=B, mode=Mode.REPACK)
    t.place(n)
    t.evict(np.asarray(victims, np.int64))
    plan = t.plan()
    t.apply(plan)
    return StepDecision(victims=np.asarray(victims, np.int64), placed=None, plan=plan)


def test_rewrite_row_releases_cached_originals_and_they_stay_hits():
    from vllm.v1.core.kv_cache_utils import BlockHash

    from vtoken.vllm.scheduling import blocks

    pool = _pool(10)
    row = pool.get_new_blocks(3)  # [H0 H1 T2]
    for i in (0, 1):
        _hash(pool, row[i], i)
    ids = [b.block_id for b in row]
    mgr = SimpleNamespace(req_to_blocks={"r": row}, num_cached_block={"r": 2})
    rw = blocks.rewrite_row(pool, mgr, "r", _decision(12, [5, 11]))
    assert list(rw.replace) == [1] and rw.cow.num_copies == 3 and rw.fallbacks == 0 and rw.src.size == 4
    assert [b.block_id for b in mgr.req_to_blocks["r"]] == [ids[0], rw.replace[1], ids[2]]
    assert mgr.num_cached_block["r"] == 1
    assert [b.block_id for b in rw.release] == [ids[1]]
    blocks.release(pool, rw.release)
    (hit,) = pool.get_cached_block(BlockHash(bytes([1]) * 32), [0])
    assert hit.block_id == ids[1] and hit.ref_cnt == 0  # free, evictable, still a prefix-cache hit


def test_rewrite_row_falls_back_without_a_free_block_and_serves_shared_blocks_first():
    from vtoken.errors import IntegrityError
    from vtoken.vllm.scheduling import blocks

    pool = _pool(5)  # vLLM's null block + 4, all taken below
    row = pool.get_new_blocks(3)
    spare = pool.get_new_blocks(1)
    _hash(pool, row[0], 0)
    mgr = SimpleNamespace(req_to_blocks={"r": list(row)}, num_cached_block={})
    rw = blocks.rewrite_row(pool, mgr, "r", _decision(12, [1]))  # writes blocks 0 (hole) and 2 (frontier)
    assert rw.replace == {} and rw.fallbacks == 1 and row[0].block_hash is None  # un-hashed, rewritten
    assert rw.src.size == rw.cow.lower_bound == 1
    # shared block (ref 2) and cached block both written, one free block: the shared one gets it
    pool.free_blocks(spare)
    row2 = list(row)
    _hash(pool, row2[0], 7)
    pool.touch([row2[1]])  # another request holds block 1
    assert blocks.can_replace_shared(row2, 0, pool)
    mgr = SimpleNamespace(req_to_blocks={"r": row2}, num_cached_block={})
    rw = blocks.rewrite_row(pool, mgr, "r", _decision(12, [1, 5]))
    assert list(rw.replace) == [1] and rw.fallbacks == 1
    # a shared block with nothing to replace it: refused
    row3 = list(mgr.req_to_blocks["r"])
    pool.touch([row3[0]])
    mgr = SimpleNamespace(req_to_blocks={"r": row3}, num_cached_block={})
    assert not blocks.can_replace_shared(row3, 0, pool)
    with pytest.raises(IntegrityError):
        blocks.rewrite_row(pool, mgr, "r", _decision(12, [1]))
