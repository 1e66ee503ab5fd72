"""`vtoken bench yardstick`: several quality runs on one yardstick merged into one report, figure and table;
the committed figure's table is the one its experiment file shows."""

from __future__ import annotations

import copy
import json
import shlex
from pathlib import Path

import pytest
from support.cli import run_vtoken
from support.paths import ROOT

from vtoken.bench.quality.yardstick_plot import merge_reports, parity_table, yardstick_table

TASK = "niah_single_1@512"


def _half(rate: float, parity: bool) -> dict:
    return {
        TASK: {
            "rate": rate,
            "solved": int(rate * 10),
            "n": 10,
            "ci95": [rate - 0.1, rate + 0.1],
            "retained_blocks_mean": 3.0,
        },
        "at_parity": parity,
    }


def _fid(top1: float) -> dict:
    return {
        "top1_agreement": top1,
        "tokens_to_divergence_median": 9.0,
        "keeps_fidelity": top1 >= 0.9,
        "retained_blocks_mean": 2.0,
    }


def _run(points: list[dict], tasks: bool = True, full_solved: int = 10, prompts: int = 4) -> dict:
    return {
        "model": "/m/smollm2",
        "setup": {"ruler_samples": 10, "seed": 0},
        "ruler": {"tasks": [{"task": "niah_single_1", "length": 512}] if tasks else []},
        "fidelity": {"prompts": prompts, "tokens": 64, "top1_bound": 0.9},
        "full_cache": {
            "ruler": {
                TASK: {
                    "rate": full_solved / 10,
                    "solved": full_solved,
                    "n": 10,
                    "ci95": [0.7, 1.0],
                    "retained_blocks_mean": 6.0,
                }
            }
            if tasks
            else {},
            "fidelity": _fid(1.0),
        },
        "points": points,
    }


def _point(budget: float, ruler: dict | None = None, fidelity: dict | None = None, **extra) -> dict:
    return {
        "policy": "h2o",
        "granularity": "token",
        "budget": budget,
        "score_layers": 1,
        "prompt_tail": 0,
        "scope": "all",
        "prompt_scores": "all",
        "keep_mass": None,
        **extra,
        "ruler": ruler or {},
        "fidelity": fidelity or {},
    }


def test_merge_keeps_each_runs_measured_half_and_only_the_chosen_fidelity():
    # its fidelity superseded (measured before a fix)
    old = _run([_point(0.3, _half(0.9, True), _fid(0.5)), _point(0.4, _half(0.9, True), _fid(0.5))])
    new_fid = _run(
        [_point(0.3, fidelity=_fid(0.95)), _point(0.2, fidelity=_fid(0.8)), _point(0.25, fidelity=_fid(0.92))],
        tasks=False,
    )
    layers = _run([_point(0.3, _half(0.2, False), _fid(0.99), score_layers=None)])
    merged = merge_reports([("old", old), ("fid", new_fid), ("layers", layers)], ["fid", "layers"])
    by = {(p["budget"], p["score_layers"]): p for p in merged["points"]}
    assert set(by) == {(0.3, 1), (0.4, 1), (0.2, 1), (0.25, 1), (0.3, None)}
    assert by[0.4, 1]["ruler"][TASK]["rate"] == 0.9 and "fidelity" not in by[0.4, 1]
    assert by[0.3, 1]["ruler"][TASK]["rate"] == 0.9 and by[0.3, 1]["fidelity"]["top1_agreement"] == 0.95
    assert "ruler" not in by[0.2, 1] and by[0.3, None]["fidelity"]["top1_agreement"] == 0.99
    table = yardstick_table(merged)
    rows = {
        line.split(" | ")[0].lstrip("| ") + " " + line.split(" | ")[1]: line.rstrip(" |").rsplit(" | ", 1)[1]
        for line in table.splitlines()[3:]
    }
    # both halves pass -> yes; a failed half -> no, whether or not the other was measured; a passed half
    # without the other -> "–"
    assert rows == {"h2o 0.3": "yes", "h2o 0.4": "–", "h2o 0.2": "no", "h2o 0.25": "–", "h2o all layers 0.3": "no"}, (
        table
    )
    # the parity budget per setting: 0.3 and 0.4 pass on RULER (0.3 keeps fidelity, 0.4 has none measured),
    # 0.2 and 0.25 ran no RULER task; every layer fails
    assert {(r["score_layers"], r["parity_budget"]) for r in merged["parity"]} == {(1, 0.3), (None, None)}
    assert "| h2o | 0.3, 0.4 | 0.3 |" in parity_table(merged) and "| h2o all layers | 0.3 | none |" in parity_table(
        merged
    )


def test_merge_refuses_runs_on_another_yardstick_naming_them():
    a = _run([_point(0.3, _half(0.9, True))])
    other = copy.deepcopy(a)
    other["full_cache"]["ruler"][TASK]["solved"] = 7
    with pytest.raises(ValueError, match="b: model, tasks, samples, seed or full-cache rates differ from a's"):
        merge_reports([("a", a), ("b", other)], [])
    with pytest.raises(ValueError, match="c: measured no fidelity"):
        merge_reports([("a", a), ("c", _run([], prompts=0))], ["c"])
    with pytest.raises(ValueError, match="--fidelity-from x: not among the reports"):
        merge_reports([("a", a)], ["x"])
    with pytest.raises(ValueError, match="no run measured RULER tasks"):
        merge_reports([("f", _run([], tasks=False))], ["f"])


def test_the_command_refuses_bad_input_naming_it(tmp_path):
    not_report = tmp_path / "x.json"
    not_report.write_text("[1, 2]")
    broken = tmp_path / "y.json"
    broken.write_text("{")
    good = ROOT / "docs/results/quality-yardstick-smollm2-decode-only.json"
    for args, named in (
        ([str(tmp_path / "missing.json")], "missing.json"),
        ([str(not_report)], "x.json"),
        ([str(broken)], "y.json"),
        ([str(good), "--fidelity-from", "z.json"], "z.json"),
    ):
        run = run_vtoken("bench", "yardstick", *args, timeout=120)
        assert run.returncode == 2 and named in run.stderr and "Traceback" not in run.stderr, run.stderr[-800:]


def test_the_committed_yardstick_figure_and_its_table_in_the_docs_are_its_reports_merged(tmp_path):
    """docs/results/quality-yardstick-smollm2.json records the command that merged the committed runs: run
    again it gives the same points, the figure beside it exists, and its experiment file
    (docs/experiments/2026-12-03-yardstick-merged.md) shows its table."""
    committed = json.loads((ROOT / "docs/results/quality-yardstick-smollm2.json").read_text())
    args = shlex.split(committed["command"])[1:]
    for flag, to in (("--plot", tmp_path / "y.png"), ("--out", tmp_path / "y.json")):
        args[args.index(flag) + 1] = str(to)  # not over the committed files
    run = run_vtoken(*args, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    again = json.loads(run.stdout)
    assert again["points"] == committed["points"] and again["full_cache"] == committed["full_cache"]
    assert again["parity"] == committed["parity"]
    assert (tmp_path / "y.png").stat().st_size > 10_000
    assert (ROOT / committed["plot"]).stat().st_size > 10_000
    doc = (ROOT / "docs/experiments/2026-12-03-yardstick-merged.md").read_text()
    assert yardstick_table(committed) in doc
    assert parity_table(committed) in doc
    assert {Path(r).name for r in committed["reports"]} >= {
        "quality-yardstick-smollm2-decode-only.json",
        "quality-yardstick-smollm2-question-aware.json",
    }
