"""The long-generation yardstick's report: per point the rule's verdict, and the per-window numbers it came
from (so a test can recompute every summary). Pure."""

from __future__ import annotations

import statistics

import numpy as np

from vtoken.bench.quality.longgen import rule
from vtoken.bench.quality.longgen.run import LonggenSetup, full_cache_blocks

# the top-level keys ``build_report`` returns; ``report.emit`` adds ``environment``
# (tests/integration/test_bench.py holds the committed longgen-*.json to them)
REPORT_KEYS = frozenset(
    {"bench", "command", "model", "setup", "rule", "sources", "windows", "full_cache", "points", "seconds"}
)
POINT_KEYS = frozenset(
    {
        "label",
        "settings",
        "perplexity_ratio",
        "perplexity_ratio_ci95",
        "top1_agreement",
        "kl_mean",
        "verdict",
        "retained_blocks_mean",
        "evicted_tokens",
        "engine_vs_reference_max_abs_logprob_diff",
        "engine_agrees",
        "per_window",
    }
)
ENGINE_AGREEMENT = 1e-3  # |engine log-prob − replay log-prob| above this (nats) marks the replay as not the engine's


def window_row(stats: dict, full: dict) -> dict:
    """One window's means: NLL (nats/token), top-1 agreement with the full cache, KL (nats/token)."""
    return {
        "nll": float(np.mean(stats["nll"])),
        "top1": float(np.mean(stats["top1"] == full["top1"])),
        "kl": float(np.mean(stats["kl"])),
    }


def summarize(rows: list[dict], full_nll: list[float]) -> dict:
    """A point's summary from its per-window rows (same windows, same order as ``full_nll``)."""
    ratio = rule.perplexity_ratio([r["nll"] for r in rows], full_nll)
    return {
        "perplexity_ratio": ratio["ratio"],
        "perplexity_ratio_ci95": ratio["ci95"],
        "top1_agreement": round(statistics.fmean(r["top1"] for r in rows), 4),
        "kl_mean": round(statistics.fmean(r["kl"] for r in rows), 5),
        "verdict": rule.at_parity(ratio),
    }


def build_report(
    setup: LonggenSetup, wins, measured: dict, sources: dict[str, str], command: str, seconds: float
) -> dict:
    """The JSON report of ``run_longgen``'s result ``measured``."""
    names = [w.name for w in wins]
    full = measured["full"]
    full_nll = [float(np.mean(full[n]["nll"])) for n in names]
    points = []
    for label, cfg in setup.points:
        per = measured["points"][label]
        rows = [window_row(per[n], full[n]) for n in names]
        held = [per[n]["held_blocks"] for n in names if per[n]["held_blocks"] is not None]
        diff = max(per[n]["engine_logprob_diff"] for n in names)
        points.append(
            {
                "label": label,
                "settings": cfg.to_dict(),
                **summarize(rows, full_nll),
                "retained_blocks_mean": round(statistics.fmean(held), 3) if held else None,
                "evicted_tokens": sum(per[n]["evicted"] for n in names),
                "engine_vs_reference_max_abs_logprob_diff": round(diff, 6),
                "engine_agrees": diff <= ENGINE_AGREEMENT,
                "per_window": {k: [round(r[k], 6) for r in rows] for k in ("nll", "top1", "kl")},
            }
        )
    return {
        "bench": "longgen",
        "command": command,
        "model": setup.model,
        "setup": {
            "prompt_tokens": setup.prompt_tokens,
            "continuation_tokens": setup.continuation_tokens,
            "windows": setup.windows,
            "seed": setup.seed,
            "block_size": setup.block_size,
        },
        "rule": {
            "ratio_bound": rule.RATIO_BOUND,
            "task_diff_bound": rule.TASK_DIFF_BOUND,
            "bootstrap_resamples": rule.BOOTSTRAP_RESAMPLES,
            "bootstrap_seed": rule.BOOTSTRAP_SEED,
        },
        "sources": sources,
        "windows": names,
        "full_cache": {
            "perplexity": round(float(np.exp(np.mean(full_nll))), 4),
            "per_window_nll": [round(x, 6) for x in full_nll],
            "blocks_mean": round(
                full_cache_blocks(setup.prompt_tokens, setup.continuation_tokens, setup.block_size), 3
            ),
        },
        "points": points,
        "seconds": round(seconds, 1),
    }


def markdown_table(report: dict) -> str:
    """The report as the Markdown table docs/quality.md shows (a test checks the docs hold it verbatim)."""
    full = report["full_cache"]
    lines = [
        "| setting | perplexity ratio [95 % CI] | top-1 vs full | KL (nats/token) | blocks held | at parity |",
        "|---|---|---|---|---|---|",
        f"| full cache (perplexity {full['perplexity']}) | 1 | 1 | 0 | {full['blocks_mean']} | — |",
    ]
    for p in report["points"]:
        low, high = p["perplexity_ratio_ci95"]
        lines.append(
            f"| `{p['label']}` | {p['perplexity_ratio']} [{low}, {high}] | {p['top1_agreement']} | "
            f"{p['kl_mean']} | {p['retained_blocks_mean']} | {'yes' if p['verdict']['at_parity'] else 'no'} |"
        )
    return "\n".join(lines)
