"""Each policy ranks tokens as its paper defines, checked on hand-built attention with a known answer.

The path is the real one: tokens in a ``TokenTable``, one step's statistics folded in by
``vtoken.core.step_stats.observe`` (the unimportance bits by the worker's own ``unimportance_bits``), victims
from ``vtoken.core.eviction.choose_victims``. Expected victims are written out by hand from the
definitions (the comments show the arithmetic), never recomputed with the code under test.
"""

from __future__ import annotations

import numpy as np
import pytest

from vtoken.core.config import Mode, VTokenConfig
from vtoken.core.eviction import choose_victims
from vtoken.core.manager import request_salt
from vtoken.core.step_stats import StepScores, observe, unimportance_bits
from vtoken.core.token_table import TokenTable
from vtoken.policies import make_policy
from vtoken.policies.scissorhands import ScissorhandsPolicy


def feed(table: TokenTable, probs: np.ndarray) -> None:
    """Fold one step in: ``probs[q, k]`` is the attention of the step's ``q`` queries (the newest tokens,
    oldest query first) over logical keys ``0..k-1``; a query sees the keys up to its own position."""
    q, k = probs.shape
    visible = np.arange(k)[None, :] <= np.arange(table.seen - q, table.seen)[:, None]
    assert np.allclose(probs.sum(axis=1), 1.0) and not np.any(probs[~visible])
    observe(
        table,
        StepScores(
            np.arange(k),
            q,
            accumulated=probs.sum(axis=0),
            last=probs[-1],
            unimportant=unimportance_bits(probs, visible),
        ),
    )


def prefill(n: int, key_norm: np.ndarray | None = None) -> TokenTable:
    """A table holding an ``n``-token prompt whose queries attended uniformly (each key got exactly the
    uniform share 1/(q+1) of every query q that saw it, so none is unimportant)."""
    t = TokenTable(block_size=4, mode=Mode.REPACK)
    t.place(n, key_norm)
    feed(t, np.tril(np.ones((n, n))) / np.arange(1, n + 1)[:, None])
    return t


def decode(table: TokenTable, prompt_attention: list[float]) -> None:
    """One decode step: a new token, whose query gives the prompt's keys ``prompt_attention`` and spreads
    the rest of its mass evenly over the generated keys (its own included)."""
    table.place(1)
    p = np.asarray(prompt_attention, float)
    rest = 1.0 - p.sum()
    assert rest > 0
    feed(table, np.concatenate([p, np.full(table.seen - p.size, rest / (table.seen - p.size))])[None, :])


def victims(table: TokenTable, policy, evict: int, sinks: int = 0, recent: int = 0, salt: int = 0) -> list[int]:
    cfg = VTokenConfig(policy=policy.name, budget=table.live - evict, block_size=4, sinks=sinks, recent=recent)
    return choose_victims(table, policy, cfg, salt).tolist()


def attended() -> TokenTable:
    """6 prompt tokens (uniform prefill), then 3 decode queries; the newest query's order differs from the
    accumulated one. Per prompt token 0..5:

        prefill Σ_q≥i 1/(q+1)   2.450  1.450  0.950  0.617  0.367  0.167
        decode 1, 2 (each)      0.02   0.02   0.02   0.02   0.40   0.40
        decode 3 (the last)     0.10   0.12   0.14   0.16   0.01   0.02
        accumulated             2.590  1.610  1.130  0.817  1.177  0.987
    """
    t = prefill(6)
    for row in ([0.02] * 4 + [0.40] * 2, [0.02] * 4 + [0.40] * 2, [0.10, 0.12, 0.14, 0.16, 0.01, 0.02]):
        decode(t, row)
    return t


@pytest.mark.parametrize(("evict", "expected"), [(1, [3]), (2, [3, 5]), (3, [2, 3, 5])])
def test_h2o_evicts_the_least_accumulated_attention(evict, expected):
    """H2O (Zhang et al. 2023, arXiv:2306.14048): the score of a key is its attention summed over every
    query so far (prefill and decode); the heavy hitters stay, the lowest sums go. Token 4 is the least
    attended by the newest query but a heavy hitter in total, so it stays; the generated tokens are
    protected (recent = 3)."""
    assert victims(attended(), make_policy("h2o"), evict, recent=3) == expected


@pytest.mark.parametrize(("evict", "expected"), [(1, [4]), (2, [4, 5]), (3, [0, 4, 5])])
def test_tova_evicts_what_the_newest_query_attended_least(evict, expected):
    """TOVA (Oren et al. 2024, arXiv:2401.06104): at each step drop the token the *current* (newest)
    query attends least; older queries do not count. Tokens 4 and 5 were the top keys of the two earlier
    decode queries and the bottom of the last one."""
    assert victims(attended(), make_policy("tova"), evict, recent=3) == expected


# Six decode queries (keys seen n = 7..12); L = attention 0.5/n (below the uniform share 1/n), H = 1.2/n.
# Token 3 gets a constant 0.105: below 1/7, 1/8, 1/9, above 1/10, 1/11, 1/12, so it is unimportant only
# when the threshold follows the keys each query saw.
UNIMPORTANCE = ["HLLHHH", "HHLLLL", "HHHLLH", None, "HHHHHH", "HHHHHL"]


def scissored() -> TokenTable:
    t = prefill(6)
    for j in range(6):
        n = 7 + j
        decode(t, [0.105 if p is None else (0.5 if p[j] == "L" else 1.2) / n for p in UNIMPORTANCE])
    return t


@pytest.mark.parametrize(
    ("history", "evict", "expected"),
    [
        # last 4 queries: counts 1 4 2 1 0 1 -> token 1, then 2, then the oldest of the ties at 1 (token 0)
        (4, 1, [1]),
        (4, 2, [1, 2]),
        (4, 3, [0, 1, 2]),
        # all 6 queries: counts 2 4 2 3 0 1 -> token 1, then 3, then the oldest of 0 and 2
        (6, 2, [1, 3]),
        (6, 3, [0, 1, 3]),
        (32, 2, [1, 3]),
    ],
)
def test_scissorhands_counts_unimportance_within_its_history(history, evict, expected):
    """Scissorhands (Liu et al. 2023, arXiv:2305.17118): a query judges a key unimportant when it gives it
    less than the average share 1/(keys it saw); keep the keys that were important persistently, i.e.
    evict those judged unimportant most often within the last ``history`` queries, ignoring older ones.
    The uniform prefill gives every key exactly its share, which is not less than it."""
    assert victims(scissored(), ScissorhandsPolicy(history=history), evict, recent=6) == expected


def test_scissorhands_judges_each_prefill_query_by_the_keys_it_saw():
    """Scissorhands (Liu et al. 2023, arXiv:2305.17118) over a prefill chunk: every query of the chunk
    judges the keys it saw (causal), against its own share 1/(q+1); bit order follows the queries, so a
    short history keeps the chunk's newest queries. Query q gives its ``low`` keys 0.5/(q+1), the rest share
    the remainder (each above 1/(q+1)); keys 6, 7 are protected."""
    low = {1: [0], 2: [0, 1], 3: [1], 4: [2], 5: [3], 6: [3], 7: [3, 4]}
    probs = np.zeros((8, 8))
    for q in range(8):
        n, lows = q + 1, low.get(q, [])
        probs[q, : q + 1] = (1 - 0.5 * len(lows) / n) / (n - len(lows))
        probs[q, lows] = 0.5 / n
    t = TokenTable(block_size=4, mode=Mode.REPACK)
    t.place(8)
    feed(t, probs)
    # all 8 queries: counts 2 2 1 3 1 0 -> 3, then 0 and 1
    assert victims(t, ScissorhandsPolicy(history=8), 3, recent=2) == [0, 1, 3]
    # the newest 3 queries (q5 q6 q7): counts 0 0 0 3 1 0
    assert victims(t, ScissorhandsPolicy(history=3), 2, recent=2) == [3, 4]


def test_knorm_evicts_the_largest_key_norms_whatever_the_attention():
    """KNorm (Devoto et al. 2024, arXiv:2406.11430): keys with a low L2 norm draw attention, so the
    largest-norm keys are evicted first; the rule is query-free (attention is never consulted)."""
    norms = np.array([3.0, 9.0, 1.0, 7.5, 2.0, 8.0, 0.5, 4.0])
    t = TokenTable(block_size=4, mode=Mode.REPACK)
    t.place(8)
    observe(t, StepScores(np.zeros(0, np.int64), 8, key_norm_logicals=np.arange(8), key_norm=norms))
    attention = norms / norms.sum()  # the large-norm keys are the most attended here: must not matter
    observe(t, StepScores(np.arange(8), 1, attention, attention, np.zeros(8, np.uint64)))
    knorm = make_policy("knorm")
    assert victims(t, knorm, 2, sinks=1, recent=1) == [1, 5]  # 9.0 and 8.0
    assert victims(t, knorm, 3, sinks=1, recent=1) == [1, 3, 5]  # then 7.5 (token 7's 4.0 is recent)


def test_streamingllm_keeps_the_sinks_and_a_window_of_the_newest():
    """StreamingLLM (Xiao et al. 2024, arXiv:2309.17453): the cache holds the attention sinks plus a
    rolling window of the most recent tokens, so it evicts the oldest non-sink tokens, whatever the
    attention (here the oldest tokens are the most attended). No recent window is configured: the
    window is the policy's own doing."""
    policy, W = make_policy("streamingllm"), 6
    t = prefill(10)
    for _ in range(8):
        n = t.seen
        out = victims(t, policy, t.live - W, sinks=2)
        assert out == sorted(t.live_logicals().tolist())[2 : 2 + t.live - W]
        t.evict(np.array(out), 2, 0)
        assert t.live_logicals().tolist() == [0, 1, *range(n - (W - 2), n)]
        decode(t, [0.5 / t.live] * 2 + [0.9 / t.live] * (t.live - 2))  # old tokens attended most


def random_table(stats_seed: int | None = None) -> TokenTable:
    """40 tokens; with ``stats_seed``, every statistic drawn at random from it (else all zero)."""
    t = TokenTable(block_size=4, mode=Mode.REPACK)
    if stats_seed is None:
        t.place(40)
        return t
    rng = np.random.default_rng(stats_seed)
    t.place(40, rng.uniform(0.5, 5, 40))
    a = rng.dirichlet(np.ones(40))
    observe(t, StepScores(np.arange(40), 1, a * 40, a, rng.integers(0, 2**63, 40).astype(np.uint64)))
    return t


def test_random_ignores_statistics_and_is_seeded_per_request():
    """Random eviction, the query-free baseline of H2O (Zhang et al. 2023, arXiv:2306.14048) and vToken:
    victims are drawn uniformly from the evictable tokens, independent of every statistic; seeded by
    (seed, request salt) so paired runs and engines draw the same victims, and requests differ."""
    bare, scored, rescored = random_table(), random_table(2), random_table(3)

    def pick(t: TokenTable, seed: int, salt: int) -> list[int]:
        return victims(t, make_policy("random", seed=seed), 8, sinks=4, recent=4, salt=salt)

    salts = [request_salt(f"req-{i}") for i in range(50)]
    for salt in salts[:10]:
        assert pick(bare, 0, salt) == pick(scored, 0, salt) == pick(rescored, 0, salt)
    assert len({tuple(pick(bare, 0, s)) for s in salts}) >= 45
    assert sum(pick(bare, 0, s) != pick(bare, 1, s) for s in salts) >= 45


def test_random_victims_are_spread_uniformly_over_evictable_positions():
    """Random eviction (Zhang et al. 2023, arXiv:2306.14048, the random baseline): every evictable
    position is equally likely to go. 2000 requests each evict 8 of 32 evictable positions: each position
    is expected 500 times; a loose chi-square (31 d.o.f., mean 31) bounds the deviation; protected
    positions never go."""
    t, policy = random_table(), make_policy("random", seed=5)
    counts = np.zeros(40, np.int64)
    for i in range(2000):
        np.add.at(counts, victims(t, policy, 8, sinks=4, recent=4, salt=request_salt(f"req-{i}")), 1)
    assert counts[:4].sum() == counts[36:].sum() == 0
    expected = 2000 * 8 / 32
    chi2 = float(((counts[4:36] - expected) ** 2 / expected).sum())
    assert chi2 < 80, (chi2, counts[4:36].tolist())


# ------------------------------------------------------------------------------ the adaptive budget
def mass_victims(keep_mass: float, budget=1.0, trigger: str = "step", policy: str = "h2o") -> list[int]:
    cfg = VTokenConfig(
        policy=policy, budget=budget, keep_mass=keep_mass, block_size=4, sinks=0, recent=3, trigger=trigger
    )
    return choose_victims(attended(), make_policy(policy), cfg, 0).tolist()


@pytest.mark.parametrize(("keep_mass", "expected"), [(0.95, []), (0.9, [3]), (0.75, [3, 5]), (0.6, [2, 3, 5])])
def test_keep_mass_evicts_the_lightest_tokens_while_the_rest_hold_that_share(keep_mass, expected):
    """``keep_mass`` τ with no fixed budget (1.0): H2O's evictable prompt tokens 0..5 hold 2.590 1.610 1.130
    0.817 1.177 0.987 (Σ 8.311; the generated ones are protected). Lightest first, the running sums are
    0.817 1.804 2.934 4.111 …: a token goes while the evicted sum stays ≤ (1 − τ) · 8.311 — 0.416 at 0.95
    (none), 0.831 at 0.9 (token 3), 2.078 at 0.75 (3, 5), 3.324 at 0.6 (2, 3, 5)."""
    assert mass_victims(keep_mass) == expected


def test_keep_mass_takes_the_larger_count_and_follows_the_trigger():
    """The budget stays an upper bound on what is kept: 6 of 9 live (3 due) beats τ = 0.9's one victim; with
    trigger ``block`` (B = 4) a mass count below a block waits; other policies' scores are no mass."""
    assert mass_victims(0.9, budget=6) == [2, 3, 5]
    assert mass_victims(0.6, trigger="block") == []  # 3 due < one block of 4
    assert mass_victims(0.6, policy="tova") == [0, 4, 5]  # TOVA's newest-query masses: 0.10 0.01 0.02 …
    with pytest.raises(Exception, match="keep_mass needs a policy that scores attention mass"):
        mass_victims(0.9, policy="knorm")


# ------------------------------------------------------------------------------ span pooling
@pytest.mark.parametrize(("evict", "expected"), [(1, [3]), (2, [3, 4]), (3, [3, 4, 5]), (4, [2, 3, 4, 5])])
def test_score_pool_ranks_a_token_by_the_heaviest_neighbour_so_spans_go_together(evict, expected):
    """``score_pool: 1`` with H2O on ``attended()``: prompt tokens 0..5 hold 2.590 1.610 1.130 0.817 1.177
    0.987, generated token 6 holds 0.33 (recent = 3 protects 6..8 but its score still pools). Each token ranks
    by the max within logical distance 1: 2.590 2.590 1.610 1.177 1.177 1.177, so two victims are the
    adjacent 3, 4 (the ties go oldest first) where plain H2O takes 3 and 5."""
    cfg = VTokenConfig(policy="h2o", budget=9 - evict, block_size=4, sinks=0, recent=3, score_pool=1)
    assert choose_victims(attended(), cfg.make_policy(), cfg, 0).tolist() == expected
    if evict == 2:
        assert victims(attended(), make_policy("h2o"), 2, recent=3) == [3, 5]


def test_max_pool_reaches_only_live_neighbours_within_the_distance():
    """An evicted neighbour is absent: logical 1's score reaches 0 and 2 (distance ≤ 1), not 5 (distance 4);
    rows of a 2-D context pool independently."""
    from vtoken.policies.base import max_pool

    logical = np.array([0, 1, 2, 5, 6])
    scores = np.array([0.0, 1.0, 0.0, 0.0, 0.5])
    assert max_pool(scores, logical, 1).tolist() == [1.0, 1.0, 1.0, 0.5, 0.5]
    assert max_pool(scores, logical, 4).tolist() == [1.0, 1.0, 1.0, 1.0, 0.5]  # 1→5 is 4 apart; 0→6 is 6
    rows = max_pool(np.stack([scores, scores[::-1]]), np.stack([logical, logical]), 1)
    assert rows.tolist() == [[1.0, 1.0, 1.0, 0.5, 0.5], [0.5, 0.5, 0.0, 1.0, 1.0]]
    assert max_pool(scores, logical, 0).tolist() == scores.tolist()


def test_score_pool_is_refused_where_scores_are_no_attention_or_must_add_up():
    with pytest.raises(Exception, match="score_pool pools attention scores; policy 'knorm'.*valid: h2o, snapkv, tova"):
        VTokenConfig(policy="knorm", score_pool=2)
    with pytest.raises(Exception, match="score_pool does not combine with keep_mass"):
        VTokenConfig(policy="h2o", keep_mass=0.9, score_pool=2)
    with pytest.raises(Exception, match="score_pool must be a non-negative integer, got -1"):
        VTokenConfig(policy="h2o", score_pool=-1)
    assert VTokenConfig(policy="knorm", score_pool=0).make_policy().pool == 0
