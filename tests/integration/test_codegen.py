"""``vtoken bench codegen``: the rule's task half. HumanEval from the installed wheel, its unit tests run on
each completion, the paired report; on the real engine, that a point's completions are judged per problem
against the full cache's and that the full cache evicts nothing."""

from __future__ import annotations

import json
import statistics

import pytest
from support.paths import RESULTS

from vtoken.bench.quality.longgen import code, rule
from vtoken.bench.quality.longgen.codegen import FULL_LABEL, POINT_KEYS, REPORT_KEYS, CodegenSetup, build_report
from vtoken.core.config import VTokenConfig

COMMITTED = sorted(RESULTS.glob("codegen-*.json"))


@pytest.fixture(scope="module")
def problems():
    return code.problems()


# ---------------------------------------------------------------- the task data and the judge
def test_the_wheel_ships_all_164_problems_with_their_tests(problems):
    assert len(problems) == 164 and len({p.task_id for p in problems}) == 164
    assert all(f"def {p.entry_point}" in p.prompt and "def check" in p.test for p in problems)


def test_every_canonical_solution_passes_and_an_empty_body_never_does(problems):
    assert all(code.passes(p, p.canonical_solution) for p in problems)
    assert not any(code.passes(p, "    pass\n") for p in problems)


def test_a_completion_is_cut_at_the_first_new_top_level_statement():
    body = "    return x + 1\n"
    assert code.truncate(body + "\ndef helper():\n    pass\n") == body
    assert code.truncate(body + "\nprint(f(1))\n") == body
    assert code.truncate(body) == body


def test_a_wrong_answer_and_an_endless_loop_fail(problems):
    first = problems[0]
    assert not code.passes(first, "    return not " + first.canonical_solution.strip().split("return ", 1)[-1])
    assert not code.passes(first, "    while True:\n        pass\n", timeout_s=1.0)


# ---------------------------------------------------------------- the report (pure)
def _judged(full: list[bool], point: list[bool]) -> dict:
    def run(passed, evicted):
        return {
            "passed": passed,
            "text": [str(p) for p in passed],
            "tokens": [40] * len(passed),
            "evicted": [evicted] * len(passed),
            "held": [3.0] * len(passed),
        }

    return {FULL_LABEL: run(full, 0), "p": run(point, 5)}


def test_the_report_pairs_each_problem_with_the_full_cache():
    full = [True] * 60
    point = [i % 6 != 0 for i in range(60)]  # 10 of 60 lost
    setup = CodegenSetup(model="m", points=(("p", VTokenConfig(budget=0.1)),), problems=60)
    report = build_report(setup, _judged(full, point), "vtoken bench codegen", 1.0)
    assert set(report) == REPORT_KEYS
    (p,) = report["points"]
    assert set(p) == POINT_KEYS
    assert p["difference"] == pytest.approx(-10 / 60, abs=1e-4) and p["changed"] == 10
    assert not p["task_ok"] and p["lower95"] < rule.TASK_DIFF_BOUND
    same = build_report(setup, _judged(full, full), "c", 1.0)["points"][0]
    assert same["task_ok"] and same["difference"] == 0.0 and same["changed"] == 0


# ---------------------------------------------------------------- the committed results
@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.name)
def test_committed_codegen_results_recompute_from_their_problems(path):
    report = json.loads(path.read_text())
    assert set(report) - {"environment"} == REPORT_KEYS and "command" in report
    full = report["full_cache"]["per_problem"]
    assert len(full) == report["setup"]["problems"] >= 50
    assert report["full_cache"]["accuracy"] == round(statistics.fmean(full), 4)
    for p in report["points"]:
        assert set(p) == POINT_KEYS
        diff = rule.paired_difference(p["per_problem"], full)
        assert (p["difference"], p["lower95"]) == (diff["difference"], diff["lower95"]), p["label"]
        assert p["task_ok"] == (diff["lower95"] >= rule.TASK_DIFF_BOUND)
        assert p["accuracy"] == round(statistics.fmean(p["per_problem"]), 4)


def test_the_task_half_rejects_decode_only_h2o_on_the_model_that_solves_problems():
    """Qwen2.5-Coder solves 43 % of HumanEval with the full cache; recomputed from the committed
    per-problem verdicts, the rule rejects decode-only H2O 10 % (the old engine default) and even 95 %
    (lower bound −0.055). SmolLM2 solves none, so its task half cannot fail: only Qwen judges it."""
    report = json.loads((RESULTS / "codegen-qwen2.5-coder-0.5b.json").read_text())
    full = report["full_cache"]["per_problem"]
    assert sum(full) >= 50
    points = {p["label"]: p for p in report["points"]}
    for label in ("budget=0.1", "budget=0.95"):
        assert points[label]["settings"]["scope"] == "generated"
        diff = rule.paired_difference(points[label]["per_problem"], full)
        assert diff["lower95"] < rule.TASK_DIFF_BOUND, (label, diff)
    smol = json.loads((RESULTS / "codegen-smollm2.json").read_text())
    assert not any(smol["full_cache"]["per_problem"])


# ---------------------------------------------------------------- the real engine
@pytest.mark.slow
def test_codegen_on_the_engine_judges_each_point_against_the_full_cache(default_model):
    from vtoken.bench.quality.longgen.codegen import run_codegen

    setup = CodegenSetup(
        model=str(default_model),
        points=(("tight", VTokenConfig(budget=0.1, recent=4)),),
        problems=6,
        max_tokens=64,
        max_num_seqs=16,
        kv_space_gib=1,
    )
    judged = run_codegen(setup)
    assert judged[FULL_LABEL]["evicted"] == [0] * 6
    assert sum(judged["tight"]["evicted"]) > 0
    probs = code.problems()[:6]
    for label in (FULL_LABEL, "tight"):  # the verdicts are the unit tests' on the returned text
        assert judged[label]["passed"] == [code.passes(p, t) for p, t in zip(probs, judged[label]["text"])]
    report = build_report(setup, judged, "test", 0.0)
    assert report["points"][0]["evicted_tokens"] == sum(judged["tight"]["evicted"])
