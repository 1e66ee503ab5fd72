"""Small cases with hand-computed slot and block ids."""

import numpy as np
import pytest

from vtoken.core.config import Budget, Mode, Trigger, VTokenConfig
from vtoken.core.integrity import check_integrity
from vtoken.core.manager import CacheManager
from vtoken.core.pool import BlockPool, PoolExhausted
from vtoken.core.token_table import NO_TOKEN, TokenTable
from vtoken.errors import ConfigError, IntegrityError
from vtoken.policies import policy_names


def architecture_picture(mode: Mode) -> TokenTable:
    """docs/architecture.md §1: B = 4, 12 tokens, t1 t2 t4 t5 t7 t10 evicted, 6 live."""
    t = TokenTable(block_size=4, mode=mode)
    t.place(12)
    t.evict([1, 2, 4, 5, 7, 10])
    return t


def test_picture_holes_and_naive_blocks():
    t = architecture_picture(Mode.REPACK)
    assert t.holes().tolist() == [1, 2, 4, 5, 7, 10]
    assert (t.live, t.extent, t.seen) == (6, 12, 12)
    assert t.naive_blocks() == 3  # no block is empty
    assert t.packing_bound() == 2


def test_picture_plan_fills_holes_below_live_from_the_tail():
    t = architecture_picture(Mode.REPACK)
    plan = t.plan()
    # holes below live=6: 1 2 4 5; tail live tokens at slots >= 6: 6 8 9 11 taken from the end
    assert plan.moves.tolist() == [[11, 1], [9, 2], [8, 4], [6, 5]]
    assert plan.keep_blocks == 2
    t.apply(plan)
    assert t.token_at[:6].tolist() == [0, 11, 9, 3, 8, 6]
    assert t.token_at[6:12].tolist() == [NO_TOKEN] * 6
    assert t.slot_of[[0, 3, 6, 8, 9, 11]].tolist() == [0, 3, 5, 4, 2, 1]
    t.check(dense=True)


def test_plan_is_immutable_and_single_use():
    t = architecture_picture(Mode.REPACK)
    plan = t.plan()
    with pytest.raises(ValueError):
        plan.moves[0, 0] = 3
    t.apply(plan)
    with pytest.raises(ValueError, match="stale plan"):
        t.apply(plan)


def test_manager_physical_slots_and_freed_block_ids():
    cfg = VTokenConfig(policy="h2o", budget=6, mode="repack", block_size=4, sinks=0, recent=0)
    m = CacheManager(cfg, num_blocks=8)
    m.add_request("a")
    slots = m.place("a", 12)
    assert m.rows["a"] == [0, 1, 2]
    assert slots.tolist() == list(range(12))
    m.evict("a", np.array([1, 2, 4, 5, 7, 10]))
    plan = m.plan("a")
    assert plan.moves.tolist() == [[11, 1], [9, 2], [8, 4], [6, 5]]
    assert plan.freed_blocks == (2,)
    assert m.pool.num_free == 5  # nothing returns before apply
    m.apply(plan)
    assert m.rows["a"] == [0, 1] and m.pool.num_free == 6
    check_integrity(m, dense=True)
    # LIFO: the freed block is the next one handed out
    m.add_request("b")
    assert m.place("b", 1).tolist() == [2 * 4]


def test_naive_holds_until_every_original_token_is_dead():
    cfg = VTokenConfig(policy="h2o", budget=4, mode="naive", block_size=4, sinks=0, recent=0)
    m = CacheManager(cfg, num_blocks=8)
    m.add_request("a")
    m.place("a", 12)
    m.evict("a", np.array([0, 1, 2, 5, 9, 10, 11]))  # block 0 keeps t3, block 1 keeps t4 t6 t7, block 2 t8
    plan = m.plan("a")
    assert plan.freed_blocks == ()  # every original block still has a live token
    m.apply(plan)
    assert len(m.rows["a"]) == 3
    m.evict("a", np.array([8]))  # original block 2 is now empty
    plan = m.plan("a")
    assert plan.freed_blocks == (2,)
    m.apply(plan)
    check_integrity(m, dense=True)


def test_reuse_places_decode_token_into_lowest_hole():
    t = architecture_picture(Mode.REUSE_REPACK)
    assert t.place(1).tolist() == [1]
    plan = t.plan()
    # live = 7 now: holes below 7 are 2 4 5 -> 3 moves instead of 4
    assert plan.moves.tolist() == [[11, 2], [9, 4], [8, 5]]
    t.apply(plan)
    t.check(dense=True)
    # a multi-token step appends in order (causal mask)
    t.evict([3])
    assert t.place(2).tolist() == [7, 8]


def test_protected_tokens_cannot_be_evicted():
    t = TokenTable(block_size=4, mode=Mode.REPACK)
    t.place(16)
    with pytest.raises(ValueError, match="protected"):
        t.evict([1], sinks=2, recent=0)
    with pytest.raises(ValueError, match="protected"):
        t.evict([14], sinks=0, recent=4)
    t.mark_shared(2)
    with pytest.raises(ValueError, match="protected"):
        t.evict([5])
    t.evict([9])
    assert t.plan().moves.tolist() == [[15, 9]]


def test_only_pristine_blocks_can_be_shared():
    t = TokenTable(block_size=4, mode=Mode.REPACK)
    t.place(12)
    t.evict([5])
    assert t.pristine_blocks() == 1
    with pytest.raises(ValueError, match="pristine"):
        t.mark_shared(2)
    t.mark_shared(1)


def test_none_mode_never_evicts():
    t = TokenTable(block_size=4, mode=Mode.NONE)
    t.place(8)
    with pytest.raises(ConfigError, match="none"):
        t.evict([3])


def test_check_names_the_broken_invariant():
    t = architecture_picture(Mode.REPACK)
    t.token_at[1] = 0  # slot 1 now claims token 0 too
    with pytest.raises(IntegrityError) as err:
        t.check()
    assert "one owner per slot" in str(err.value)
    t = architecture_picture(Mode.REPACK)
    with pytest.raises(IntegrityError, match="3: dense row"):
        t.check(dense=True)


def test_pool_double_free_and_exhaustion():
    p = BlockPool(2)
    a = p.allocate(2)
    with pytest.raises(PoolExhausted):
        p.allocate(1)
    p.free(a)
    with pytest.raises(ValueError, match="freed twice"):
        p.free([a[0]])


def test_budget_parsing_and_tokens():
    assert Budget.parse("0.2").tokens(100) == 20
    assert Budget.parse("0.25").tokens(10) == 3
    assert Budget.parse("64").tokens(100) == 64
    assert Budget.parse("64").tokens(10) == 10
    for bad in ["0", "1.5", "-3", "abc", "nan", ""]:
        with pytest.raises(ConfigError, match="budget"):
            Budget.parse(bad)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"policy": "lru"}, f"valid policies: {', '.join(policy_names())}"),
        ({"mode": "compact"}, "valid modes: none, naive, repack, reuse+repack"),
        ({"trigger": "often"}, f"valid triggers: {', '.join(t.value for t in Trigger)}"),
        ({"block_size": 24}, "power of two, got 24"),
        ({"block_size": 0}, "positive integer, got 0"),
        ({"sinks": -1}, "sinks must be a non-negative integer, got -1"),
        ({"budget": "2.0"}, "invalid budget '2.0': give a fraction in (0, 1]"),
        ({"budget": 0.0}, "budget fraction must be in (0, 1], got 0.0"),
    ],
)
def test_config_errors_name_the_value(kwargs, needle):
    with pytest.raises(ConfigError) as err:
        VTokenConfig(**kwargs)
    assert needle in str(err.value)


def test_derived_gauges():
    from vtoken.core.reporting.engine_kv import fragmentation_ratio, kv_utilization

    # docs/architecture.md §1, the naive layout
    assert fragmentation_ratio(live_tokens=6, held_blocks=3, block_size=4) == 0.5
    assert fragmentation_ratio(6, 2, 4) == 0.25  # packed
    assert fragmentation_ratio(0, 0, 4) == 0.0
    assert kv_utilization(3, 12) == 0.25 and kv_utilization(5, 0) == 0.0
