"""The yardstick's view of ``vtoken bench quality``: RULER-style rates with their 95 % intervals, and
fidelity, against the KV blocks a request holds.

``plot_yardstick`` writes one PNG (side effect: writes ``path``): one panel per task × length (solved
rate with Wilson 95 % error bars against retained blocks; the full cache's interval as a grey band) and
one fidelity panel (mean top-1 agreement under teacher forcing; the stated bound as a dotted line).
``yardstick_table`` is the Markdown table docs/quality.md shows (pure). ``merge_reports`` makes one such
report of several runs on the same yardstick (pure), so that every setting measured shows in one figure.
"""

from __future__ import annotations

from pathlib import Path

from vtoken.bench.quality.bench import parity_budgets
from vtoken.core.config import DEFAULT_SCORE_LAYERS

# what ``vtoken bench yardstick`` writes (``merge_reports``)
REPORT_KEYS = frozenset(
    {
        "bench",
        "command",
        "model",
        "reports",
        "fidelity_from",
        "commands",
        "ruler",
        "fidelity",
        "full_cache",
        "points",
        "parity",
    }
)


def setting(point: dict) -> str:
    """A point's policy with its prompt protection, as the plot's legend and the table name it:
    ``h2o``, ``h2o tail 64``, ``h2o decode-only``, ``h2o question-aware``, ``h2o mass 0.9``, ``h2o pool 3``.
    Pure."""
    name = point["policy"]
    if point.get("prompt_tail"):
        name += f" tail {point['prompt_tail']}"
    if point.get("scope", "all") == "generated":
        name += " decode-only"
    if point.get("prompt_scores", "all") == "window":
        name += " question-aware"
    if point.get("keep_mass") is not None:
        name += f" mass {point['keep_mass']:g}"
    if point.get("score_pool"):
        name += f" pool {point['score_pool']}"
    layers = point.get("score_layers", DEFAULT_SCORE_LAYERS)
    if layers != DEFAULT_SCORE_LAYERS:
        name += " all layers" if layers is None else f" {layers} layers"
    return name


def _tasks(report: dict) -> list[str]:
    return [f"{t['task']}@{t['length']}" for t in report["ruler"]["tasks"]]


def merge_reports(runs: list[tuple[str, dict]], fidelity_from: list[str]) -> dict:
    """One yardstick report of several ``vtoken bench quality`` runs ``(name, report)``. Pure.

    The runs that measured RULER tasks must share the model, the tasks × lengths, the samples, the seed and
    the full cache's rates (the same yardstick); their points' RULER halves are kept. Fidelity is taken only
    from the runs named in ``fidelity_from`` (which must share tokens and bound): a run whose fidelity is
    superseded (measured before a fix) gives its RULER half alone. A point is one setting (``setting``) ×
    budget × granularity; a later run's half replaces an earlier one's. ``parity``: each setting's smallest
    budget at parity (``quality.parity_budgets`` over the merged points). ValueError names the run that does
    not fit."""
    ruler_runs = [(n, r) for n, r in runs if r["ruler"]["tasks"]]
    fid_runs = [(n, r) for n, r in runs if n in fidelity_from]
    if not ruler_runs:
        raise ValueError("no run measured RULER tasks")
    if missing := [n for n in fidelity_from if n not in dict(runs)]:
        raise ValueError(f"--fidelity-from {', '.join(missing)}: not among the reports")
    ref_name, ref = ruler_runs[0]

    def yardstick(r: dict) -> tuple:
        full = r["full_cache"]["ruler"]
        return (
            Path(r["model"]).name,
            _tasks(r),
            r["setup"]["ruler_samples"],
            r["setup"]["seed"],
            [full[t]["solved"] for t in _tasks(r)],
        )

    for name, r in ruler_runs[1:]:
        if yardstick(r) != yardstick(ref):
            raise ValueError(
                f"{name}: model, tasks, samples, seed or full-cache rates differ from {ref_name}'s "
                f"({yardstick(r)} vs {yardstick(ref)})"
            )

    def fidelity_setup(r: dict) -> tuple:
        return r["fidelity"]["prompts"], r["fidelity"]["tokens"], r["fidelity"]["top1_bound"]

    for name, r in fid_runs:
        if not r["fidelity"].get("prompts"):
            raise ValueError(f"{name}: measured no fidelity (--fidelity-prompts 0)")
        if Path(r["model"]).name != Path(ref["model"]).name or fidelity_setup(r) != fidelity_setup(fid_runs[0][1]):
            raise ValueError(f"{name}: model or fidelity prompts, tokens or bound differ from {fid_runs[0][0]}'s")
    points: dict[tuple, dict] = {}
    for name, r in runs:
        for p in r["points"]:
            key = (setting(p), p["budget"], p["granularity"])
            merged = points.setdefault(key, {k: v for k, v in p.items() if k not in ("ruler", "fidelity")})
            if r["ruler"]["tasks"]:
                merged["ruler"] = p["ruler"]
            if name in fidelity_from:
                merged["fidelity"] = p["fidelity"]
    full = {"ruler": ref["full_cache"]["ruler"]}
    if fid_runs:
        full["fidelity"] = fid_runs[-1][1]["full_cache"]["fidelity"]
    return {
        "bench": "yardstick",
        "model": ref["model"],
        "reports": [n for n, _ in runs],
        "fidelity_from": list(fidelity_from),
        "commands": {n: r.get("command") for n, r in runs},
        "ruler": {"tasks": ref["ruler"]["tasks"], "samples": ref["setup"]["ruler_samples"]},
        "fidelity": (
            dict(zip(("prompts", "tokens", "top1_bound"), fidelity_setup(fid_runs[-1][1]))) if fid_runs else {}
        ),
        "full_cache": full,
        "points": list(points.values()),
        "parity": parity_budgets(list(points.values())),
    }


def plot_yardstick(report: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = _tasks(report)
    panels = tasks + (["fidelity"] if report["fidelity"].get("prompts") else [])
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.8 * rows), squeeze=False)
    policies = sorted({setting(p) for p in report["points"]})
    # 20 colours x 4 markers: every setting its own look, and every one in the legend (some have one half only)
    styles = {name: (plt.cm.tab20(i % 20), "osD^"[(i // 20) % 4]) for i, name in enumerate(policies)}
    full = report["full_cache"]
    for ax, panel in zip(axes.ravel(), panels):
        for name in policies:
            row = sorted(
                (
                    p
                    for p in report["points"]
                    if setting(p) == name
                    and p["granularity"] == "token"
                    and (p.get("fidelity") if panel == "fidelity" else panel in p.get("ruler", {}))
                ),
                key=lambda p: p["budget"],
            )
            if not row:
                continue
            if panel == "fidelity":
                xs = [p["fidelity"]["retained_blocks_mean"] for p in row]
                ax.plot(
                    xs,
                    [p["fidelity"]["top1_agreement"] for p in row],
                    "-",
                    marker=styles[name][1],
                    color=styles[name][0],
                )
                continue
            xs = [p["ruler"][panel]["retained_blocks_mean"] for p in row]
            ys = [p["ruler"][panel]["rate"] for p in row]
            err = [
                [y - p["ruler"][panel]["ci95"][0] for y, p in zip(ys, row)],
                [p["ruler"][panel]["ci95"][1] - y for y, p in zip(ys, row)],
            ]
            ax.errorbar(
                xs, ys, yerr=err, fmt="-", marker=styles[name][1], color=styles[name][0], capsize=3, linewidth=1
            )
        if panel == "fidelity":
            ax.axhline(report["fidelity"]["top1_bound"], color="black", linestyle=":", linewidth=1)
            ax.set_ylabel("top-1 agreement with the full cache")
            ax.set_title(f"fidelity, {report['fidelity']['tokens']} generated tokens", fontsize=9)
        else:
            f = full["ruler"][panel]
            ax.axhspan(*f["ci95"], color="grey", alpha=0.25)
            ax.axhline(f["rate"], color="black", linestyle="--", linewidth=1)
            ax.set_ylabel("solved rate (Wilson 95 %)")
            ax.set_title(f"{panel} (n = {f['n']}; full cache: {f['retained_blocks_mean']:.1f} blocks)", fontsize=9)
            ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel("retained KV blocks per request")
        ax.grid(alpha=0.3)
    for ax in axes.ravel()[len(panels) :]:
        ax.axis("off")
    handles = [plt.Line2D([], [], color=c, marker=m, label=name) for name, (c, m) in styles.items()]
    handles.append(
        plt.Rectangle((0, 0), 1, 1, color="grey", alpha=0.25, label="full cache's 95 % interval (dashed: its rate)")
    )
    if "fidelity" in panels:
        handles.append(plt.Line2D([], [], color="black", linestyle=":", label="stated top-1 bound"))
    spare = axes.ravel()[len(panels) :]
    where = (spare[0], "center") if len(spare) else (axes.ravel()[0], "best")
    where[0].legend(handles=handles, fontsize=7, loc=where[1], ncol=1 + len(handles) // 16)
    fig.suptitle(f"Quality yardstick (token granularity, repack) — {Path(report['model']).name}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def yardstick_table(report: dict) -> str:
    """One row per setting (policy and prompt protection, ``setting``) and budget (token granularity): each
    task's solved rate with its 95 % interval, fidelity (top-1 agreement, median tokens to the first
    divergence), and whether the point is at parity (both halves; "–" when a half it passed was not
    measured); the full cache first. Pure."""
    tasks = _tasks(report)
    fid = bool(report["fidelity"].get("prompts"))

    def cells(p: dict) -> list[str]:
        ruler = p.get("ruler", {})
        out = [
            f"{ruler[t]['rate']:.2f} [{ruler[t]['ci95'][0]:.2f}, {ruler[t]['ci95'][1]:.2f}]" if t in ruler else "–"
            for t in tasks
        ]
        if fid:
            f = p.get("fidelity")
            out.append(f"{f['top1_agreement']:.3f} / {f['tokens_to_divergence_median']:g}" if f else "–")
        return out

    head = ["policy", "budget", *tasks, *(["top-1 / divergence"] if fid else []), "at parity"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines.append("| " + " | ".join(["full cache", "–", *cells(report["full_cache"]), "–"]) + " |")
    for p in sorted(
        (p for p in report["points"] if p["granularity"] == "token"), key=lambda p: (setting(p), p["budget"])
    ):
        halves = [p.get("ruler", {}).get("at_parity")]
        if fid:
            halves.append(p["fidelity"]["keeps_fidelity"] if p.get("fidelity") else None)
        parity = "no" if False in halves else "yes" if all(halves) else "–"
        lines.append("| " + " | ".join([setting(p), f"{p['budget']:g}", *cells(p), parity]) + " |")
    return "\n".join(lines) + "\n"


def parity_table(report: dict) -> str:
    """The parity budget per setting (token granularity; a parity row carries the keys ``setting`` reads):
    the budgets measured, and the smallest at parity with every larger one at parity too ("none" when the
    largest is not). Pure."""
    lines = ["| setting | budgets measured | parity budget |", "|---|---|---|"]
    for r in sorted((r for r in report["parity"] if r["granularity"] == "token"), key=setting):
        best = "none" if r["parity_budget"] is None else f"{r['parity_budget']:g}"
        lines.append(f"| {setting(r)} | {', '.join(f'{b:g}' for b in r['budgets'])} | {best} |")
    return "\n".join(lines) + "\n"
