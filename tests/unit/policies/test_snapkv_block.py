"""SnapKV (the observation-window statistic and the policy) and block-granular eviction, engine-free.

Hand-built attention with known answers; the block baseline through ``choose_victims`` and ``CacheManager``;
the ``granularity`` setting through every surface that derives from ``VTokenConfig``. Fast (numpy, no engine).
"""

import math

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from vtoken.cli import app
from vtoken.core.config import Granularity, Mode, VTokenConfig
from vtoken.core.eviction import choose_victims, context_for
from vtoken.core.manager import CacheManager
from vtoken.core.step_stats import SlotScores, StepScores, observe, window_queries
from vtoken.core.token_table import TokenTable
from vtoken.errors import ConfigError
from vtoken.kernels.scores import RequestScores, ScoreAccumulator
from vtoken.policies import OBSERVATION_WINDOW, Stat, make_policy
from vtoken.sim.exact import simulate_exact
from vtoken.sim.run import SimConfig
from vtoken.sim.source import SyntheticConfig, SyntheticSource, TraceSource

W = OBSERVATION_WINDOW  # 32


# ---------------------------------------------------------------------------------------------- SnapKV
def window_attention(P: int, heavy: dict[int, float], eps: float = 1e-3) -> np.ndarray:
    """[W, P] attention of the prompt's last W queries: ``heavy[key]`` from every query, ``eps`` to every
    other visible key, the rest of each row on the query itself (rows sum to 1, causal)."""
    a = np.zeros((W, P))
    for i, s in enumerate(range(P - W, P)):
        a[i, : s + 1] = eps
        for key, share in heavy.items():
            a[i, key] = share
        a[i, s] += 1.0 - a[i].sum()
    return a


def snapkv_table(P: int = 64, sinks: int = 2, recent: int = 0, heavy=None) -> tuple[TokenTable, VTokenConfig]:
    """A table that saw a P-token prompt and its observation window (set through ``observe``)."""
    t = TokenTable(block_size=8, mode=Mode.REPACK)
    t.place(P)
    a = window_attention(P, heavy if heavy is not None else {10: 0.3, 25: 0.1})
    observe(t, StepScores(np.arange(P), W, a.sum(0), a[-1], np.zeros(P, np.uint64), window=a.sum(0)))
    return t, VTokenConfig(policy="snapkv", budget=P - 16, sinks=sinks, recent=recent, block_size=8)


def _ctx(t: TokenTable):
    return context_for(t, t.live_logicals(), 0, make_policy("snapkv"))


def test_snapkv_keeps_what_the_window_attends_and_its_pooled_neighbours():
    t, cfg = snapkv_table()
    victims = choose_victims(t, make_policy("snapkv"), cfg, salt=0)
    # pre-window candidates 2..31: 30 tokens, 16 go. Max pooling (kernel 7) lifts 7..13 to key 10's score and
    # 22..28 to key 25's: exactly the other 16 go, although 7, 8, 9, 11, ... drew only eps themselves
    assert victims.tolist() == [2, 3, 4, 5, 6, *range(14, 22), 29, 30, 31]
    scores = make_policy("snapkv").score(_ctx(t))
    assert np.all(scores[7:14] == scores[10]) and np.all(scores[22:29] == scores[25])
    assert scores[10] > scores[25]
    assert np.all(scores[32:] > scores[:32].max())  # the window itself ranks above the rest of the prompt


def test_snapkv_pools_over_live_neighbours_only():
    t, cfg = snapkv_table()
    t.evict([10])  # the heavy hitter itself is gone: its neighbours lose its score
    scores = make_policy("snapkv").score(_ctx(t))
    live = t.live_logicals()
    assert scores[live == 9][0] == scores[live == 2][0]  # back to eps-level pooling


def test_snapkv_ranks_generated_tokens_above_every_prompt_token():
    t, cfg = snapkv_table(P=64)
    t.place(20)  # generated: the window never saw them (statistic 0)
    cfg = VTokenConfig(policy="snapkv", budget=20 + 8, sinks=2, recent=4, block_size=8)
    victims = choose_victims(t, make_policy("snapkv"), cfg, salt=0)
    assert victims.size == 84 - 28 and victims.max() < 64  # prompt tokens only: generated ones are kept
    assert set(range(64, 84)) <= set(t.live_logicals().tolist()) - set(victims.tolist())
    # the 6 prompt tokens kept besides the sinks are the window's best by pooled score, not its newest: each
    # query's self-attention shrinks with its position here, so the window's oldest score highest
    assert sorted(set(range(2, 64)) - set(victims.tolist())) == list(range(32, 38))
    t2, _ = snapkv_table(P=64)
    t2.place(20)
    cfg_all = VTokenConfig(policy="snapkv", budget=10, sinks=2, recent=4, block_size=8)
    gone = set(choose_victims(t2, make_policy("snapkv"), cfg_all, salt=0).tolist())
    assert set(range(2, 64)) <= gone and gone - set(range(64)) == set(range(64, 76))  # then oldest generated


def test_snapkv_before_the_window_ties_oldest_first():
    t = TokenTable(block_size=8)
    t.place(40)
    cfg = VTokenConfig(policy="snapkv", budget=30, sinks=2, recent=0, block_size=8)
    assert choose_victims(t, make_policy("snapkv"), cfg, salt=0).tolist() == list(range(2, 12))


def test_window_statistic_is_set_not_accumulated_and_maps_through_slots():
    t = TokenTable(block_size=4)
    t.place(6)
    t.evict([2])
    t.apply(t.plan())  # token 5 moved into slot 2
    probs, bits = np.full(5, 0.2), np.zeros(5, np.uint64)
    slot = SlotScores(
        n_queries=1,
        seq_len=5,
        accumulated=probs,
        last=probs,
        unimportant=bits,
        window=np.array([1.0, 2.0, 5.0, 3.0, 4.0]),
    )
    observe(t, slot.by_logical(t.token_at, first_new=5))
    assert t.window[[0, 1, 3, 4, 5]].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    observe(t, slot.by_logical(t.token_at, first_new=5))
    assert t.window[5] == 5.0 and t.accumulated[5] == pytest.approx(0.4)  # set once vs accumulated
    decode = SlotScores(n_queries=1, seq_len=5, accumulated=probs, last=probs, unimportant=bits)
    observe(t, decode.by_logical(t.token_at, first_new=5))
    assert t.window[5] == 5.0  # a step without the window leaves it alone


def test_the_window_step_is_the_one_computing_the_prompts_last_token():
    assert window_queries(224, 0, 224) == 224  # one prefill step
    assert window_queries(150, 128, 22) == 22  # the last chunk of a chunked prefill (or after a cache hit)
    assert window_queries(150, 0, 64) == 0 and window_queries(150, 64, 64) == 0  # earlier chunks
    assert window_queries(150, 0, 170) == 150  # a recompute after preemption: its first 150 queries
    assert window_queries(150, 170, 1) == 0 and window_queries(150, 149, 1) == 1  # decode steps


@pytest.mark.parametrize("window, rows", [(40, (8, 40)), (20, (0, 20)), (0, None)])
def test_worker_sums_the_last_window_queries_up_to_the_prompts_end(window, rows):
    """A 40-query step: the prompt ends at query ``window``; the statistic sums its last ≤ 32 queries."""
    g = torch.Generator().manual_seed(3)
    probs = torch.rand(40, 50, generator=g)
    acc = ScoreAccumulator(layout=None)
    acc.requests["r"] = RequestScores(
        0, 40, 50, torch.zeros(2), want_attention=True, want_key_norm=False, window=window, probs=probs * 2, layers=2
    )
    out = acc.finish()["r"]
    if rows is None:
        assert out.window is None
    else:
        expect = probs.double().numpy()[rows[0] : rows[1]].sum(0)
        assert np.allclose(out.window, expect, atol=1e-5)


@pytest.mark.parametrize("P", [100, 20])
def test_sources_give_the_window_statistic(P):
    syn = SyntheticSource(SyntheticConfig(), 2, P + 4, seed=5)
    keys = np.arange(P)
    brute = np.zeros((2, P))
    for s in range(max(P - W, 0), P):  # fewer than W prompt queries: the window is all of them
        for r in range(2):
            brute[r, : s + 1] += syn.attention_row(r, s, keys[: s + 1])
    pre = syn.prefill(P, need_bits=False, need_window=True)
    np.testing.assert_allclose(pre.window, brute, rtol=1e-12)
    assert not syn.prefill(P, need_bits=False).window.any()  # not asked for: zeros
    attn = np.stack(
        [np.tril(np.stack([syn.attention_row(r, s, np.arange(P + 4)) for s in range(P + 4)])) for r in range(2)]
    )
    trace = TraceSource(attn, syn.key_norm)
    np.testing.assert_allclose(trace.prefill(P, False, True).window, brute, rtol=1e-9)


# ---------------------------------------------------------------------------------------------- blocks
def block_table(scores: list[float], dead=(), shared: int = 0) -> TokenTable:
    t = TokenTable(block_size=4, mode=Mode.NAIVE)
    t.place(len(scores))
    t.accumulated[: len(scores)] = scores
    if dead:
        t.evict(list(dead))
    if shared:
        t.mark_shared(shared)
    return t


# 6 blocks of 4: block 0 holds the 2 sinks, the recent 5 reach into block 4; block 2 lost a token
SCORES = [9, 9, 0, 0] + [5, 5, 5, 5] + [0, 0, 0, 0] + [0, 0, 0, 100] + [1, 1, 1, 1] + [0, 0, 0, 0]


def block_victims(n_live_target: int, t: TokenTable | None = None, **kw) -> list[int]:
    t = t if t is not None else block_table(SCORES, dead=[9])
    cfg = VTokenConfig(
        policy="h2o", budget=n_live_target, block_size=4, sinks=2, recent=5, granularity="block", mode="naive", **kw
    )
    return choose_victims(t, make_policy("h2o"), cfg, salt=0).tolist()


def test_block_granularity_evicts_the_lowest_mean_whole_block():
    # candidates: block 1 (mean 5) and block 3 (mean 25); block 3 holds the three lowest tokens (0) but its
    # mean is higher. Block 0 (sinks), 2 (a dead token), 4 and 5 (recent tokens) never qualify.
    assert block_victims(22) == [4, 5, 6, 7]  # 1 token over → ⌈1/4⌉ = 1 whole block
    assert block_victims(18) == [4, 5, 6, 7, 12, 13, 14, 15]  # 5 over → 2 blocks: 3 tokens below the budget
    assert block_victims(2) == [4, 5, 6, 7, 12, 13, 14, 15]  # only 2 blocks qualify: nothing else goes
    token = VTokenConfig(policy="h2o", budget=22, block_size=4, sinks=2, recent=5, mode="naive")
    assert choose_victims(block_table(SCORES, dead=[9]), make_policy("h2o"), token, 0).tolist() == [2]


def test_block_granularity_ties_go_to_the_older_block_and_shared_blocks_stay():
    flat = [1.0] * 24
    assert block_victims(22, block_table(flat)) == [4, 5, 6, 7]  # block 0 holds sinks: block 1 is the oldest
    assert block_victims(22, block_table(flat, shared=3)) == [12, 13, 14, 15]  # blocks 0-2 shared


@pytest.mark.parametrize("mode", [Mode.NAIVE, Mode.REPACK, Mode.REUSE_REPACK])
def test_block_granularity_through_the_manager_frees_whole_original_blocks(mode):
    cfg = VTokenConfig(policy="h2o", budget=0.3, mode=mode, block_size=4, sinks=2, recent=5, granularity="block")
    m = CacheManager(cfg, num_blocks=40)
    m.add_request("r")
    rng = np.random.default_rng(0)
    m.step("r", 40)
    for _ in range(30):
        t = m.tables["r"]
        m.observe(
            "r", StepScores(t.live_logicals(), 1, rng.random(t.live), rng.random(t.live), np.zeros(t.live, np.uint64))
        )
        budget = math.ceil(0.3 * t.seen)
        m.step("r", 1)
        live = t.live_logicals()
        assert budget - 4 + 1 < len(live) <= max(budget + 1, 13)  # at most B − 1 below the budget
        counts = np.bincount(live // 4, minlength=t.seen // 4)[: t.seen // 4]
        assert set(counts.tolist()) <= {0, 4}  # whole original blocks only
        assert {0, 1} | set(range(t.seen - 5, t.seen)) <= set(live.tolist())  # protected tokens stay
        assert len(m.rows["r"]) == math.ceil(len(live) / 4)  # naive too: freed blocks leave the row


def test_exact_simulator_block_granularity_naive_equals_the_packing_bound():
    cfg = SimConfig.of(
        policy="snapkv",
        budget="0.3",
        block_size=8,
        prompt_len=120,
        gen_len=30,
        requests=2,
        sinks=2,
        recent=8,
        granularity="block",
        engine="exact",
    ).vtoken
    tally = simulate_exact(cfg, SyntheticSource(SyntheticConfig(), 2, 150, seed=4), 120, 30, check=True)
    np.testing.assert_array_equal(tally.modes["naive"].per_step_sum, tally.packing_per_step_sum)
    assert tally.modes["repack"].moves > 0


# ---------------------------------------------------------------------------------------------- settings
def test_granularity_setting_round_trips_through_every_surface():
    from vtoken.serve.config import ServeAppConfig
    from vtoken.vllm.config import EngineSettings, RequestSettings, request_settings

    cfg = VTokenConfig(granularity="block")
    assert cfg.granularity is Granularity.BLOCK and VTokenConfig().granularity is Granularity.TOKEN
    assert VTokenConfig.from_dict(cfg.to_dict()) == cfg and cfg.to_dict()["granularity"] == "block"
    assert "granularity" in EngineSettings.keys() and "granularity" in RequestSettings.keys()
    eng = EngineSettings.from_additional_config({"vtoken": {"granularity": "block"}}, 32)
    assert eng.cfg.granularity is Granularity.BLOCK
    assert EngineSettings.from_additional_config({"vtoken": eng.to_additional_config()}, 32) == eng
    assert request_settings(eng, {"vtoken.granularity": "token"}).cfg.granularity is Granularity.TOKEN
    assert ServeAppConfig.model_validate({"vtoken": {"granularity": "block"}}).vtoken.granularity == "block"
    assert SimConfig.of(granularity="block", engine="exact").vtoken.granularity is Granularity.BLOCK


def test_bad_granularity_names_the_valid_ones():
    with pytest.raises(ConfigError, match="granularity 'page'; valid granularities: token, block"):
        VTokenConfig(granularity="page")
    with pytest.raises(ConfigError, match="--engine exact"):
        SimConfig.of(granularity="block")  # the fast engine does not run whole blocks


def test_simulate_cli_granularity_block_defaults_to_the_exact_engine():
    base = ["simulate", "--json", "--requests", "1", "--prompt-len", "96", "--gen-len", "8", "--block-size", "8"]
    res = CliRunner().invoke(app, [*base, "--granularity", "block", "--policy", "snapkv"])
    assert res.exit_code == 0, res.output
    assert '"engine": "exact"' in res.stdout and '"granularity": "block"' in res.stdout
    res = CliRunner().invoke(app, [*base, "--granularity", "block", "--engine", "fast"])
    assert res.exit_code == 2 and "--engine exact" in res.output


def test_snapkv_needs_only_the_prompt_end_statistic():
    policy = make_policy("snapkv")
    assert policy.needs == {Stat.WINDOW} and policy.needs_attention()
    assert Stat.WINDOW.prompt_only and not Stat.ACCUMULATED.prompt_only
