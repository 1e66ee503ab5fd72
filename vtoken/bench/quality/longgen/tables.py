"""Markdown tables of the parity rule's two halves, read from committed reports (docs/results.md's quality
section, ``scripts/results_doc.py``). Pure: reports in, text out; every figure is a report's own value.

* ``text_table``  — `vtoken bench longgen` points: perplexity ratio with its interval, top-1, KL, blocks;
* ``task_table``  — `vtoken bench codegen` points: HumanEval pass rate against the full cache's;
* ``ruler_table`` — `vtoken bench quality` RULER tasks judged by the task half (``ruler.py``'s ``rule``).
"""

from __future__ import annotations

from pathlib import Path

from vtoken.bench.quality.longgen.rule import RATIO_BOUND, TASK_DIFF_BOUND
from vtoken.core.config import Budget


def setting(settings: dict) -> str:
    """A point's setting in words: ``H2O 10 %, decode-only`` (the policy, budget and scope it ran with)."""
    budget = Budget.parse(settings["budget"])
    if budget.fraction == 1.0:
        return "full cache (budget 1.0)"
    kept = f"{budget.count} tokens" if budget.count is not None else f"{budget.fraction * 100:g} %"
    scope = "decode-only" if settings.get("scope") == "generated" else "every token"
    extra = "" if settings.get("score_layers", 1) == 1 else ", every layer scored"
    return f"{settings['policy']} {kept}, {scope}{extra}"


def model_name(report: dict) -> str:
    return Path(report["model"]).name


def yes(ok: bool) -> str:
    return "**yes**" if ok else "no"


def text_table(reports: list[dict]) -> str:
    """One row per longgen point: the text half (upper bound of the ratio's 95 % interval ≤ ``RATIO_BOUND``)."""
    head = (
        f"| model | prompt + continuation, windows | setting | perplexity ratio [95 % CI] | top-1 vs full | "
        f"KL (nats/token) | blocks held (full cache) | text half (≤ {RATIO_BOUND}) |\n"
        "|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for r in reports:
        s = r["setup"]
        shape = f"{s['prompt_tokens']} + {s['continuation_tokens']}, {s['windows']}"
        for p in r["points"]:
            lo, hi = p["perplexity_ratio_ci95"]
            rows.append(
                f"| {model_name(r)} | {shape} | {setting(p['settings'])} | {p['perplexity_ratio']} "
                f"[{lo}, {hi}] | {p['top1_agreement']} | {p['kl_mean']} | {p['retained_blocks_mean']} "
                f"({r['full_cache']['blocks_mean']}) | {yes(p['verdict']['text'])} |\n"
            )
    return head + "".join(rows)


def task_table(reports: list[dict]) -> str:
    """One row per codegen point: the task half (one-sided 95 % lower bound ≥ ``TASK_DIFF_BOUND``)."""
    head = (
        "| model | setting | HumanEval pass rate (full cache) | difference | one-sided 95 % lower bound | "
        f"task half (≥ {TASK_DIFF_BOUND}) | blocks held (full cache) |\n|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for r in reports:
        full = r["full_cache"]
        for p in r["points"]:
            rows.append(
                f"| {model_name(r)} | {setting(p['settings'])} | {p['accuracy']} ({full['accuracy']}) | "
                f"{p['difference']} | {p['lower95']} | {yes(p['task_ok'])} | {p['retained_blocks_mean']} "
                f"({full['retained_blocks_mean']}) |\n"
            )
    return head + "".join(rows)


def ruler_table(report: dict) -> str:
    """One row per point × RULER task@length of a quality report that carries the task half's ``rule``."""
    head = (
        "| model | setting | task @ tokens | full cache: solved / n | point: solved / n | difference | "
        f"one-sided 95 % lower bound | task half (≥ {TASK_DIFF_BOUND}) |\n|---|---|---|---|---|---|---|---|\n"
    )
    full = report["full_cache"]["ruler"]
    rows = []
    for p in report["points"]:
        name = setting(p)
        for task, verdict in p["ruler"]["rule"].items():
            if task == "at_parity":
                continue
            f, q = full[task], p["ruler"][task]
            rows.append(
                f"| {model_name(report)} | {name} | {task} | {f['solved']} / {f['n']} | {q['solved']} / "
                f"{q['n']} | {verdict['difference']} | {verdict['lower95']} | {yes(verdict['task_ok'])} |\n"
            )
    return head + "".join(rows)
