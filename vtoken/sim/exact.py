"""The reference simulator: every request through the real core objects, one ``CacheManager`` per mode.

Slow (Python per request and step) but it *is* the production core: ``TokenTable``, the planner, the
policies and ``check_integrity``. The batched engine (``vtoken.sim.fast``) must match it exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from vtoken.core.config import Mode, VTokenConfig
from vtoken.core.integrity import check_integrity
from vtoken.core.manager import CacheManager
from vtoken.core.step_stats import StepScores
from vtoken.policies.context import Stat
from vtoken.sim.result import MODES, SimTally
from vtoken.sim.source import check_simulable


def request_name(index: int) -> str:
    """Request ids used by both engines (the Random policy salts its scores with them)."""
    return f"req-{index}"


def simulate_exact(
    cfg: VTokenConfig,
    source,
    prompt_len: int,
    gen_len: int,
    first_request: int = 0,
    check: bool = False,
    on_request: Callable[[], None] | None = None,
) -> SimTally:
    """Replay ``source`` (R requests) through the core for every mode. ``check``: integrity + pairing
    assertions at every step (for tests)."""
    check_simulable(cfg)
    R = source.num_requests
    T = prompt_len + gen_len
    B = cfg.block_size
    needs = cfg.policy_class.needs
    pre = source.prefill(prompt_len, Stat.UNIMPORTANT in needs, Stat.WINDOW in cfg.measured_stats())._asdict()
    tally = SimTally(gen_len)
    peaks = {m: np.zeros(R, np.int64) for m in MODES}
    moves = {m: [0, 0] for m in ("repack", "reuse+repack")}
    for r in range(R):
        rid = request_name(first_request + r)
        managers = {m: CacheManager(replace(cfg, mode=Mode(m)), num_blocks=math.ceil(T / B) + 1) for m in MODES}
        for mode, m in managers.items():
            m.add_request(rid, prompt_len)
            m.place(rid, prompt_len, source.key_norm[r, :prompt_len])
            if mode != "none":
                stats = {k: v[r] for k, v in pre.items()}
                m.observe(rid, StepScores(np.arange(prompt_len), prompt_len, **stats))
        for d in range(gen_len):
            n = prompt_len + d  # the decode token written in this step
            retained = {}
            for mode, m in managers.items():
                plan, _ = m.step(rid, 1, source.key_norm[r, n : n + 1])
                if mode in moves:
                    moves[mode][0] += plan.num_moves
                    moves[mode][1] += plan.slot_plan.lower_bound
                table = m.tables[rid]
                if mode != "none":
                    live = table.live_logicals()
                    a = source.attention_row(r, n, live)
                    low = (a < 1.0 / (n + 1)).astype(np.uint64)
                    m.observe(rid, StepScores(live, 1, accumulated=a, last=a, unimportant=low))
                retained[mode] = len(m.rows[rid])
                peaks[mode][r] = max(peaks[mode][r], retained[mode])
                if check:
                    check_integrity(m, dense=True)
            live_sets = [managers[m].tables[rid].live_logicals() for m in ("naive", "repack", "reuse+repack")]
            if check:
                assert all(np.array_equal(live_sets[0], s) for s in live_sets[1:]), "paired modes diverged"
            t = managers["repack"].tables[rid]
            tally.add_step(
                d, np.array([t.live]), np.array([t.packing_bound()]), {m: np.array([v]) for m, v in retained.items()}
            )
        if on_request is not None:
            on_request()
    tally.add_chunk(R, peaks, {m: tuple(v) for m, v in moves.items()})
    return tally
