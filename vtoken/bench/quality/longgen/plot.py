"""The long-generation yardstick's figure: what a setting costs in quality against what it saves in blocks.

One PNG per model (every report given must be of the same model, prompt and continuation length): x = KV
blocks a request holds ÷ the full cache's, y = perplexity ratio with its paired bootstrap 95 % interval
, one marker per setting, filled when the rule puts it at parity; the rule's bound 1.02 as a
dashed line. Side effect: writes ``path``.
"""

from __future__ import annotations

from pathlib import Path

from vtoken.bench.quality.longgen.rule import RATIO_BOUND
from vtoken.bench.quality.longgen.trade import merged_points


def plot_longgen(reports: list[dict], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = merged_points(reports)
    fig, ax = plt.subplots(figsize=(8, 5.2))
    for i, p in enumerate(sorted(points, key=lambda p: p["blocks_ratio"])):
        low, high = p["perplexity_ratio_ci95"]
        ratio = p["perplexity_ratio"]
        colour = plt.cm.tab20(i % 20)
        ax.errorbar(
            p["blocks_ratio"],
            ratio,
            yerr=[[ratio - low], [high - ratio]],
            fmt="o",
            color=colour,
            markerfacecolor=colour if p["verdict"]["at_parity"] else "white",
            capsize=3,
            label=f"{p['label']} (top-1 {p['top1_agreement']:.2f})",
        )
    ax.axhline(RATIO_BOUND, color="black", linestyle="--", linewidth=1, label=f"parity bound {RATIO_BOUND}")
    ax.set_xlabel("KV blocks held ÷ full cache (vLLM's block rows, mean over decode steps)")
    ax.set_ylabel("perplexity ratio vs full cache, 95 % CI (lower is better)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    setup = reports[0]["setup"]
    ax.set_title(
        f"{Path(reports[0]['model']).name}: human text, {setup['prompt_tokens']} + "
        f"{setup['continuation_tokens']} tokens, eviction after every token (filled: at parity)",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_trade(longgen: list[dict], codegen: list[dict], served: list[dict], path: str | Path) -> None:
    """One model's trade (``vtoken.bench.quality.longgen.trade``): left, perplexity ratio (95 % CI) against the gain
    over the full cache; right, HumanEval accuracy difference (down to its one-sided 95 % bound). Circles:
    capacity gain (blocks); stars: measured served gain over stock vLLM (min–max), at the matched point's
    quality. Filled: the rule's half holds. Side effect: writes ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from vtoken.bench.quality.longgen.rule import TASK_DIFF_BOUND
    from vtoken.bench.quality.longgen.trade import matches, served_gains, task_points, text_points

    text, gains = text_points(longgen), served_gains(served)
    judged = [r for r in codegen if any(r["full_cache"]["per_problem"])]  # a model that solves none cannot fail
    tasks = task_points(judged)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 7.5), sharex=True)
    colours = {
        label: plt.cm.tab20(i % 20)
        for i, label in enumerate(
            sorted(
                {p["label"] for p in text + tasks},
                key=lambda label: [p["gain"] for p in text + tasks if p["label"] == label],
            )
        )
    }
    for p in text:
        colour = colours[p["label"]]
        err = [[p["ratio"] - p["ci95"][0]], [p["ci95"][1] - p["ratio"]]]
        left.errorbar(
            p["gain"],
            p["ratio"],
            yerr=err,
            fmt="o",
            color=colour,
            capsize=3,
            label=p["label"],
            markerfacecolor=colour if p["at_parity"] else "white",
        )
        for g in (g for g in gains if matches(p["settings"], g["settings"])):
            left.errorbar(
                g["median"],
                p["ratio"],
                xerr=[[g["median"] - g["low"]], [g["high"] - g["median"]]],
                fmt="*",
                markersize=14,
                color=colour,
                markeredgecolor="black",
                capsize=3,
                label=f"{p['label']}: served, {g['pool_blocks']}-block pool"
                + (" (≥: grid top)" if g["lower_bound"] else ""),
            )
    left.axhline(RATIO_BOUND, color="black", linestyle="--", linewidth=1, label=f"parity bound {RATIO_BOUND}")
    left.set_ylabel("perplexity ratio vs full cache, human text, 95 % CI")
    for p in tasks:
        colour = colours[p["label"]]
        right.errorbar(
            p["gain"],
            p["difference"],
            yerr=[[p["difference"] - p["lower95"]], [0]],
            fmt="o",
            color=colour,
            capsize=3,
            markerfacecolor=colour if p["task_ok"] else "white",
            label=p["label"],
        )
    right.axhline(TASK_DIFF_BOUND, color="black", linestyle="--", linewidth=1, label=f"bound {TASK_DIFF_BOUND}")
    right.set_ylabel("HumanEval pass rate − full cache's (bar: one-sided 95 % bound)")
    if not tasks:
        why = (
            f"the full cache solves 0 of {codegen[0]['setup']['problems']} problems:\nthe task half cannot judge "
            "this model"
            if codegen
            else "no HumanEval report given"
        )
        right.text(0.5, 0.5, why, transform=right.transAxes, ha="center", va="center")
    from matplotlib.ticker import FixedLocator, NullFormatter, ScalarFormatter

    for ax in (left, right):
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(FixedLocator([1, 1.25, 1.5, 2, 3, 4]))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("gain over the full cache: ○ KV capacity (blocks), ★ served rate vs stock vLLM")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=6.5, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    fig.suptitle(
        f"{Path(longgen[0]['model']).name}: quality paid against what it buys (filled: at parity)", fontsize=10
    )
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
