"""The long-generation yardstick's figure: what a setting costs in quality against what it saves in blocks.

One PNG per model (every report given must be of the same model, prompt and continuation length): x = KV
blocks a request holds ÷ the full cache's, y = perplexity ratio with its paired bootstrap 95 % interval
, one marker per setting, filled when the rule puts it at parity; the rule's bound 1.02 as a
dashed line. Side effect: writes ``path``.
"""

from __future__ import annotations

from pathlib import Path

from vtoken.bench.longgen.rule import RATIO_BOUND

SAME_RUN_KEYS = ("prompt_tokens", "continuation_tokens", "block_size")


def merged_points(reports: list[dict]) -> list[dict]:
    """Every point of ``reports`` with ``blocks_ratio`` (held ÷ full cache); ``ValueError`` naming the first
    report whose model or shape differs from the first's. Pure."""
    first = reports[0]
    out = []
    for r in reports:
        if r["model"] != first["model"] or any(r["setup"][k] != first["setup"][k] for k in SAME_RUN_KEYS):
            raise ValueError(f"report {r['command']!r} is not on the first report's model and shape")
        full = r["full_cache"]["blocks_mean"]
        out += [{**p, "blocks_ratio": p["retained_blocks_mean"] / full} for p in r["points"]]
    return out


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
        ax.errorbar(p["blocks_ratio"], ratio, yerr=[[ratio - low], [high - ratio]], fmt="o", color=colour,
                    markerfacecolor=colour if p["verdict"]["at_parity"] else "white", capsize=3,
                    label=f"{p['label']} (top-1 {p['top1_agreement']:.2f})")
    ax.axhline(RATIO_BOUND, color="black", linestyle="--", linewidth=1, label=f"parity bound {RATIO_BOUND}")
    ax.set_xlabel("KV blocks held ÷ full cache (vLLM's block rows, mean over decode steps)")
    ax.set_ylabel("perplexity ratio vs full cache, 95 % CI (lower is better)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    setup = reports[0]["setup"]
    ax.set_title(f"{Path(reports[0]['model']).name}: human text, {setup['prompt_tokens']} + "
                 f"{setup['continuation_tokens']} tokens, eviction after every token (filled: at parity)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
