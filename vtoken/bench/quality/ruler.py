"""The RULER-style tasks of ``vtoken bench quality`` on the engine: every point × task × length × sample.

Each prompt is prefilled in one step (chunked prefill off, as in the pass-key task), then the policy
evicts down to its budget before the answer and keeps evicting as it grows. Per point and task: lm-eval's
score (mean ``string_match_all``), the solved rate (every answer found) with its Wilson 95 % interval, and
the retained blocks from vLLM's block rows, and ``per_sample`` (solved or not, in sample order). ``at_parity``:
the point's solved rate is inside the full cache's interval on every task and length (the older yardstick);
``rule``: per task the parity rule's task half (``vtoken.bench.quality.longgen.rule``: paired difference against the
full cache over the same samples, its one-sided 95 % lower bound, ``task_ok``) and ``at_parity`` over tasks.
"""

from __future__ import annotations

import statistics

from vtoken.bench.quality.intervals import inside, rate
from vtoken.bench.quality.longgen import rule
from vtoken.bench.quality.requests import blocks_summary, run_on_engine
from vtoken.bench.quality.ruler_tasks import ruler_cases


def run_ruler(setup, tokenizer, pts, on_phase) -> dict:
    """``{"tasks": [{"task", "length", "samples", "prompt_tokens_max"}], "skipped": [...], "points": {key: …}}``;
    a task × length with no instance that fits is listed in ``skipped`` with why (ValueError if all are)."""
    from vllm import SamplingParams

    groups, skipped = {}, []
    for task in setup.ruler_tasks:
        for length in setup.ruler_lengths:
            try:
                groups[f"{task}@{length}"] = ruler_cases(tokenizer, task, length, setup.ruler_samples, setup.seed)
            except ValueError as err:  # a length too short for the task's smallest instance: said in the report
                skipped.append({"task": task, "length": length, "why": str(err)})
    if not groups:
        raise ValueError("no RULER task fits the lengths asked for: " + "; ".join(s["why"] for s in skipped))
    cases = [c for group in groups.values() for c in group]
    longest = max(len(c.prompt_ids) + c.max_tokens for c in cases)
    on_phase(f"ruler: {len(pts)} points × {len(cases)} prompts ({', '.join(groups)})")

    def params_for(extra, case):
        return SamplingParams(max_tokens=case.max_tokens, temperature=0.0, extra_args=extra)

    results = run_on_engine(
        setup,
        cases,
        pts,
        params_for,
        max_model_len=longest + 8,
        max_num_batched_tokens=longest + 256,
        enable_chunked_prefill=False,
    )
    out: dict[str, dict] = {}
    for pt in pts:
        per_task = {}
        for name, group in groups.items():
            texts = [results[(pt.key, c.name)][0].outputs[0].text for c in group]
            solved = [bool(c.solved(t)) for c, t in zip(group, texts)]
            per_task[name] = {
                "score": round(statistics.fmean(c.score(t) for c, t in zip(group, texts)), 4),
                **rate(sum(solved), len(group)),
                **blocks_summary([results[(pt.key, c.name)][1] for c in group]),
                "per_sample": solved,
            }
        out[pt.key] = per_task
    full = out[pts[0].key]  # the full cache comes first (quality.points)
    for pt in pts[1:]:
        out[pt.key]["at_parity"] = all(inside(r["rate"], full[name]["ci95"]) for name, r in out[pt.key].items())
        out[pt.key]["rule"] = task_rule(out[pt.key], full)
    return {
        "tasks": [
            {
                "task": g[0].task,
                "length": g[0].length,
                "samples": len(g),
                "prompt_tokens_max": max(len(c.prompt_ids) for c in g),
            }
            for g in groups.values()
        ],
        "skipped": skipped,
        "points": out,
    }


def task_rule(point: dict, full: dict) -> dict:
    """The parity rule's task half for one point's RULER results against the full cache's (same samples, same
    order): ``{task: {difference, lower95, task_ok}, "at_parity": every task ok}``. Pure."""
    out = {}
    for name, r in point.items():
        if isinstance(r, dict) and "per_sample" in r:
            diff = rule.paired_difference(r["per_sample"], full[name]["per_sample"])
            out[name] = {**diff, "task_ok": diff["lower95"] >= rule.TASK_DIFF_BOUND}
    return {**out, "at_parity": all(v["task_ok"] for v in out.values())}
