"""One matrix over every registered policy × reclamation mode, through the engine-free core."""

import math
from fractions import Fraction

import numpy as np
import pytest

from vtoken.core.config import Mode, VTokenConfig
from vtoken.core.integrity import check_integrity
from vtoken.core.manager import CacheManager
from vtoken.core.step_stats import StepScores, mean_cosine
from vtoken.policies import get_policy_class, make_policy, policy_names
from vtoken.policies.context import Stat
from vtoken.sim.source import SyntheticConfig, SyntheticSource

P, M, B, BUDGET, SINKS, RECENT = 96, 48, 8, 0.25, 2, 6


@pytest.fixture(scope="module")
def source():
    return SyntheticSource(SyntheticConfig(), num_requests=2, num_tokens=P + M, seed=7)


def keys_with_repeats(r: int) -> np.ndarray:
    """Request ``r``'s keys ``[P + M, 2 heads, 8]``: a quarter of them distinct, the rest noisy copies (the
    synthetic source has no keys; R-KV's redundancy is measured from these, as the worker would)."""
    rng = np.random.default_rng(100 + r)
    base = rng.normal(size=((P + M) // 4, 2, 8))
    return base[rng.integers(0, base.shape[0], P + M)] + 0.1 * rng.normal(size=(P + M, 2, 8))


def run(policy: str, mode: Mode, source, r: int = 0, granularity: str = "token"):
    cfg = VTokenConfig(
        policy=policy, budget=BUDGET, mode=mode, block_size=B, sinks=SINKS, recent=RECENT, granularity=granularity
    )
    m = CacheManager(cfg, num_blocks=64)
    rid = f"req-{r}"
    m.add_request(rid)
    m.place(rid, P, source.key_norm[r, :P])
    total, last, bits, window = source.prefill(P, need_bits=True, need_window=True)
    keys = keys_with_repeats(r)
    m.observe(
        rid, StepScores(np.arange(P), P, total[r], last[r], bits[r], window=window[r], redundancy=mean_cosine(keys[:P]))
    )
    history = []
    for d in range(M):
        n = P + d
        plan, _ = m.step(rid, 1, source.key_norm[r, n : n + 1])
        t = m.tables[rid]
        live = t.live_logicals()
        a = source.attention_row(r, n, live)
        m.observe(
            rid, StepScores(live, 1, a, a, (a < 1 / (n + 1)).astype(np.uint64), redundancy=mean_cosine(keys[live]))
        )
        check_integrity(m, dense=True)
        assert plan.num_moves == plan.slot_plan.lower_bound
        history.append((live.copy(), len(m.rows[rid])))
    return m, history


@pytest.mark.parametrize("granularity", ["token", "block"])
@pytest.mark.parametrize("mode", list(Mode), ids=lambda m: m.value)
@pytest.mark.parametrize("policy", policy_names())
def test_policy_mode_matrix(policy, mode, granularity, source):
    m, history = run(policy, mode, source, granularity=granularity)
    for d, (live, held) in enumerate(history):
        seen = P + d + 1
        protected = min(SINKS, seen) + RECENT
        if mode is Mode.NONE:
            assert live.size == seen and held == math.ceil(seen / B)
            continue
        # the budget holds (down to the protected set), and protected tokens are alive
        assert live.size <= max(math.ceil(BUDGET * (seen - 1)) + 1, protected + 1)
        assert set(range(SINKS)) <= set(live.tolist())
        assert set(range(seen - RECENT, seen)) <= set(live.tolist())
        if granularity == "block":  # whole original blocks go, at most one block's worth below the budget,
            assert live.size >= math.ceil(BUDGET * (seen - 1)) - B + 2
            assert set(np.bincount(live // B, minlength=seen // B)[: seen // B]) <= {0, B}
            assert held == math.ceil(live.size / B)  # and naive frees them outright: naive = packing bound
        if mode in (Mode.REPACK, Mode.REUSE_REPACK):
            assert held == math.ceil(live.size / B)
        else:
            assert held == max(math.ceil(live.size / B), np.unique(live // B).size)


@pytest.mark.parametrize("granularity", ["token", "block"])
@pytest.mark.parametrize("policy", policy_names())
def test_paired_modes_evict_the_same_tokens(policy, granularity, source):
    lives = {
        mode: [h[0] for h in run(policy, mode, source, r=1, granularity=granularity)[1]]
        for mode in (Mode.NAIVE, Mode.REPACK, Mode.REUSE_REPACK)
    }
    for a, b, c in zip(*lives.values()):
        assert np.array_equal(a, b) and np.array_equal(a, c)


def test_policies_differ_on_real_structure(source):
    """Attention-aware policies keep different tokens than random/streaming ones (the scores are used).
    SnapKV ranks generated tokens above the prompt, so at this budget it ends with StreamingLLM's set (only
    generated tokens left): every policy must differ at the first decode step (all choose from the prompt)."""
    histories = {p: run(p, Mode.REPACK, source)[1] for p in policy_names()}
    final = {p: set(h[-1][0].tolist()) for p, h in histories.items() if p != "snapkv"}
    assert len({frozenset(s) for s in final.values()}) == len(final)
    first = {p: frozenset(h[0][0].tolist()) for p, h in histories.items()}
    assert len(set(first.values())) == len(first)


@pytest.mark.parametrize("policy", policy_names())
def test_every_policy_cites_its_paper_and_is_small(policy):
    cls = get_policy_class(policy)
    assert "arxiv.org" in (cls.__doc__ or ""), f"{policy} must cite its paper"
    import inspect

    assert len(inspect.getsource(inspect.getmodule(cls)).splitlines()) <= 40
    make_policy(policy, seed=3)  # constructible with a seed


def test_select_orders_by_score_then_age():
    policy = make_policy("streamingllm")
    from vtoken.policies.context import EvictionContext

    logical = np.arange(10)
    z = np.zeros(10)
    ctx = EvictionContext(logical, 10, 0, z, z, np.zeros(10, np.uint64), z)
    evictable = np.ones(10, bool)
    evictable[:2] = False
    assert policy.select(ctx, 3, evictable).tolist() == [2, 3, 4]
    h2o = make_policy("h2o")
    assert h2o.select(ctx, 2, evictable).tolist() == [2, 3]  # all tied: oldest first
    batch = EvictionContext(
        np.stack([logical] * 2),
        10,
        np.array([[0], [1]]),
        np.stack([z] * 2),
        np.stack([z] * 2),
        np.zeros((2, 10), np.uint64),
        np.stack([z] * 2),
    )
    mask = h2o.select_batch(batch, np.array([2, 2]), np.stack([evictable] * 2))
    assert np.flatnonzero(mask[0]).tolist() == [2, 3]
    mask = h2o.select_batch(batch, np.array([6, 6]), np.stack([evictable] * 2))
    assert np.flatnonzero(mask[1]).tolist() == [2, 3, 4, 5, 6, 7]


def test_non_finite_scores_are_rejected():
    from vtoken.policies.context import EvictionContext

    bad = np.array([0.0, np.nan, 1.0])
    ctx = EvictionContext(np.arange(3), 3, 0, bad, bad, np.zeros(3, np.uint64), bad)
    with pytest.raises(ValueError, match="non-finite"):
        make_policy("h2o").select(ctx, 1, np.ones(3, bool))


# ---------------------------------------------------------------- the exact number of evictions
# Every engine (exact sim, fast sim, vLLM scheduler) asks ``eviction_count`` how many tokens to evict, so
# an over-eviction there would pass every bound above and inflate every retained-block figure. The test
# below recomputes the live count with its own recurrence (no ``eviction_count``, no ``Budget.tokens``).
EB, E_SINKS, E_RECENT = 8, 2, 6  # 8 protected tokens: ⌈0.14·seen⌉ is below that early on, above it later
E_CHUNKS, E_DECODE = (37, 27), 40  # a chunked prefill (two decisions with several new tokens), then decode
E_BUDGETS = {"fraction": "0.14", "count": "12"}  # 0.14·100 = 14.000000000000002 in floats


def expected_eviction(live: int, seen: int, budget: str, trigger: str) -> int:
    """The test's own rule: target = ⌈f·seen⌉ (exact rational arithmetic) or min(count, seen); only
    unprotected tokens can go; trigger=block waits until the request is a whole block over."""
    target = math.ceil(Fraction(budget) * seen) if "." in budget else min(int(budget), seen)
    protected = len(set(range(min(E_SINKS, seen))) | set(range(max(seen - E_RECENT, 0), seen)))
    over = live - target
    if over <= 0 or (trigger == "block" and over < EB):
        return 0
    return min(over, live - protected)


def step_scores(source, r: int, live: np.ndarray, first: int, n_new: int) -> StepScores:
    """Synthetic attention of the step's queries ``first .. first+n_new-1`` over the live keys (causal)."""
    acc = np.zeros(live.size)
    bits = np.zeros(live.size, np.uint64)
    for s in range(first, first + n_new):
        vis = live <= s
        a = np.zeros(live.size)
        a[vis] = source.attention_row(r, s, live[vis])
        acc += a
        bits = (bits << np.uint64(1)) | ((a < 1 / vis.sum()) & vis).astype(np.uint64)
    return StepScores(live, n_new, acc, a, bits)


@pytest.mark.parametrize("budget", E_BUDGETS.values(), ids=E_BUDGETS.keys())
@pytest.mark.parametrize("trigger", ["step", "block"])
@pytest.mark.parametrize("mode", [m for m in Mode if m.evicts], ids=lambda m: m.value)
@pytest.mark.parametrize("policy", policy_names())
def test_every_step_evicts_exactly_down_to_the_budget(policy, mode, trigger, budget, source):
    cfg = VTokenConfig(
        policy=policy, budget=budget, mode=mode, block_size=EB, sinks=E_SINKS, recent=E_RECENT, trigger=trigger
    )
    m = CacheManager(cfg, num_blocks=64)
    m.add_request("req-0")
    live_expected, evicting_steps = 0, 0
    for n_new in (*E_CHUNKS, *[1] * E_DECODE):
        t = m.tables["req-0"]
        seen = t.seen
        assert t.live == live_expected
        k = expected_eviction(live_expected, seen, budget, trigger)
        evicting_steps += k > 0
        m.step("req-0", n_new, source.key_norm[0, seen : seen + n_new])
        live_expected += n_new - k
        live = t.live_logicals()
        assert live.size == t.live == live_expected, (seen, n_new, k)
        seen = t.seen
        assert set(range(min(E_SINKS, seen))) | set(range(max(seen - E_RECENT, 0), seen)) <= set(live.tolist())
        m.observe("req-0", step_scores(source, 0, live, seen - n_new, n_new))
    assert evicting_steps >= (2 if trigger == "block" else 10)  # the recurrence was exercised


PROTECTIONS = {
    "tail": {"prompt_tail": 24},
    "generated": {"scope": "generated"},
    "generated+tail": {"scope": "generated", "prompt_tail": 24},
}


@pytest.mark.parametrize("mode", [Mode.NAIVE, Mode.REPACK], ids=lambda m: m.value)
@pytest.mark.parametrize("protection", PROTECTIONS.values(), ids=PROTECTIONS.keys())
@pytest.mark.parametrize("policy", policy_names())
def test_the_protected_prompt_is_never_evicted_and_the_budget_counts_what_the_scope_says(
    policy, protection, mode, source
):
    """``prompt_tail``: the prompt's last tokens stay live at every step; ``scope=generated``: every prompt
    token stays, and the live generated tokens are exactly the budget of the generated ones (above the
    recent window). The rest of the budget arithmetic is unchanged (``kept_live``)."""
    cfg = VTokenConfig(policy=policy, budget=BUDGET, mode=mode, block_size=B, sinks=SINKS, recent=RECENT, **protection)
    m = CacheManager(cfg, num_blocks=64)
    m.add_request("r", prompt_len=P)
    m.place("r", P, source.key_norm[0, :P])
    total, last, bits, window = source.prefill(P, need_bits=True, need_window=True)
    m.observe("r", StepScores(np.arange(P), P, total[0], last[0], bits[0], window=window[0]))
    lo, hi = cfg.kept_prompt(P)
    assert (lo, hi) == ((0, P) if cfg.scope.value == "generated" else (P - 24, P))
    evicted = 0
    for d in range(M):
        n = P + d
        m.step("r", 1, source.key_norm[0, n : n + 1])
        t = m.tables["r"]
        live = t.live_logicals()
        assert set(range(lo, hi)) <= set(live.tolist()), "a protected prompt token was evicted"
        generated_seen = t.seen - P
        if cfg.scope.value == "generated":
            kept_generated = live.size - P
            g = generated_seen - 1  # generated before this step's token, which is placed after eviction
            assert kept_generated == min(g + 1, max(math.ceil(BUDGET * g - 1e-9), min(RECENT, g)) + 1), d
        else:
            assert live.size <= max(math.ceil(BUDGET * (t.seen - 1)) + 1, SINKS + RECENT + 24 + 1)
        evicted = t.evicted_total
        a = source.attention_row(0, n, live)
        m.observe("r", StepScores(live, 1, a, a, (a < 1 / (n + 1)).astype(np.uint64)))
        check_integrity(m, dense=True)
    assert evicted > 0, "nothing was evicted: the test would prove nothing"


def test_kept_live_and_kept_prompt_known_answers():
    all_ = VTokenConfig(budget=0.25, prompt_tail=10, scope="all")
    gen = VTokenConfig(budget=0.25, scope="generated")
    assert all_.kept_prompt(100) == (90, 100) and all_.kept_prompt(4) == (0, 4)
    assert gen.kept_prompt(100) == (0, 100)
    assert all_.kept_live(seen=120, prompt_len=100) == 30  # 25 % of everything seen
    assert gen.kept_live(seen=120, prompt_len=100) == 100 + 5  # the prompt + 25 % of the 20 generated
    assert gen.kept_live(seen=60, prompt_len=100) == 60  # mid-prefill: nothing generated, nothing to evict
    assert VTokenConfig(budget=8, scope="generated").kept_live(seen=150, prompt_len=100) == 108


def test_question_aware_prompt_scores_rank_the_prompt_by_its_window(source):
    """``prompt_scores: window``: after the prefill H2O's accumulated attention of the prompt *is* the
    observation window's (so H2O then evicts what the prompt's last queries ignored); with ``all`` it is the
    sum over every query; policies that do not read ``accumulated`` are unaffected."""
    total, last, bits, window = source.prefill(P, need_bits=True, need_window=True)
    for ps, expected in (("all", total[0]), ("window", window[0])):
        cfg = VTokenConfig(policy="h2o", budget=BUDGET, block_size=B, sinks=SINKS, recent=RECENT, prompt_scores=ps)
        m = CacheManager(cfg, num_blocks=64)
        m.add_request("r", prompt_len=P)
        m.place("r", P, source.key_norm[0, :P])
        m.observe("r", StepScores(np.arange(P), P, total[0], last[0], bits[0], window=window[0]))
        np.testing.assert_array_equal(m.tables["r"].accumulated[:P], expected)
    assert VTokenConfig(policy="h2o", prompt_scores="window").measured_stats() == {Stat.ACCUMULATED, Stat.WINDOW}
    assert VTokenConfig(policy="h2o").measured_stats() == {Stat.ACCUMULATED}
    assert not VTokenConfig(policy="tova", prompt_scores="window").question_aware


def test_question_aware_prefill_changes_h2o_victims(source):
    cfgs = {
        ps: VTokenConfig(
            policy="h2o",
            budget=BUDGET,
            mode=Mode.REPACK,
            block_size=B,
            sinks=SINKS,
            recent=RECENT,
            prompt_scores=ps,
            scope="all",
        )
        for ps in ("all", "window")
    }
    victims = {}
    for ps, cfg in cfgs.items():
        m = CacheManager(cfg, num_blocks=64)
        m.add_request("r", prompt_len=P)
        m.place("r", P, source.key_norm[0, :P])
        total, last, bits, window = source.prefill(P, need_bits=True, need_window=True)
        m.observe("r", StepScores(np.arange(P), P, total[0], last[0], bits[0], window=window[0]))
        m.step("r", 1, source.key_norm[0, P : P + 1])
        live = set(m.tables["r"].live_logicals().tolist())
        victims[ps] = sorted(set(range(P)) - live)
    assert victims["all"] and victims["window"] and victims["all"] != victims["window"]
