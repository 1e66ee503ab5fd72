"""``trigger: pressure``'s pure selection and hysteresis (vtoken/core/batch/pressure.py), with hypothesis."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vtoken.core.batch.pressure import Candidate, batch_keys, blocks_for, candidate, plan_pressure
from vtoken.core.config import Trigger, VTokenConfig
from vtoken.core.eviction import choose_victims, eviction_count
from vtoken.core.token_table import TokenTable
from vtoken.errors import ConfigError

B = 4


@st.composite
def batches(draw):
    """A running batch of repack rows (dense: held = ⌈live/B⌉), each with some tokens above its floor."""
    cands = []
    for i in range(draw(st.integers(1, 5))):
        live = draw(st.integers(1, 40))
        n_new = draw(st.integers(1, 6))
        above = draw(st.integers(0, live))
        held = blocks_for(live, B)
        keys = np.sort(np.asarray(draw(st.lists(st.floats(0, 1), min_size=above, max_size=above)), np.float64))
        order = np.asarray(draw(st.permutations(range(live)))[:above], np.int64)
        cands.append(
            Candidate.repack(f"r{i}", live, held, n_new, blocks_for(live + n_new, B) - held, order, keys, block_size=B)
        )
    fixed = draw(st.integers(0, 3))
    need0 = fixed + sum(c.need(0) for c in cands)
    free = draw(st.integers(0, need0 + 4))
    margin = draw(st.integers(0, len(cands)))
    return cands, free, fixed, margin


def _need(cands, k, fixed):
    return fixed + sum(c.need(k.get(c.key, 0)) for c in cands)


@settings(max_examples=300, deadline=None)
@given(batches())
def test_nothing_is_evicted_while_the_step_fits(batch):
    cands, free, fixed, margin = batch
    d = plan_pressure(cands, free, fixed, margin)
    if _need(cands, {}, fixed) <= free:
        assert not d.fired and d.victims == {} and d.slack == free - _need(cands, {}, fixed)


@settings(max_examples=300, deadline=None)
@given(batches())
def test_a_round_takes_a_prefix_above_the_floor_frees_whole_blocks_and_reaches_the_margin(batch):
    cands, free, fixed, margin = batch
    d = plan_pressure(cands, free, fixed, margin)
    k = {key: v.size for key, v in d.victims.items()}
    by_key = {c.key: c for c in cands}
    for key, v in d.victims.items():
        c = by_key[key]
        assert v.size <= c.order.size  # never below the floor
        assert np.array_equal(v, np.sort(c.order[: v.size]))  # the request's own order, first first
        # every victim counts: one fewer would hold one more block (repacking returns whole blocks)
        assert c.after[v.size] < c.after[v.size - 1]
    assert d.slack == free - _need(cands, k, fixed)
    if d.fired:
        floors = {c.key: c.order.size for c in cands}
        if free - _need(cands, floors, fixed) >= margin:
            assert d.slack >= margin  # room at the floors: the round reaches the target
        else:
            assert d.slack == free - _need(cands, {c.key: c.useful(c.order.size) for c in cands}, fixed)


@settings(max_examples=300, deadline=None)
@given(batches(), st.integers(0, 64))
def test_hysteresis_no_new_round_until_the_batch_outgrows_the_margin(batch, steps):
    """After a round that reached its margin, the batch decodes ``steps`` more tokens per request: no round
    fires while the blocks that growth takes stay within the margin."""
    cands, free, fixed, margin = batch
    d = plan_pressure(cands, free, fixed, margin)
    if not d.fired or d.slack < margin:
        return
    after, free_after = [], free
    for c in cands:
        live = c.live - d.victims.get(c.key, np.zeros(0)).size
        held = blocks_for(live + c.n_new, B)  # what it holds once the round's step ran
        free_after -= held - c.held
        after.append((c, live + c.n_new, held))
    grown = [
        Candidate.repack(c.key, live + steps, held, 1, blocks_for(live + steps + 1, B) - held, block_size=B)
        for c, live, held in after
    ]
    growth = sum(g.need(0) for g in grown) + fixed
    again = plan_pressure(grown, free_after, fixed, margin)
    assert free_after - fixed >= margin  # the round left its margin
    assert again.fired == (growth > free_after)
    if steps == 0 and margin >= len(cands):  # the scheduler's margin: never a round on the next step
        assert not again.fired


def test_batch_order_crosses_requests():
    """The lowest keys of the whole batch go first: request a's cheap tokens before b's dear ones."""
    a = Candidate.repack("a", 12, 3, 1, 1, np.arange(8), np.full(8, 0.1), block_size=B)
    b = Candidate.repack("b", 12, 3, 1, 1, np.arange(8), np.full(8, 0.5), block_size=B)
    d = plan_pressure([a, b], free=1, fixed=0, margin=1)  # 2 blocks short of the target
    assert set(d.victims) == {"a"} and d.victims["a"].size == 5 and d.slack == 1


def test_a_waiting_request_counts_only_if_the_floors_can_make_room():
    a = Candidate.repack("a", 12, 3, 0, 0, np.arange(8), np.full(8, 0.1), block_size=B)  # 2 blocks at its floor
    d = plan_pressure([a], free=0, fixed=0, margin=0, admit=5)
    assert not d.admitted and d.victims == {}
    d = plan_pressure([a], free=0, fixed=0, margin=0, admit=1)
    assert d.admitted and d.victims["a"].size == 4 and d.slack == 0


def test_batch_keys():
    assert np.all(np.diff(batch_keys(np.array([1.0, 2.0, 2.0, 5.0]), 10.0)) >= 0)
    assert np.allclose(batch_keys(np.array([3.0, 9.0]), None), [1 / 3, 2 / 3])
    assert batch_keys(np.zeros(0), 1.0).size == 0


def test_the_budget_is_a_floor_and_candidates_follow_select():
    """With ``trigger: pressure`` nothing is due by the budget alone; a candidate's first ``k`` tokens are
    exactly what ``select`` would take for ``k`` under trigger ``step``."""
    cfg = VTokenConfig(
        policy="random", budget=0.25, mode="repack", block_size=B, sinks=1, recent=2, trigger="pressure", scope="all"
    )
    t = TokenTable(block_size=B, mode=cfg.mode, prompt_len=40)
    t.place(40)
    assert eviction_count(t.live, t.seen, t.prompt_len, cfg) == 0
    pol = cfg.make_policy()
    c = candidate("r", t, pol, cfg, salt=7, held=10, n_new=1)
    assert c.order.size == 40 - 10  # down to the floor, ⌈0.25 · 40⌉ = 10 kept
    step = VTokenConfig(policy="random", budget=0.25, mode="repack", block_size=B, sinks=1, recent=2, scope="all")
    assert np.array_equal(np.sort(c.order), choose_victims(t, pol, step, salt=7))
    assert np.all(np.diff(c.keys) >= 0)


def test_pressure_refuses_keep_mass_and_block_granularity():
    for extra in ({"keep_mass": 0.9}, {"granularity": "block"}):
        with pytest.raises(ConfigError, match="trigger 'pressure'"):
            VTokenConfig(policy="h2o", budget=0.5, trigger=Trigger.PRESSURE, **extra)


def test_naive_rows_count_by_the_naive_rule():
    """A naive row returns an original block only once all its tokens are dead: ``after`` follows the
    table's own count after each prefix of the victims (``required_blocks_after_place`` after evicting)."""
    from vtoken.core.batch.pressure import naive_after

    cfg = VTokenConfig(
        policy="random", budget=0.25, mode="naive", block_size=B, sinks=1, recent=2, trigger="pressure", scope="all"
    )
    t = TokenTable(block_size=B, mode=cfg.mode, prompt_len=30)
    t.place(30)
    c = candidate("r", t, cfg.make_policy(), cfg, salt=3, held=8, n_new=1)
    after = naive_after(t, c.order, 1)
    assert np.array_equal(c.after, after) and np.all(np.diff(after) <= 0)
    for k in range(c.order.size + 1):
        u = TokenTable(block_size=B, mode=cfg.mode, prompt_len=30)
        u.place(30)
        if k:
            u.evict(np.sort(c.order[:k]), cfg.sinks, cfg.recent)
            u.apply(u.plan())  # dense again, as decide_step leaves it
        assert after[k] == u.required_blocks_after_place(1), k


def test_the_simulator_refuses_pressure():
    """The simulator gives each request its own memory: nothing could ever run short, so it refuses."""
    from vtoken.sim.run import SimConfig

    with pytest.raises(ConfigError, match="trigger 'pressure'"):
        SimConfig.of(policy="h2o", budget=0.2, trigger="pressure")
