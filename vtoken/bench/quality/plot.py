"""The Pareto view of ``vtoken bench quality``: task quality against the KV blocks a request holds.

One PNG with two panels (retrieval accuracy, language-modelling perplexity), x = retained blocks per
request (from vLLM's block rows), one colour per policy, filled markers for token granularity (repack),
open markers for block granularity (naive), and the full cache as a dashed line. Side effect: writes
``path``.
"""

from __future__ import annotations

from pathlib import Path


def plot_quality(report: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    policies = sorted({p["policy"] for p in report["points"]})
    colours = {name: plt.cm.tab10(i % 10) for i, name in enumerate(policies)}
    full = report["full_cache"]
    for ax, metric, task, label in (
        (axes[0], "accuracy", "retrieval", "pass-key accuracy (higher is better)"),
        (axes[1], "perplexity", "language_modelling", "perplexity (lower is better)"),
    ):
        for p in report["points"]:
            blocks = p[task]["retained_blocks_mean"]
            filled = p["granularity"] == "token"
            ax.scatter(
                blocks,
                p[metric],
                s=40,
                marker="o" if filled else "s",
                facecolors=colours[p["policy"]] if filled else "none",
                edgecolors=colours[p["policy"]],
            )
        for name in policies:  # one line per policy and granularity, in budget order
            for gran, style in (("token", "-"), ("block", ":")):
                row = sorted(
                    (p for p in report["points"] if p["policy"] == name and p["granularity"] == gran),
                    key=lambda p: p[task]["retained_blocks_mean"] or 0,
                )
                if row:
                    ax.plot(
                        [p[task]["retained_blocks_mean"] for p in row],
                        [p[metric] for p in row],
                        style,
                        color=colours[name],
                        linewidth=1,
                        label=f"{name} ({gran})",
                    )
        ax.axhline(
            full[metric],
            color="black",
            linestyle="--",
            linewidth=1,
            label=f"full cache ({full[task]['retained_blocks_mean']:.1f} blocks)",
        )
        ax.set_xlabel("retained KV blocks per request (vLLM's block rows)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, ncol=2, loc="upper right")
    fig.suptitle(f"Quality vs retained blocks — {Path(report['model']).name}, seed {report['setup']['seed']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def quality_table(report: dict) -> str:
    """The report as a Markdown table (pure): one row per policy and budget, retrieval accuracy,
    perplexity and retained blocks (retrieval / language modelling) for token and block granularity side
    by side, the full cache first. docs/quality.md holds this table for the committed run."""

    def cell(p: dict | None) -> str:
        if p is None:
            return "– | – | –"
        r, m = p["retrieval"]["retained_blocks_mean"], p["language_modelling"]["retained_blocks_mean"]
        return f"{p['accuracy']:.2f} | {p['perplexity']:.2f} | {r:.1f} / {m:.1f}"

    full = report["full_cache"]
    head = (
        "| policy | budget | token: accuracy | perplexity | blocks | block: accuracy | perplexity | blocks |\n"
        "|---|---|---|---|---|---|---|---|\n"
    )
    lines = [f"| full cache (`none`) | – | {cell(full)} | | | |"]
    by = {(p["policy"], p["budget"], p["granularity"]): p for p in report["points"]}
    for policy, budget in sorted({(p["policy"], p["budget"]) for p in report["points"]}):
        lines.append(
            f"| {policy} | {budget:g} | {cell(by.get((policy, budget, 'token')))} | "
            f"{cell(by.get((policy, budget, 'block')))} |"
        )
    return head + "\n".join(lines) + "\n"
