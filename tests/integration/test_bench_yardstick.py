"""The quality yardstick's parts without an engine: RULER-style instances are what lm-eval's definitions
say, Wilson intervals have their known values, and the fidelity metrics (first divergence, top-1
agreement, the coarse-grained KL) are what they claim — the KL bound never exceeds the true KL."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vtoken.bench.quality.fidelity import first_divergence, kl_lower_bound, teacher_forced
from vtoken.bench.quality.intervals import inside, rate, wilson
from vtoken.bench.quality.ruler_tasks import TASKS, RulerCase, ruler_cases


@pytest.fixture(scope="module")
def tok(default_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model))


@pytest.mark.parametrize("task", sorted(set(TASKS) - {"vt"}))
def test_ruler_instances_fit_their_length_hide_their_answers_and_follow_the_seed(tok, task):
    spec = TASKS[task]
    length = 1024 if spec.kind == "cwe" else 512  # cwe's worked example and 60 repeats need more
    cases = ruler_cases(tok, task, length, 4, seed=0)
    assert cases == ruler_cases(tok, task, length, 4, seed=0)
    assert [c.answers for c in cases] != [c.answers for c in ruler_cases(tok, task, length, 4, seed=1)]
    for c in cases:
        assert len(c.prompt_ids) + spec.budget_tokens <= length  # lm-eval's length budget
        text = tok.decode(c.prompt_ids)
        assert all(a in text for a in c.answers)
        assert len(c.answers) == (10 if spec.kind == "cwe" else spec.num_q * spec.num_v)
        if spec.kind == "niah":
            question, prefix = text.rsplit("\n", 1)[1].split("? ")
            assert prefix.startswith("The special magic") and prefix.endswith("is" if len(c.answers) == 1 else "are")
            for a in c.answers:  # each answer is the value of a needle whose key is asked for
                key = re.search(rf"One of the special magic \w+ for (\S+) is: {re.escape(a)}\.", text).group(1)
                assert key in question and key in prefix
        if spec.kind == "cwe":  # after the worked example, each of the 10 answers is listed 6 times, others once
            listing = text.rsplit("Below is a numbered list", 1)[1].split("Question:")[0]
            words = re.findall(r"\d+\. (\S+)", listing)
            assert all(words.count(a) == 6 for a in c.answers)
            assert all(words.count(w) == 1 for w in set(words) - set(c.answers))
    bigger = ruler_cases(tok, task, 2 * length, 1, seed=0)[0]
    assert len(bigger.prompt_ids) > len(cases[0].prompt_ids) + 256  # the haystack grows with the length


def test_variable_tracking_asks_for_the_whole_chain(tok):
    c = ruler_cases(tok, "vt", 1024, 2, seed=0)[0]
    text = tok.decode(c.prompt_ids)
    task = text.rsplit("Memorize and track", 1)[1]
    value = re.search(r"assigned the value (\d+) in the text", task).group(1)
    first, *rest = c.answers
    assert f"VAR {first} = {value}" in task
    for prev, name in zip(c.answers, rest):
        assert f"VAR {name} = VAR {prev}" in task
    assert text.endswith("they are:") and len(c.prompt_ids) + TASKS["vt"].budget_tokens <= 1024
    with pytest.raises(ValueError, match="vt: no instance fits 512"):
        ruler_cases(tok, "vt", 512, 1, seed=0)
    with pytest.raises(ValueError, match="'needle_x': one of niah_single_1"):
        ruler_cases(tok, "needle_x", 512, 1, seed=0)


def test_scoring_is_lm_evals_string_match_all():
    c = RulerCase("x", "niah_multivalue", 512, ("1234567", "Abc-Def"), (1,), 8)
    assert c.score(" 1234567 and abc-def.") == 1.0 and c.solved(" 1234567, ABC-DEF")
    assert c.score("1234567") == 0.5 and not c.solved("1234567")
    assert c.score("nothing") == 0.0


def test_wilson_interval_known_values_and_errors():
    assert wilson(0, 10) == pytest.approx((0.0, 0.27753), abs=1e-4)
    assert wilson(5, 10) == pytest.approx((0.23659, 0.76341), abs=1e-4)
    assert wilson(50, 50) == pytest.approx((0.92865, 1.0), abs=1e-4)
    low, high = wilson(30, 50)
    assert low < 0.6 < high and high - low < wilson(3, 5)[1] - wilson(3, 5)[0]  # narrower with more samples
    assert rate(45, 50) == {"solved": 45, "n": 50, "rate": 0.9, "ci95": [0.7864, 0.9565]}
    assert inside(0.9, [0.9, 1.0]) and not inside(0.89, (0.9, 1.0))
    for bad in ((1, 0), (-1, 5), (6, 5)):
        with pytest.raises(ValueError, match="need n ≥ 1"):
            wilson(*bad)


def test_first_divergence_and_top1_agreement():
    assert first_divergence([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert first_divergence([1, 2, 3], [1, 2, 3]) == 3 and first_divergence([5], [6]) == 0
    lp = math.log
    full = [{1: lp(0.7), 2: lp(0.3)}, {3: lp(0.6), 4: lp(0.4)}]
    point = [{1: lp(0.6), 2: lp(0.4)}, {4: lp(0.9), 3: lp(0.1)}]
    r = teacher_forced(full, point)
    assert r["top1_agreement"] == 0.5
    want = (
        0.7 * math.log(0.7 / 0.6) + 0.3 * math.log(0.3 / 0.4) + 0.6 * math.log(0.6 / 0.1) + 0.4 * math.log(0.4 / 0.9)
    ) / 2
    assert r["kl_lower_bound"] == pytest.approx(want)
    assert teacher_forced(full, full)["kl_lower_bound"] == pytest.approx(0.0, abs=1e-12)


def _top_k(logp: np.ndarray, k: int) -> dict[int, float]:
    idx = np.argsort(-logp)[:k]
    return {int(i): float(logp[i]) for i in idx}


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 12), st.floats(0.1, 4.0))
def test_the_kl_bound_from_two_top_k_maps_never_exceeds_the_true_kl(seed, k, temperature):
    rng = np.random.default_rng(seed)
    vocab = 12
    a, b = rng.normal(size=vocab) / temperature, rng.normal(size=vocab) / temperature
    p, q = np.exp(a - np.logaddexp.reduce(a)), np.exp(b - np.logaddexp.reduce(b))
    true_kl = float(np.sum(p * (np.log(p) - np.log(q))))
    bound = kl_lower_bound(_top_k(np.log(p), k), _top_k(np.log(q), k))
    assert 0.0 <= bound <= true_kl + 1e-9
    if k >= vocab:  # nothing hidden: the bound is the KL
        assert bound == pytest.approx(true_kl, rel=1e-6)


def test_the_parity_budget_is_the_smallest_with_every_larger_one_at_parity_too():
    from vtoken.bench.quality.bench import parity_budgets

    def point(policy, budget, parity, fidelity=True, granularity="token"):
        return {
            "policy": policy,
            "granularity": granularity,
            "score_layers": 1,
            "budget": budget,
            "ruler": {"at_parity": parity},
            "fidelity": {"keeps_fidelity": fidelity},
        }

    pts = [
        point("h2o", 0.5, True),
        point("h2o", 0.3, True),
        point("h2o", 0.1, True),
        point("h2o", 0.2, False),
        point("tova", 0.5, False),
        point("tova", 0.2, True),
        point("snapkv", 0.5, True),
        point("snapkv", 0.2, True, fidelity=False),
        point("h2o", 96, True),
        point("h2o", 0.5, True, granularity="block"),
        {**point("knorm", 0.5, True), "ruler": {}},
    ]  # no RULER task ran: no claim
    got = {(r["policy"], r["granularity"], r["budget_kind"]): r["parity_budget"] for r in parity_budgets(pts)}
    assert got == {
        ("h2o", "token", "fraction"): 0.3,  # 0.1 is at parity, but 0.2 is not: noise, not a setting
        ("tova", "token", "fraction"): None,
        ("snapkv", "token", "fraction"): 0.5,
        ("h2o", "token", "tokens"): 96,
        ("h2o", "block", "fraction"): 0.5,
    }
    assert parity_budgets([{**point("h2o", 0.5, True), "fidelity": None}])[0]["parity_budget"] == 0.5
    # the adaptive budget is a setting of its own: its points never mix with the fixed budget's
    masses = parity_budgets([{**point("h2o", 1.0, True), "keep_mass": 0.9}, point("h2o", 1.0, False)])
    assert {r["keep_mass"]: r["parity_budget"] for r in masses} == {0.9: 1.0, None: None}
    # so is span pooling
    pools = parity_budgets([{**point("h2o", 0.9, True), "score_pool": 3}, point("h2o", 0.9, False)])
    assert {r["score_pool"]: r["parity_budget"] for r in pools} == {3: 0.9, 0: None}


def test_the_ruler_task_half_pairs_samples_with_the_full_cache():
    from vtoken.bench.quality.ruler import task_rule

    full = {"niah@1024": {"per_sample": [True] * 50}, "vt@1024": {"per_sample": [True] * 25 + [False] * 25}}
    same = {
        "niah@1024": {"per_sample": [True] * 50},
        "vt@1024": {"per_sample": [True] * 25 + [False] * 25},
        "at_parity": True,
    }
    assert task_rule(same, full) == {
        "niah@1024": {"difference": 0.0, "lower95": 0.0, "task_ok": True},
        "vt@1024": {"difference": 0.0, "lower95": 0.0, "task_ok": True},
        "at_parity": True,
    }
    # the same solved count on other samples is not parity: 10 lost and 10 gained
    swapped = {
        "niah@1024": {"per_sample": [True] * 50},
        "vt@1024": {"per_sample": [True] * 15 + [False] * 10 + [True] * 10 + [False] * 15},
    }
    verdict = task_rule(swapped, full)
    assert verdict["vt@1024"]["difference"] == 0.0 and not verdict["vt@1024"]["task_ok"]
    assert not verdict["at_parity"] and verdict["niah@1024"]["task_ok"]
