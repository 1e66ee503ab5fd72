"""docs/results.md quotes only what its JSONs say, and the docs' links resolve (issue 40).

docs/results.md is written by ``scripts/results_doc.py`` from the reports under docs/results/: the committed
file must be exactly what the script gives for the committed JSONs (every number it quotes is read from a
JSON there), a changed JSON value must change the text, and the headline figures are recomputed here
independently from the JSONs' own summaries. Every relative link in README.md and docs/**/*.md must name a
file that exists and, with ``#anchor``, a heading of that file. Pure file reading.
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
from pathlib import Path

import pytest
from support.ops import load_module
from support.paths import ROOT

from vtoken.bench.served.measures import report_label

RESULTS = ROOT / "docs" / "results"
DOC = ROOT / "docs" / "results.md"


def results_doc():
    """scripts/results_doc.py, imported by path (a fresh module each call)."""
    return load_module(ROOT / "scripts" / "results_doc.py")


def test_results_md_is_what_the_jsons_give():
    committed = DOC.read_text()
    assert results_doc().render(RESULTS) == committed, (
        "docs/results.md differs from its JSONs: run `python scripts/results_doc.py`"
    )


def test_a_changed_json_value_changes_the_quoted_figure(tmp_path):
    """The figures are read, not written into the script: move one repeat's ratio and one capacity count and
    the rendered text moves with them."""
    mod = results_doc()
    copy = tmp_path / "results"
    shutil.copytree(RESULTS, copy, ignore=shutil.ignore_patterns("*.png", "gpu", "lm-eval"))
    before = mod.render(copy)
    serve = copy / "serve-smollm2-decode-only-10.json"
    report = json.loads(serve.read_text())
    ratio = report["summary"]["ratios"]["repack/h2o +admission / none"]["max_rate_at_target"]
    ratio["values"] = [v * 1.5 for v in ratio["values"]]
    serve.write_text(json.dumps(report))
    cap = copy / "capacity-smollm2.json"
    report = json.loads(cap.read_text())
    report["modes"]["repack"]["max_feasible_concurrency"] = 22
    cap.write_text(json.dumps(report))
    after = mod.render(copy)
    assert "**3× (2.1–4.29)**" in after and "**3× (2.1–4.29)**" not in before
    assert "6 → **22**" in after and "6 → **21**" in before


def _row(text: str, json_name: str) -> str:
    """The table row of docs/results.md whose cells are read from ``json_name`` (served rows link the
    experiment; others are found by the line naming the report)."""
    lines = [line for line in text.splitlines() if line.startswith("|") and json_name in line]
    assert len(lines) == 1, (json_name, lines)
    return lines[0]


def _fmt(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".")


@pytest.mark.parametrize(("name", "experiment"), results_doc().SERVED)  # (report, the experiment its row links)
def test_each_served_row_quotes_its_reports_summary(name, experiment):
    """Recomputed from the report's own ``summary`` (``vtoken/bench/served/summary.py``), not from the script:
    the medians and spreads of repack ÷ stock and repack ÷ Naive-Evict, and each variant's median rate."""
    report = json.loads((RESULTS / name).read_text())
    row = _row(DOC.read_text(), experiment)
    cells = [c.strip() for c in row.strip("|").split("|")]
    policy = report["setup"]["policies"][0]
    ratios = report["summary"]["ratios"]
    for cell, key in (
        (cells[7], f"repack/{policy} +admission / none"),
        (cells[8], f"repack/{policy} +admission / naive/{policy} +admission"),
    ):
        for rate_key in ("max_rate_at_target", "rate_at_target_interpolated"):
            s = ratios[key][rate_key]
            assert statistics.median([v for v in s["values"] if v is not None]) == pytest.approx(s["median"], abs=1e-4)
            spread = f" ({_fmt(s['min'])}–{_fmt(s['max'])})" if s["min"] != s["max"] else ""
            assert f"{_fmt(s['median'])}×{spread}" in cell, (name, rate_key, cell, s)
    variants = report["summary"]["variants"]
    for cell, label in (
        (cells[4], "none"),
        (cells[5], f"naive/{policy} +admission"),
        (cells[6], f"repack/{policy} +admission"),
    ):
        assert _fmt(variants[label]["max_rate_at_target"]["median"]) in cell, (name, label, cell)
    assert f"{report['setup']['pool_blocks']} blocks" == cells[2]
    assert (
        f"{report['setup']['input_len']} + {report['setup']['output_len']}, {report['setup']['num_prompts']}"
        == cells[1]
    )


def test_the_capacity_retained_and_fleet_headlines_follow_their_jsons():
    text = DOC.read_text()
    for name, model in (
        ("capacity-smollm2.json", "SmolLM2-135M"),
        ("capacity-tiny-llama.json", "tiny Llama"),
        ("capacity-gemma3-270m.json", "Gemma 3 270M"),
    ):
        r = json.loads((RESULTS / name).read_text())
        row = next(line for line in text.splitlines() if line.startswith(f"| {model}"))
        naive, repack = r["modes"]["naive"], r["modes"]["repack"]
        assert (
            f"{naive['max_feasible_concurrency']} → **{repack['max_feasible_concurrency']}** "
            f"({_fmt(r['ratios_vs_naive']['repack']['max_feasible_concurrency'])}×)" in row
        )
        assert f"({_fmt(r['ratios_vs_naive']['repack']['throughput'])}×" in row
    for name in ("retained_smollm2.json", "retained_synthetic.json"):
        gains = [c["repack_vs_naive_pct"] for c in json.loads((RESULTS / name).read_text())["rows"]]
        rng = f"**−{abs(max(gains)):.1f} … −{abs(min(gains)):.1f} %**"
        assert rng in text, (name, rng)
    fleet = json.loads((RESULTS / "fleet-256.json").read_text())["replicas_needed"]
    assert (
        f"naive **{fleet['naive']['min_fixed_replicas_meeting_slo']}**, repack "
        f"**{fleet['repack']['min_fixed_replicas_meeting_slo']}**" in text
    )
    # the quality halves: every longgen/codegen point's figures and verdict, read here from each JSON
    for path in sorted(RESULTS.glob("longgen-*.json")):
        for p in json.loads(path.read_text())["points"]:
            lo, hi = p["perplexity_ratio_ci95"]
            cell = f"| {p['perplexity_ratio']} [{lo}, {hi}] | {p['top1_agreement']} |"
            assert cell in text, (path.name, p["label"])
            verdict = "**yes** |" if hi <= 1.02 else "no |"
            assert f"{cell} {p['kl_mean']} |" in text and text.split(cell, 1)[1].split("\n")[0].endswith(verdict)
    for path in sorted(RESULTS.glob("codegen-*.json")):
        for p in json.loads(path.read_text())["points"]:
            ok = "**yes**" if p["lower95"] >= -0.05 else "no"
            assert f"| {p['difference']} | {p['lower95']} | {ok} |" in text, (path.name, p["label"])


def test_the_retained_reports_say_what_they_ran_on():
    """docs/results/retained_*.json carry no ``environment``; docs/results.md says so."""
    reports = [
        json.loads((RESULTS / name).read_text()) for name in ("retained_smollm2.json", "retained_synthetic.json")
    ]
    said = "The retained reports carry no `environment`" in DOC.read_text()
    assert said == all("environment" not in r for r in reports), "docs/results.md's note on retained_*.json is stale"


# ------------------------------------------------------------------------------------ links resolve

LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\*", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    out, seen, fenced = set(), {}, False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced:
            continue
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def doc_links(path: Path) -> list[tuple[int, str]]:
    out, fenced = [], False
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        line = re.sub(r"`[^`]*`", "", line)
        for m in LINK.finditer(line):
            out.append((lineno, m.group(1) or m.group(2)))
    return out


def broken_links() -> list[str]:
    problems = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for lineno, target in doc_links(path):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            where = f"{path.relative_to(ROOT)}:{lineno}: {target}"
            if not dest.exists():
                problems.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where}: no heading with that anchor")
    return problems


def test_every_relative_link_in_the_docs_resolves():
    assert broken_links() == []


def test_a_broken_link_is_caught(tmp_path, monkeypatch):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# Top\n\n[ok](docs/a.md#a--b) [bad](docs/a.md#nope) [gone](docs/b.md)\n")
    (tmp_path / "docs" / "a.md").write_text("# A — b\n\n```\n[x](nowhere.md)\n```\n[up](../README.md#top)\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert [p.split(": ", 1)[1] for p in broken_links()] == [
        "docs/a.md#nope: no heading with that anchor",
        "docs/b.md: no such file",
    ]


@pytest.mark.parametrize(
    "name",
    [
        "serve-smollm2-burst-12-blocks.json",
        "serve-smollm2-burst-12-blocks-low.json",
        "serve-smollm2-burst-12-blocks-seed1.json",
        "serve-smollm2-burst-64-blocks.json",
        "serve-smollm2-burst-128-blocks-compute.json",
    ],
)
def test_the_pressure_rows_quote_their_reports_summary_and_costs(name):
    """The bursts table (``PRESSURE``): recomputed from the report's own ``summary`` and each run's ``cost``,
    not from the script: every server's median rate, repack under pressure over stock vLLM, preemptions and
    the requests trimmed over every run of each server."""
    report = json.loads((RESULTS / name).read_text())
    text = DOC.read_text()
    section = text[text.index("## Served when memory is short") :].split("\n## ", 1)[0]
    rates = report["setup"]["rates"]
    setup = report["setup"]
    group = (
        f"| **{', '.join(str(x) for x in rates)} req/s offered, {setup['num_prompts']} requests each, "
        f"{setup['pool_blocks']}-block pool,"
    )
    lines = section[section.index(group) :].splitlines()[1:]
    rows = {}
    for line in lines:
        if not line.startswith("| ") or line.startswith("| **"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells
    assert set(rows) == set(report["summary"]["variants"])
    for label, summary in report["summary"]["variants"].items():
        median = summary["max_rate_at_target"]["median"]
        assert (_fmt(median) if median is not None else "none in") in rows[label][1], (label, rows[label])
        runs = [r for rep in report["repeats"] for v in rep for r in v["runs"] if report_label(v) == label]
        costs = [r["cost"] for r in runs if r["cost"]]
        if costs:
            trimmed, finished = sum(c["trimmed"] for c in costs), sum(c["finished"] for c in costs)
            assert rows[label][5] == f"{trimmed} of {finished}", (label, rows[label])
        assert rows[label][4] == str(sum(r["preemptions"] or 0 for r in runs)), (label, rows[label])
    (pressure,) = [label for label in rows if label.startswith("repack/h2o@pressure")]
    ratio = report["summary"]["ratios"][f"{pressure} / none"]["max_rate_at_target"]
    cell = rows[pressure][2]
    if ratio["median"] is None:
        assert cell == "undefined"
    elif cell == "both at the grid's top":  # every repeat of both servers met the highest rate offered
        tops = [v["max_rate_at_target"] for rep in report["repeats"] for v in rep]
        assert tops == [max(rates)] * len(tops)
    else:
        assert _fmt(ratio["median"]) + "×" in cell
