"""Hypothesis state machine over the engine-free cache manager, one per reclamation mode.

Random interleavings of append, evict, plan, apply, free, mark-shared and whole policy steps across
several requests sharing one pool. After every operation ``check_integrity()`` must pass; after every
applied plan ``repack`` sits exactly at the packing bound, ``naive`` holds exactly the naive rule's
blocks and never freed a block holding a live token, and the plan's move count equals its lower bound.
Each mode runs ≥ 25,000 operations (≥ 10⁵ in total), counted and asserted.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from vtoken.core.config import Mode, VTokenConfig
from vtoken.core.integrity import check_integrity
from vtoken.core.manager import CacheManager
from vtoken.core.pool import PoolExhausted

B = 4
POOL = 48
OPS_PER_MODE = 25_000
EXAMPLES = 500
STEPS = 60


def lower_bound_moves(table) -> int:
    """Live tokens sitting at or beyond slot ``live``: each must move once for the row to be dense."""
    slots = table.slot_of[table.live_logicals()]
    return int(np.count_nonzero(slots >= table.live))


class ManagerMachine(RuleBasedStateMachine):
    mode: Mode = Mode.REPACK
    ops = 0

    def __init__(self) -> None:
        super().__init__()
        cfg = VTokenConfig(policy="random", budget="0.5", mode=self.mode, block_size=B, sinks=1, recent=2)
        self.m = CacheManager(cfg, num_blocks=POOL)
        self.next_id = 0
        self.pending: dict[str, object] = {}

    def _count(self) -> None:
        type(self).ops += 1

    def _rid(self, data) -> str:
        return data.draw(st.sampled_from(sorted(self.m.tables)))

    @rule()
    def add_request(self) -> None:
        self._count()
        if len(self.m.tables) < 6:
            self.m.add_request(f"r{self.next_id}")
            self.next_id += 1

    @precondition(lambda self: self.m.tables)
    @rule(data=st.data(), n=st.integers(1, 9))
    def append(self, data, n) -> None:
        self._count()
        rid = self._rid(data)
        before = (self.m.pool.num_free, len(self.m.rows[rid]))
        try:
            self.m.place(rid, n)
        except PoolExhausted:
            assert (self.m.pool.num_free, len(self.m.rows[rid])) == before  # nothing changed
        self.pending.pop(rid, None)

    @precondition(lambda self: self.m.tables and self.mode is not Mode.NONE)
    @rule(data=st.data())
    def evict(self, data) -> None:
        self._count()
        rid = self._rid(data)
        t = self.m.tables[rid]
        live = t.live_logicals()
        cand = live[t.evictable(live, self.m.cfg.sinks, self.m.cfg.recent)]
        if cand.size:
            k = data.draw(st.integers(1, int(cand.size)))
            picks = data.draw(st.permutations(cand.tolist()))[:k]
            self.m.evict(rid, np.array(picks))
            self.pending.pop(rid, None)

    @precondition(lambda self: self.m.tables)
    @rule(data=st.data())
    def plan(self, data) -> None:
        self._count()
        rid = self._rid(data)
        t = self.m.tables[rid]
        plan = self.m.plan(rid)
        assert plan.num_moves == lower_bound_moves(t)
        assert plan.num_moves == int(np.count_nonzero(t.holes() < t.live))
        self.pending[rid] = plan

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def apply(self, data) -> None:
        self._count()
        rid = data.draw(st.sampled_from(sorted(self.pending)))
        plan = self.pending.pop(rid)
        t = self.m.tables[rid]
        freed = set(plan.freed_blocks)
        self.m.apply(plan)
        t.check(dense=True)
        row = self.m.rows[rid]
        live_blocks = {row[s // B] for s in t.slot_of[t.live_logicals()]}
        assert not freed & live_blocks, "a freed block still holds a live token"
        if self.mode in (Mode.REPACK, Mode.REUSE_REPACK):
            assert len(row) == math.ceil(t.live / B)  # the packing bound
        elif self.mode is Mode.NAIVE:
            assert len(row) == max(math.ceil(t.live / B), t.naive_blocks())
            original_live = np.unique(t.live_logicals() // B).size
            assert len(row) >= original_live  # never below the naive rule

    @precondition(lambda self: self.m.tables)
    @rule(data=st.data())
    def step(self, data) -> None:
        self._count()
        rid = self._rid(data)
        with contextlib.suppress(PoolExhausted):
            self.m.step(rid, 1)
        self.pending.pop(rid, None)

    @precondition(lambda self: self.m.tables)
    @rule(data=st.data())
    def mark_shared(self, data) -> None:
        self._count()
        rid = self._rid(data)
        t = self.m.tables[rid]
        n = data.draw(st.integers(0, t.pristine_blocks()))
        self.m.mark_shared(rid, n)

    @precondition(lambda self: self.m.tables)
    @rule(data=st.data())
    def free(self, data) -> None:
        self._count()
        rid = self._rid(data)
        self.m.free(rid)
        self.pending.pop(rid, None)

    @invariant()
    def integrity(self) -> None:
        check_integrity(self.m)


def machine_for(mode: Mode):
    cls = type(f"Machine_{mode.name}", (ManagerMachine,), {"mode": mode, "ops": 0})
    cls.TestCase.settings = settings(
        max_examples=EXAMPLES,
        stateful_step_count=STEPS,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
    )
    return cls


@pytest.mark.parametrize("mode", list(Mode), ids=lambda m: m.value)
def test_state_machine(mode):
    cls = machine_for(mode)
    cls.TestCase("runTest").runTest()
    assert cls.ops >= OPS_PER_MODE, f"only {cls.ops} operations ran"
