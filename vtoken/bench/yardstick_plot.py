"""The yardstick's view of ``vtoken bench quality``: RULER-style rates with their 95 % intervals, and
fidelity, against the KV blocks a request holds.

``plot_yardstick`` writes one PNG (side effect: writes ``path``): one panel per task × length (solved
rate with Wilson 95 % error bars against retained blocks; the full cache's interval as a grey band) and
one fidelity panel (mean top-1 agreement under teacher forcing; the stated bound as a dotted line).
``yardstick_table`` is the Markdown table docs/quality.md shows (pure).
"""

from __future__ import annotations

from pathlib import Path


def setting(point: dict) -> str:
    """A point's policy with its prompt protection, as the plot's legend and the table name it:
    ``h2o``, ``h2o tail 64``, ``h2o decode-only``, ``h2o question-aware``, ``h2o mass 0.9``. Pure."""
    name = point["policy"]
    if point.get("prompt_tail"):
        name += f" tail {point['prompt_tail']}"
    if point.get("scope", "all") == "generated":
        name += " decode-only"
    if point.get("prompt_scores", "all") == "window":
        name += " question-aware"
    if point.get("keep_mass") is not None:
        name += f" mass {point['keep_mass']:g}"
    return name


def plot_yardstick(report: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [f"{t['task']}@{t['length']}" for t in report["ruler"]["tasks"]]
    panels = tasks + (["fidelity"] if report["fidelity"].get("prompts") else [])
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.8 * rows), squeeze=False)
    policies = sorted({setting(p) for p in report["points"]})
    colours = {name: plt.cm.tab10(i % 10) for i, name in enumerate(policies)}
    full = report["full_cache"]
    for ax, panel in zip(axes.ravel(), panels):
        for name in policies:
            row = sorted((p for p in report["points"] if setting(p) == name and p["granularity"] == "token"),
                         key=lambda p: p["budget"])
            if panel == "fidelity":
                xs = [p["fidelity"]["retained_blocks_mean"] for p in row]
                ax.plot(xs, [p["fidelity"]["top1_agreement"] for p in row], "o-", color=colours[name], label=name)
                continue
            xs = [p["ruler"][panel]["retained_blocks_mean"] for p in row]
            ys = [p["ruler"][panel]["rate"] for p in row]
            err = [[y - p["ruler"][panel]["ci95"][0] for y, p in zip(ys, row)],
                   [p["ruler"][panel]["ci95"][1] - y for y, p in zip(ys, row)]]
            ax.errorbar(xs, ys, yerr=err, fmt="o-", color=colours[name], capsize=3, linewidth=1, label=name)
        if panel == "fidelity":
            ax.axhline(report["fidelity"]["top1_bound"], color="black", linestyle=":", linewidth=1,
                       label="stated bound")
            ax.set_ylabel("top-1 agreement with the full cache")
            ax.set_title(f"fidelity, {report['fidelity']['tokens']} generated tokens", fontsize=9)
        else:
            f = full["ruler"][panel]
            ax.axhspan(*f["ci95"], color="grey", alpha=0.25,
                       label=f"full cache 95 % ({f['retained_blocks_mean']:.1f} blocks)")
            ax.axhline(f["rate"], color="black", linestyle="--", linewidth=1)
            ax.set_ylabel("solved rate (Wilson 95 %)")
            ax.set_title(f"{panel} (n = {f['n']})", fontsize=9)
            ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel("retained KV blocks per request")
        ax.grid(alpha=0.3)
    for ax in axes.ravel()[len(panels):]:
        ax.axis("off")
    axes.ravel()[0].legend(fontsize=7)
    fig.suptitle(f"Quality yardstick (token granularity, repack) — {Path(report['model']).name}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def yardstick_table(report: dict) -> str:
    """One row per setting (policy and prompt protection, ``setting``) and budget (token granularity): each
    task's solved rate with its 95 % interval, fidelity (top-1 agreement, median tokens to the first
    divergence), and whether the point is at parity; the full cache first. Pure."""
    tasks = [f"{t['task']}@{t['length']}" for t in report["ruler"]["tasks"]]
    fid = bool(report["fidelity"].get("prompts"))

    def cells(p: dict) -> list[str]:
        out = [f"{p['ruler'][t]['rate']:.2f} [{p['ruler'][t]['ci95'][0]:.2f}, {p['ruler'][t]['ci95'][1]:.2f}]"
               for t in tasks]
        if fid:
            f = p["fidelity"]
            out.append(f"{f['top1_agreement']:.3f} / {f['tokens_to_divergence_median']:g}")
        return out

    head = ["policy", "budget", *tasks, *(["top-1 / divergence"] if fid else []), "at parity"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines.append("| " + " | ".join(["full cache", "–", *cells(report["full_cache"]), "–"]) + " |")
    for p in sorted((p for p in report["points"] if p["granularity"] == "token"),
                    key=lambda p: (setting(p), p["budget"])):
        parity = p["ruler"].get("at_parity")
        if fid and parity is not None:
            parity = parity and p["fidelity"]["keeps_fidelity"]
        lines.append("| " + " | ".join([setting(p), f"{p['budget']:g}", *cells(p),
                                        "yes" if parity else "no"]) + " |")
    return "\n".join(lines) + "\n"
