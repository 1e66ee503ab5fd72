"""``vtoken bench longgen``: the parity rule, the human-text windows, the points, and — on the real engine
and SmolLM2 — that the rule rejects a setting known to lose quality and accepts the engine's default."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from support.paths import RESULTS, ROOT

from vtoken.bench.quality.longgen import rule
from vtoken.bench.quality.longgen.cli import parse_point
from vtoken.bench.quality.longgen.report import POINT_KEYS, summarize
from vtoken.bench.quality.longgen.texts import all_windows, documents, windows
from vtoken.core.config import Scope, VTokenConfig
from vtoken.errors import ConfigError


# ---------------------------------------------------------------- the rule (pure)
def test_identical_runs_are_at_parity_with_a_ratio_of_exactly_one():
    nll = [2.0, 3.1, 2.5, 2.2]
    ratio = rule.perplexity_ratio(nll, nll)
    assert ratio == {"ratio": 1.0, "ci95": [1.0, 1.0]}
    assert rule.at_parity(ratio)["at_parity"]


def test_a_uniform_five_percent_loss_fails_and_names_the_bound():
    full = np.linspace(2.0, 3.0, 20)
    ratio = rule.perplexity_ratio(full + 0.05, full)
    assert ratio["ratio"] == pytest.approx(math.exp(0.05), abs=1e-4)
    verdict = rule.at_parity(ratio)
    assert not verdict["at_parity"] and "> 1.02" in verdict["failed"][0]


def test_the_interval_not_the_point_estimate_decides():
    """Mean loss 1 % (ratio 1.01 < 1.02) but spread over windows: the upper bound is above 1.02."""
    rng = np.random.default_rng(3)
    full = rng.uniform(2, 3, 30)
    d = rng.normal(0, 0.08, 30)
    d += 0.01 - d.mean()
    ratio = rule.perplexity_ratio(full + d, full)
    assert ratio["ratio"] < rule.RATIO_BOUND < ratio["ci95"][1]
    assert not rule.at_parity(ratio)["at_parity"]


def test_paired_accuracy_difference_bound():
    full = [True] * 50
    assert rule.paired_difference(full, full) == {"difference": 0.0, "lower95": 0.0}
    lost = [i % 10 != 0 for i in range(50)]  # 5 of 50 lost
    diff = rule.paired_difference(lost, full)
    assert diff["difference"] == -0.1 and diff["lower95"] < rule.TASK_DIFF_BOUND
    verdict = rule.at_parity({"ratio": 1.0, "ci95": [1.0, 1.0]}, {"niah": diff})
    assert not verdict["at_parity"] and verdict["text"] and verdict["tasks"] == {"niah": False}


def test_unpaired_or_too_few_units_are_refused():
    with pytest.raises(ValueError, match="paired"):
        rule.perplexity_ratio([1.0, 2.0], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="at least 2"):
        rule.paired_difference([True], [True])


# ---------------------------------------------------------------- windows of human text
class CharTokenizer:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def test_windows_never_overlap_nor_cross_documents_and_follow_the_seed():
    docs = {"a": "x" * 95, "b": "abcdefghij" * 7}
    pool = all_windows(CharTokenizer(), 30, docs)
    assert [(w.source, w.offset) for w in pool] == [("a", 0), ("a", 30), ("a", 60), ("b", 0), ("b", 30)]
    first = windows(CharTokenizer(), 30, 3, seed=0, docs=docs)
    assert first == windows(CharTokenizer(), 30, 3, seed=0, docs=docs)
    assert {w.name for w in first} != {w.name for w in windows(CharTokenizer(), 30, 3, seed=1, docs=docs)}
    with pytest.raises(ValueError, match="hold 5"):
        windows(CharTokenizer(), 30, 6, seed=0, docs=docs)


@pytest.mark.slow
def test_the_installed_texts_hold_a_hundred_windows_at_both_lengths(default_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model))
    docs = documents()
    assert any(k.startswith("pydoc:") for k in docs) and any(k.startswith("licenses:") for k in docs)
    assert len(all_windows(tok, 256, docs)) >= 100
    assert len(all_windows(tok, 32 + 1024, docs)) >= 100


# ---------------------------------------------------------------- points
def test_points_are_settings_over_the_engine_defaults():
    assert parse_point("default") == ("default", VTokenConfig())
    _, cfg = parse_point("scope=all,budget=0.9,policy=snapkv,score_layers=null")
    assert cfg == VTokenConfig(scope=Scope.ALL, budget=0.9, policy="snapkv", score_layers=None)
    with pytest.raises(ConfigError, match="'budget' is not key=value"):
        parse_point("budget")
    with pytest.raises(ConfigError, match="'budgit'"):
        parse_point("budgit=0.5")
    with pytest.raises(ConfigError, match="block_size is the engine's"):
        parse_point("block_size=64")


def test_the_teacher_processor_refuses_a_malformed_teacher():
    from vllm import SamplingParams

    from vtoken.vllm.offline.teacher import TeacherForcing

    TeacherForcing.validate_params(SamplingParams(extra_args={"teacher": [1, 2]}))
    with pytest.raises(ValueError, match="list of token ids"):
        TeacherForcing.validate_params(SamplingParams(extra_args={"teacher": "abc"}))


# ---------------------------------------------------------------- committed results recompute
def committed_reports() -> list[Path]:
    return sorted(RESULTS.glob("longgen-*.json"))


@pytest.mark.parametrize("path", committed_reports(), ids=lambda p: p.name)
def test_committed_summaries_recompute_from_their_windows(path):
    report = json.loads(path.read_text())
    full = report["full_cache"]["per_window_nll"]
    assert len(full) == len(report["windows"]) == report["setup"]["windows"]
    for point in report["points"]:
        rows = [
            dict(zip(("nll", "top1", "kl"), v)) for v in zip(*(point["per_window"][k] for k in ("nll", "top1", "kl")))
        ]
        again = summarize(rows, full)
        assert set(point) == POINT_KEYS
        for key in ("perplexity_ratio", "perplexity_ratio_ci95", "verdict"):
            assert again[key] == point[key], (point["label"], key)
        assert again["top1_agreement"] == pytest.approx(point["top1_agreement"], abs=1e-4)
        assert again["kl_mean"] == pytest.approx(point["kl_mean"], abs=1e-4)
        assert point["engine_agrees"], point["label"]


# ---------------------------------------------------------------- the rule on the real engine
@pytest.fixture(scope="module")
def small_yardstick(default_model):
    """12 windows, 32 + 96 tokens, on SmolLM2: the old default (decode-only H2O 10 %) and today's default."""
    from vtoken.bench.quality.longgen.report import build_report
    from vtoken.bench.quality.longgen.run import LonggenSetup, run_longgen
    from vtoken.bench.quality.longgen.texts import digests

    points = (parse_point("scope=generated,budget=0.1"), parse_point("default"))
    setup = LonggenSetup(
        model=str(default_model),
        points=points,
        prompt_tokens=32,
        continuation_tokens=96,
        windows=12,
        max_num_seqs=24,
        kv_space_gib=1,
    )
    from transformers import AutoTokenizer

    docs = documents()
    wins = windows(AutoTokenizer.from_pretrained(str(default_model)), 128, 12, 0, docs)
    report = build_report(setup, wins, run_longgen(setup, wins), digests(docs), "test", 0.0)
    return {p["label"]: p for p in report["points"]}


@pytest.mark.slow
def test_the_rule_rejects_decode_only_h2o_at_ten_percent_on_human_text(small_yardstick):
    point = small_yardstick["scope=generated,budget=0.1"]
    assert point["evicted_tokens"] > 0 and point["engine_agrees"]
    assert point["perplexity_ratio"] > 1.0
    assert not point["verdict"]["at_parity"], point


@pytest.mark.slow
def test_the_engine_default_is_at_parity_under_the_rule(small_yardstick):
    point = small_yardstick["default"]
    assert point["engine_agrees"]
    assert point["verdict"]["at_parity"], point["verdict"]
    assert point["perplexity_ratio_ci95"][1] <= rule.RATIO_BOUND and point["top1_agreement"] >= 0.95


def test_the_report_has_exactly_its_keys():
    """``build_report`` on a synthetic measurement: ``REPORT_KEYS`` at the top, ``POINT_KEYS`` per point."""
    from types import SimpleNamespace

    from vtoken.bench.quality.longgen.report import POINT_KEYS, REPORT_KEYS, build_report
    from vtoken.bench.quality.longgen.run import LonggenSetup

    wins = [SimpleNamespace(name=f"w{i}") for i in range(3)]
    full = {w.name: {"nll": np.array([2.0, 3.0]), "top1": np.array([5, 6])} for w in wins}
    point = {
        w.name: {
            "nll": np.array([2.1, 3.0]),
            "top1": np.array([5, 7]),
            "kl": np.array([0.1, 0.0]),
            "held_blocks": 2.0,
            "evicted": 1,
            "engine_logprob_diff": 1e-5,
        }
        for w in wins
    }
    setup = LonggenSetup(model="m", points=(parse_point("budget=0.5"),), windows=3)
    report = build_report(setup, wins, {"full": full, "points": {"budget=0.5": point}}, {}, "vtoken bench longgen", 1.0)
    assert set(report) == REPORT_KEYS and set(report["points"][0]) == POINT_KEYS
    p = report["points"][0]
    assert p["top1_agreement"] == 0.5 and p["perplexity_ratio"] == pytest.approx(math.exp(0.05), abs=1e-4)
    assert p["evicted_tokens"] == 3 and p["engine_agrees"]


@pytest.mark.parametrize("path", committed_reports(), ids=lambda p: p.name)
def test_the_experiments_show_each_committed_table_verbatim(path):
    """Each committed run's table is in the lab notebook (docs/experiments/), as first measured."""
    from vtoken.bench.quality.longgen.report import markdown_table

    notebook = ROOT / "docs" / "experiments"
    docs = "\n".join(p.read_text() for p in sorted(notebook.glob("*.md")))
    assert markdown_table(json.loads(path.read_text())) in docs


def test_the_figure_refuses_reports_of_another_shape_and_draws_one_marker_per_setting(tmp_path):
    from vtoken.bench.quality.longgen.plot import plot_longgen
    from vtoken.bench.quality.longgen.trade import merged_points

    path = committed_reports()[0]
    report = json.loads(path.read_text())
    points = merged_points([report])
    assert len(points) == len(report["points"]) and all(0 < p["blocks_ratio"] <= 1.0 + 1e-9 for p in points)
    other = {**report, "setup": {**report["setup"], "continuation_tokens": 1024}}
    with pytest.raises(ValueError, match="not on the first report's model and shape"):
        merged_points([report, other])
    plot_longgen([report], tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_size > 10_000
