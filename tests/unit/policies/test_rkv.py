"""R-KV (``rkv``): the policy's score by hand, and the ``redundancy`` statistic against a direct O(n²) cosine
computation — numpy (``mean_cosine``), torch (``key_redundancy``), the worker's accumulator through a block
table, and a token table's slots after evictions and a repack."""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vtoken.core.config import Mode
from vtoken.core.step_stats import SlotScores, mean_cosine, observe
from vtoken.core.token_table import TokenTable
from vtoken.kernels.layout import TokenLayout
from vtoken.kernels.scores import RequestScores, ScoreAccumulator, key_redundancy
from vtoken.policies import EvictionContext, Stat, make_policy
from vtoken.policies.rkv import LAMBDA


def direct(keys: np.ndarray) -> np.ndarray:
    """Per head, the mean over j ≠ i of cos(k_i, k_j) from the full n × n matrix (cos with a zero key: 0),
    then the mean over heads."""
    n, heads, _ = keys.shape
    if n < 2:
        return np.zeros(n)
    out = np.zeros((n, heads))
    for h in range(heads):
        k = keys[:, h].astype(np.float64)
        norm = np.linalg.norm(k, axis=1)
        cos = np.zeros((n, n))
        for i in range(n):
            for j in range(n):
                if i != j and norm[i] > 0 and norm[j] > 0:
                    cos[i, j] = k[i] @ k[j] / (norm[i] * norm[j])
        out[:, h] = cos.sum(axis=1) / (n - 1)
    return out.mean(axis=1)


keys_strategy = st.tuples(st.integers(0, 9), st.integers(1, 3), st.integers(1, 5), st.integers(0, 2**31 - 1))


def draw_keys(spec) -> np.ndarray:
    """``[n, heads, d]`` keys with repeated, scaled, opposite and zero rows among random ones."""
    n, heads, d, seed = spec
    rng = np.random.default_rng(seed)
    k = rng.normal(size=(n, heads, d))
    for i in range(n):
        kind = rng.integers(0, 5)
        if i and kind == 0:
            k[i] = k[rng.integers(0, i)] * rng.uniform(0.5, 3)  # a copy up to scale: cos 1
        elif i and kind == 1:
            k[i] = -k[rng.integers(0, i)]
        elif kind == 2:
            k[i, rng.integers(0, heads)] = 0.0  # a zero key in one head
    return k


@settings(max_examples=200, deadline=None)
@given(keys_strategy)
def test_mean_cosine_equals_the_direct_computation(spec):
    keys = draw_keys(spec)
    np.testing.assert_allclose(mean_cosine(keys), direct(keys), atol=1e-12)
    np.testing.assert_allclose(key_redundancy(torch.from_numpy(keys).float()).double().numpy(), direct(keys), atol=1e-5)


def test_two_identical_keys_are_the_redundant_ones():
    """k0 = k1 = (1, 0), k2 = (0, 1): k0 and k1 have mean cosine (1 + 0)/2, k2 has 0."""
    keys = np.array([[[1.0, 0.0]], [[1.0, 0.0]], [[0.0, 1.0]]])
    np.testing.assert_allclose(mean_cosine(keys), [0.5, 0.5, 0.0])


def ctx(last, redundancy, logical=(0, 10, 20)):
    """Tokens far apart (no pooling between them, HALF = 3)."""
    return EvictionContext(
        np.asarray(logical), 21, 0, last=np.asarray(last, float), redundancy=np.asarray(redundancy, float)
    )


def test_score_by_hand():
    """Z = λ·I − (1 − λ)·R: I = last attention / its sum, R = softmax of the redundancy."""
    policy = make_policy("rkv")
    z = policy.score(ctx([0.2, 0.2, 0.1], [0.5, 0.5, 0.0]))
    e = [math.e**0.5, math.e**0.5, 1.0]
    want = [LAMBDA * i - (1 - LAMBDA) * r / sum(e) for i, r in zip([0.4, 0.4, 0.2], e)]
    np.testing.assert_allclose(z, want, rtol=1e-12)
    assert LAMBDA == 0.1 and policy.needs == {Stat.LAST, Stat.REDUNDANCY}


def test_the_older_of_two_identical_keys_goes_first():
    """Equal importance: the unique key stays, the duplicates tie and the older goes; the newer goes when the
    older draws more attention."""
    policy, evictable = make_policy("rkv"), np.ones(3, bool)
    assert policy.select(ctx([0.3, 0.3, 0.3], [0.5, 0.5, 0.0]), 1, evictable).tolist() == [0]
    assert policy.select(ctx([0.3, 0.3, 0.3], [0.5, 0.5, 0.0]), 2, evictable).tolist() == [0, 10]
    assert policy.select(ctx([0.31, 0.3, 0.3], [0.5, 0.5, 0.0]), 1, evictable).tolist() == [10]
    # attention alone (TOVA) would evict the unique key, the least attended
    assert make_policy("tova").select(ctx([0.35, 0.35, 0.3], [0.5, 0.5, 0.0]), 1, evictable).tolist() == [20]
    assert policy.select(ctx([0.35, 0.35, 0.3], [0.5, 0.5, 0.0]), 1, evictable).tolist() == [0]


def test_importance_is_max_pooled_over_three_positions():
    policy = make_policy("rkv")
    z = policy.score(
        EvictionContext(np.arange(8), 8, 0, last=np.array([0, 0, 0, 0, 0, 0, 0, 1.0]), redundancy=np.zeros(8))
    )
    assert np.all(z[4:] == z[7]) and np.all(z[:4] == z[0]) and math.isclose(z[7] - z[0], LAMBDA / 4)  # I: 1/4 each


def test_before_any_statistic_every_token_ties():
    z = make_policy("rkv").score(EvictionContext(np.arange(5), 5, 0, last=np.zeros(5), redundancy=np.zeros(5)))
    assert np.all(np.isfinite(z)) and np.all(z == z[0])


@settings(max_examples=60, deadline=None)
@given(st.integers(8, 40), st.integers(0, 2**31 - 1), st.sampled_from(list(Mode)[1:]))
def test_redundancy_through_the_slots_equals_the_live_keys_direct(n, seed, mode):
    """A table with holes, repacked: the worker measures over row slots 0..live-1 (keys in slot order, through
    ``token_at``), the scheduler maps them back by logical position (``by_logical``) and ``observe`` sets
    them: each live token's value is the direct O(n²) mean over the keys live *at that step*, every other
    token's 0. Tokens evicted after the step (holes in the map it is read through) are dropped."""
    rng = np.random.default_rng(seed)
    keys = draw_keys((n + 1, 2, 4, seed))
    t = TokenTable(block_size=4, mode=mode)
    t.place(n)
    t.evict(rng.choice(n, size=int(rng.integers(1, n - 3)), replace=False))
    t.apply(t.plan())
    t.place(1)  # a decode token: appended
    measured_on = t.live_logicals()
    slot_keys = keys[t.token_at[: t.live]]  # the dense row: slots 0..live-1
    measured = key_redundancy(torch.from_numpy(slot_keys).float()).double().numpy()
    late = rng.choice(measured_on[:-1], size=int(rng.integers(0, 3)), replace=False)
    t.evict(late)  # decided before the scores were read: holes in the map
    z = np.zeros(t.extent)
    scores = SlotScores(
        1, t.extent, accumulated=z, last=z, unimportant=np.zeros(t.extent, np.uint64), redundancy=measured
    )
    t.redundancy[: t.seen] = 7.0  # stale values: every token is set (live) or cleared
    observe(t, scores.by_logical(t.token_at, t.seen - 1))
    want = dict(zip(measured_on.tolist(), direct(keys[measured_on])))
    live = t.live_logicals()
    np.testing.assert_allclose(t.redundancy[live], [want[i] for i in live.tolist()], atol=1e-5)
    assert np.all(t.redundancy[np.setdiff1d(np.arange(t.seen), live)] == 0)


def test_accumulator_measures_redundancy_through_the_block_table():
    """Decode requests (the padded batch) and a prefill chunk: the mean over layers of each request's live
    keys' mean cosine, read through its block row; a request that does not ask gets none."""
    bs, nkv, hd, heads = 4, 2, 8, 4
    layout = TokenLayout.cpu_vec(bs, hd)
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(8, nkv, bs, 2 * hd, generator=g)
    specs = [("a", 0, 1, 7, [5, 2]), ("b", 1, 2, 5, [7, 0]), ("c", 2, 5, 9, [1, 3, 6]), ("d", 5, 6, 3, [4])]
    acc = ScoreAccumulator(layout)
    for name, q0, q1, n, row in specs:
        acc.requests[name] = RequestScores(
            q0, q1, n, torch.tensor(row), want_attention=True, want_key_norm=False, want_redundancy=name != "d"
        )
    q = torch.randn(6, heads, hd, generator=g)
    for layer in range(2):
        acc.add_layer(q * (1 + layer), None, cache, 0.3)
    out = acc.finish()
    from vtoken.kernels.moves import read_k
    from vtoken.kernels.scores import row_slots

    for name, _, _, n, row in specs[:3]:
        keys = read_k(cache, layout, row_slots(torch.tensor(row), n, bs)).double().numpy()
        np.testing.assert_allclose(out[name].redundancy, direct(keys), atol=1e-5)
    assert out["d"].redundancy is None and out["d"].last is not None
    assert any(t is not None and t.shape == (9,) for t in acc.linear_buffers()[1])  # KV-head means (TP)
