"""Write docs/results.md from the committed reports under docs/results/: every figure it quotes is read from its
JSON here, beside a link to that JSON and the command that wrote it (the report's ``command``).

    python scripts/results_doc.py            # rewrite docs/results.md
    python scripts/results_doc.py --check    # exit 1 if docs/results.md is not what the JSONs give

Which reports make a figure, and in what order, is declared below (``SERVED``, ``PRESSURE``, ``CAPACITY``, ``RETAINED``,
``FLEET``, ``LONGGEN``, ``CODEGEN``, ``RULER``); the numbers are not (the quality tables are rendered by
``vtoken.bench.quality.longgen.tables``). tests/docs/test_results_doc.py checks the committed file is this script's
output. Pure but for the file I/O.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = "docs/results.md"

# (report, experiment that stated and first measured it): the served headlines, newest setting first
SERVED = [
    ("serve-smollm2-decode-only-10.json", "2026-12-04-decode-only-10.md"),
    ("serve-smollm2-decode-only-12-blocks.json", "2026-12-03-decode-only-30.md"),
    ("serve-smollm2-decode-only-long-prompt.json", "2026-12-03-decode-only-long-prompt.md"),
    ("serve-smollm2-32-blocks-stock-median.json", "2026-12-03-stock-baseline-32-blocks.md"),
    ("serve-smollm2-64-blocks-stock-median.json", "2026-12-03-stock-baseline-64-blocks.md"),
]
# (report, experiment): eviction only when memory is short (trigger pressure) on bursts, every server side by side
PRESSURE = [
    ("serve-smollm2-burst-12-blocks.json", "2026-12-06-burst-pressure.md"),
    ("serve-smollm2-burst-12-blocks-low.json", "2026-12-06-burst-pressure.md"),
    ("serve-smollm2-burst-12-blocks-seed1.json", "2026-12-06-burst-pressure.md"),
    ("serve-smollm2-burst-64-blocks.json", "2026-12-06-burst-pressure.md"),
    ("serve-smollm2-burst-128-blocks-compute.json", "2026-12-06-burst-pressure.md"),
]
# the decode-only H2O points of the long-generation yardstick: what a final share of context lost costs
YARDSTICK = "longgen-smollm2-224.json"
CAPACITY = ["capacity-smollm2.json", "capacity-tiny-llama.json", "capacity-gemma3-270m.json"]
RETAINED = ["retained_smollm2.json", "retained_synthetic.json"]
FLEET = "fleet-256.json"
# the parity rule's halves (docs/quality.md): text (longgen), tasks (codegen; RULER on the model with context)
LONGGEN = [
    "longgen-smollm2-224.json",
    "longgen-smollm2-224-served-settings.json",
    "longgen-smollm2-224-policies.json",
    "longgen-smollm2-1024.json",
    "longgen-qwen2.5-coder-0.5b-224.json",
]
CODEGEN = ["codegen-qwen2.5-coder-0.5b.json", "codegen-smollm2.json"]
RULER = "quality-qwen2.5-coder-0.5b-ruler.json"
POLICY_NAMES = {"h2o": "H2O", "scissorhands": "Scissorhands", "random": "Random", "tova": "TOVA"}
# a report names its model by the checkpoint path it loaded; its last component → the name the docs use
MODEL_NAMES = {
    "smollm2-135m-instruct": "SmolLM2-135M",
    "tiny-llama-s0-r1": "tiny Llama (2 layers)",
    "gemma-3-270m": "Gemma 3 270M",
}


def num(x: float, digits: int = 2) -> str:
    """``x`` rounded to ``digits`` decimals, trailing zeros dropped: 2.0 → "2", 1.4286 → "1.43"."""
    s = f"{x:.{digits}f}"
    return s.rstrip("0").rstrip(".") if "." in s else s


def pct(x: float, digits: int = 1) -> str:
    """A signed percentage with a typographic minus: -38.86 → "−38.9"."""
    return f"{x:.{digits}f}".replace("-", "−")


def load(name: str, results: Path) -> dict:
    return json.loads((results / name).read_text())


def link(name: str) -> str:
    return f"[`{name}`](results/{name})"


def environment(report: dict) -> str:
    env = report.get("environment")
    if not env:
        return "machine not recorded"
    cores = f", {env['cores']} cores" if env.get("cores") else ""
    gpu = f", {env['gpu']}" if env.get("gpu") else ""
    return f"{env.get('cpu') or env.get('machine')}{cores}{gpu}, vLLM {env.get('vllm')}, torch {env.get('torch')}"


def source_line(name: str, report: dict) -> str:
    """One bullet: the JSON, what it ran on, the command that wrote it, and why it is marked superseded."""
    old = report.get("superseded")
    note = f" Marked superseded: {old['why']}." if old else ""
    return f"- {link(name)} ({environment(report)}): `{report['command']}`.{note}\n"


# ---------------------------------------------------------------------------------------------- served


def at_grid_top(v: dict) -> bool:
    from vtoken.bench.served.summary import at_grid_top as top

    return top(v)


def median_cell(values: list[float | None], bounds: list[bool], unit: str = "") -> str:
    """``median (min–max)`` over the defined values; "≥" when a lower bound sits at or below the median (raising
    it could raise the median); a value that is ``None`` (undefined) is left out."""
    pairs = [(v, b) for v, b in zip(values, bounds, strict=True) if v is not None]
    if not pairs:
        return "undefined"
    vals = [v for v, _ in pairs]
    med = statistics.median(vals)
    ge = "≥ " if any(b and v <= med for v, b in pairs) else ""
    spread = f" ({num(min(vals))}–{num(max(vals))})" if min(vals) != max(vals) else ""
    return f"{ge}{num(med)}{unit}{spread}"


def served_rows(results: Path) -> tuple[str, str]:
    head = (
        "| setting | workload (prompt + generated tokens, requests per rate) | KV pool | SLOs (TTFT / TPOT) "
        "| stock vLLM (req/s) | Naive-Evict (req/s) | repack (req/s) | repack ÷ stock vLLM | "
        "repack ÷ Naive-Evict | experiment |\n|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows, sources = [], []
    for name, experiment in SERVED:
        r = load(name, results)
        setup = r["setup"]
        reps = r["repeats"]
        by_mode = [{v["mode"]: v for v in rep} for rep in reps]
        policy = POLICY_NAMES.get(setup["policies"][0], setup["policies"][0])
        scope = "decode-only" if "vtoken.scope=generated" in setup.get("extra", []) else "every token"
        budget = num(float(setup["budget"]) * 100, 0)
        cells = []
        for mode in ("none", "naive", "repack"):
            vals = [rep[mode]["max_rate_at_target"] for rep in by_mode]
            cells.append(median_cell(vals, [at_grid_top(rep[mode]) for rep in by_mode]))
        ratios = []
        for base in ("none", "naive"):
            key = f"repack/{setup['policies'][0]} +admission / " + (
                "none" if base == "none" else f"naive/{setup['policies'][0]} +admission"
            )
            summary = r["summary"]["ratios"][key]
            # a ratio is a lower bound where repack met its grid's top (whatever the baseline did)
            bounds = [at_grid_top(rep["repack"]) for rep in by_mode]
            grid = median_cell(summary["max_rate_at_target"]["values"], bounds, "×")
            interp = median_cell(summary["rate_at_target_interpolated"]["values"], bounds, "×")
            ratios.append(f"**{grid}**; interpolated {interp}")
        shape = f"{setup['input_len']} + {setup['output_len']}, {setup['num_prompts']}"
        slo = f"{num(r['slo']['ttft_ms'] / 1000)} s / {num(r['slo']['tpot_ms'])} ms"
        rows.append(
            f"| {policy} {budget} %, {scope} | {shape} | {setup['pool_blocks']} blocks | {slo} | "
            f"{' | '.join(cells)} | {' | '.join(ratios)} | [{experiment[:10]}](experiments/{experiment}) |\n"
        )
        sources.append(source_line(name, r))
    reps = {len(load(n, results)["repeats"]) for n, _ in SERVED}
    target = {load(n, results)["slo"]["attainment_target"] for n, _ in SERVED}
    assert len(reps) == 1 and len(target) == 1, (reps, target)
    intro = (
        f"SmolLM2-135M served by `vtoken serve` (Ray Serve, one replica, a fixed KV pool) under "
        f"`vllm bench serve` (Poisson arrivals); admission on for the evicting modes. Each cell: the highest "
        f"rate meeting both SLOs for ≥ {num(target.pop() * 100, 0)} % of requests, median (min–max) over "
        f"{reps.pop()} repeats in one command; ratios within each repeat, then median (min–max), on the grid "
        f'and interpolated. "≥": a lower bound (repack met the grid\'s top rate). How to read and reproduce '
        f"them: [serving.md](serving.md#served-path-benchmark--vtoken-bench-serve).\n\n"
    )
    return intro + head + "".join(rows), "".join(sources)


def yardstick_shares(report: dict) -> list[tuple[float, float, float]]:
    """``[(final share of context lost, budget, perplexity ratio)]`` of the yardstick's decode-only H2O points,
    by share (pure): the share is the point's evicted tokens per window over the window's context."""
    setup = report["setup"]
    context = setup["windows"] * (setup["prompt_tokens"] + setup["continuation_tokens"])
    out = []
    for p in report["points"]:
        st = p["settings"]
        if st["policy"] == "h2o" and st["scope"] == "generated" and st["trigger"] == "step":
            out.append((p["evicted_tokens"] / context, float(st["budget"]), p["perplexity_ratio"]))
    return sorted(out)


def paid(runs: list[dict]) -> tuple[int, int, float | None]:
    """``(requests finished, trimmed, mean share of context a trimmed request lost)`` over ``runs`` (pure)."""
    costs = [r["cost"] for r in runs if r.get("cost")]
    finished = sum(c["finished"] for c in costs)
    trimmed = sum(c["trimmed"] for c in costs)
    lost = sum(c["evicted_share_mean_trimmed"] * c["trimmed"] for c in costs if c["trimmed"])
    return finished, trimmed, (lost / trimmed if trimmed else None)


def pressure_rows(results: Path) -> tuple[str, str]:
    from vtoken.bench.served.measures import report_label

    yard = yardstick_shares(load(YARDSTICK, results))
    head = (
        "| server | max rate at ≥ 90 % (req/s) | ÷ stock vLLM | ÷ stock vLLM + admission | preemptions, all runs "
        "| requests trimmed | context lost per trimmed request | yardstick at that share ¹ |\n"
        "|---|---|---|---|---|---|---|---|\n"
    )
    rows, sources, notes = [], [], []
    for name, experiment in PRESSURE:
        r = load(name, results)
        setup, reps = r["setup"], r["repeats"]
        seeds = ", ".join(str(rep[0]["seed"]) for rep in reps)
        rows.append(
            f"| **{', '.join(str(x) for x in setup['rates'])} req/s offered, {setup['num_prompts']} requests each, "
            f"{setup['pool_blocks']}-block pool, "
            f"seed{'s' if len(reps) > 1 else ''} {seeds}** ([experiment](experiments/{experiment})) |" + " |" * 7 + "\n"
        )
        by_label = [{report_label(v): v for v in rep} for rep in reps]
        for lab in [report_label(v) for v in reps[0]]:
            vs = [rep[lab] for rep in by_label]
            rate = median_cell([v["max_rate_at_target"] for v in vs], [at_grid_top(v) for v in vs])
            missed = sum(v["max_rate_at_target"] is None for v in vs)
            if missed == len(vs):
                rate = f"none in {missed} of {missed}"
            elif missed:
                rate += f"; no rate in {missed} of {len(vs)}"
            ratios = []
            for base in ("none", "none +admission"):
                summary = r["summary"]["ratios"].get(f"{lab} / {base}")
                if summary is None or lab == base:
                    ratios.append("–")
                    continue
                if all(at_grid_top(v) and at_grid_top(rep[base]) for v, rep in zip(vs, by_label, strict=True)):
                    ratios.append("both at the grid's top")  # saturated: the grid bounds neither
                    continue
                vals = summary["max_rate_at_target"]["values"]
                ratios.append(median_cell(vals, [at_grid_top(v) for v in vs], "×"))
            runs = [run for v in vs for run in v["runs"]]
            pre = sum(run["preemptions"] or 0 for run in runs)
            finished, trimmed, lost = paid(runs)
            if not finished:
                rows.append(f"| {lab} | {rate} | {' | '.join(ratios)} | {pre} | – | – | – |\n")
                continue
            over = [p for p in yard if p[0] >= (lost or 0.0)]
            at = f"≤ ×{num(over[0][2], 3)} (budget {num(over[0][1])})" if lost is not None and over else "–"
            lost_cell = f"{pct(lost * 100)} %" if lost is not None else "–"
            rows.append(
                f"| {lab} | {rate} | {' | '.join(ratios)} | {pre} | {trimmed} of {finished} | {lost_cell} | {at} |\n"
            )
        notes.append(
            f"{setup['input_len']} + {setup['output_len']} tokens (lengths ±{num(setup['range_ratio'] * 100, 0)} %), "
            f"burstiness {num(setup['burstiness'])}, "
            f"SLOs {num(r['slo']['ttft_ms'] / 1000)} s / {num(r['slo']['tpot_ms'])} ms, "
            f"budget {num(float(setup['budget']) * 100, 0)} % decode-only (the fixed budget's, and pressure's floor)"
        )
        sources.append(source_line(name, r))
    shape = "; ".join(dict.fromkeys(notes))  # the reports share one workload and pool: said once
    intro = (
        "Eviction only when vLLM's pool cannot hold the next step (`trigger: pressure`) against the fixed budget "
        "and stock vLLM, on arrivals in bursts (gamma gaps): " + shape + "; each group of rows names its offered "
        "rates, the requests per rate, the pool and the workload seed of each repeat. Rates and "
        'ratios as above ("≥": the variant met the grid\'s top); the cost columns add up every run of the '
        "variant (`cost` in the JSON: the replica's cost histograms).\n\n"
    )
    foot = (
        "\n¹ The long-generation yardstick's decode-only H2O point ([longgen](results/longgen-smollm2-224.json)) "
        "whose final share of context lost is the smallest at or above the trimmed requests' mean: its perplexity "
        "ratio bounds theirs from above, as they lost that share later in their generation.\n"
    )
    return intro + head + "".join(rows) + foot, "".join(sources)


# -------------------------------------------------------------------------------------------- capacity


def capacity_rows(results: Path) -> tuple[str, str]:
    head = (
        "| model | policy, budget | KV pool | prompt + generated tokens | max feasible concurrency, naive → "
        "repack | burst tokens/s, naive → repack | burst goodput, naive → repack (req/s) |\n"
        "|---|---|---|---|---|---|---|\n"
    )
    rows, sources = [], []
    for name in CAPACITY:
        r = load(name, results)
        naive, repack, ratio = r["modes"]["naive"], r["modes"]["repack"], r["ratios_vs_naive"]["repack"]
        policy = f"{POLICY_NAMES.get(r['policy'], r['policy'])} {num(r['budget'] * 100, 0)} %"
        conc = (
            f"{naive['max_feasible_concurrency']} → **{repack['max_feasible_concurrency']}** "
            f"({num(ratio['max_feasible_concurrency'])}×)"
        )
        runs = [
            num(rp["throughput_tok_s"] / nv["throughput_tok_s"])
            for nv, rp in zip(naive["burst_runs"], repack["burst_runs"], strict=True)
        ]
        burst = (
            f"{num(naive['burst']['throughput_tok_s'], 1)} → {num(repack['burst']['throughput_tok_s'], 1)} "
            f"({num(ratio['throughput'])}×"
            + (f"; per interleaved run {', '.join(runs)}×" if len(runs) > 1 else "")
            + ")"
        )
        good = (
            f"{num(naive['burst']['goodput_req_s'], 3)} → {num(repack['burst']['goodput_req_s'], 3)} "
            f"({num(ratio['goodput'])}×)"
        )
        model = Path(r["model"]).name
        rows.append(
            f"| {MODEL_NAMES.get(model, model)} | {policy} | {r['kv_blocks']} blocks of "
            f"{r['block_size']} | {r['prompt_len']} + {r['gen_len']} | {conc} | {burst} | {good} |\n"
        )
        sources.append(source_line(name, r))
    intro = (
        "One in-process vLLM engine with a fixed KV pool, the mode switched per request "
        "([vllm-integration.md](vllm-integration.md#what-the-reclaimed-blocks-buy--vtoken-bench-capacity)): "
        "the most requests that run together without preemption, and a burst submitted at once (the lower "
        "median run of the interleaved runs).\n\n"
    )
    return intro + head + "".join(rows), "".join(sources)


# -------------------------------------------------------------------------------------------- retained


def retained_rows(results: Path) -> tuple[str, str]:
    head = (
        "| attention | requests, prompt + decode steps | policies | budgets | block sizes | "
        "repack vs Naive-Evict (retained blocks per request) | KV copies, repack ÷ reuse+repack |\n"
        "|---|---|---|---|---|---|---|\n"
    )
    rows, sources, paper = [], [], None
    for name in RETAINED:
        r = load(name, results)
        cells = r["rows"]
        gains = [c["repack_vs_naive_pct"] for c in cells]
        moves = [c["moves_repack"] / c["moves_reuse_repack"] for c in cells]
        source = (
            f"recorded from SmolLM2 (`{r['source']}`)"
            if str(r.get("source", "")).endswith(".npz")
            else "synthetic, calibrated to the recorded traces"
        )
        pols = ", ".join(dict.fromkeys(POLICY_NAMES.get(c["policy"], c["policy"]) for c in cells))
        budgets = " / ".join(dict.fromkeys(f"{num(c['budget'] * 100, 0)} %" for c in cells))
        blocks = " / ".join(dict.fromkeys(str(c["block_size"]) for c in cells))
        rows.append(
            f"| {source} | {r['requests']}, {r['prompt_len']} + {r['gen_len']} | {pols} | {budgets} | "
            f"{blocks} | **{pct(max(gains))} … {pct(min(gains))} %** | {num(min(moves))}–"
            f"{num(max(moves))}× |\n"
        )
        sources.append(source_line(name, r))
        paper = paper or r.get("paper_range_pct")
    intro = (
        "The trace-driven simulator ([simulator.md](simulator.md)): retained KV blocks per request against "
        "Naive-Evict with the same victims, averaged over decode steps"
        + (f"; the vToken paper reports {pct(paper[1])} … {pct(paper[0])} %" if paper else "")
        + ".\n\n"
    )
    env = (
        "The retained reports carry no `environment`: they are the pure-numpy simulator over recorded or "
        "synthetic attention, deterministic, with no engine or device in the figures; the machine that ran "
        "them is not recorded (both files were last regenerated in commit 4fd563a, 2026-11-29).\n"
    )
    return intro + head + "".join(rows), "".join(sources) + "\n" + env


# ----------------------------------------------------------------------------------------------- fleet


def fleet_rows(results: Path) -> tuple[str, str]:
    r = load(FLEET, results)
    need = r["replicas_needed"] if isinstance(r["replicas_needed"], list) else [r["replicas_needed"]]
    lines = []
    for n in need:
        naive, repack = n["naive"]["min_fixed_replicas_meeting_slo"], n["repack"]["min_fixed_replicas_meeting_slo"]
        lines.append(
            f"- Replicas needed for {num(n['rate_req_s'], 0)} req/s (load {num(n['load'])}) at "
            f"{num(n['slo_target'] * 100, 0)} % SLO attainment, fixed fleet, `kv` router: naive "
            f"**{naive}**, repack **{repack}** ({num(naive / repack, 1)}× fewer).\n"
        )
    runs = {(x["mode"], x["router"], x["load"]): x for x in r["runs"]}
    for load_ in sorted({x["load"] for x in r["runs"]}):
        a, b = runs.get(("naive", "kv", load_)), runs.get(("repack", "kv", load_))
        if a and b and load_ == 1.0:
            lines.append(
                f"- At the naive fleet's nominal capacity (load {num(load_)}, {num(a['rate_req_s'], 0)} "
                f"req/s), `kv` router: SLO attainment naive {num(a['slo_attainment'], 3)}, repack "
                f"**{num(b['slo_attainment'], 3)}**; goodput {num(a['goodput_req_s'], 1)} against "
                f"**{num(b['goodput_req_s'], 1)}** req/s.\n"
            )
    slo = r["slo"]
    intro = (
        f"A discrete-event simulation of {r['replicas']} replicas running the project's router and autoscaler "
        f"code ([fleet.md](fleet.md)); engine step times measured on this machine; SLO TTFT ≤ "
        f"{num(slo['ttft_s'])} s, TPOT ≤ {num(slo['tpot_s'])} s.\n\n"
    )
    return intro + "".join(lines), source_line(FLEET, r)


# ---------------------------------------------------------------------------------------------- render


def quality_rows(results: Path) -> tuple[str, str]:
    from vtoken.bench.quality.longgen.tables import ruler_table, task_table, text_table

    longgen = [load(n, results) for n in LONGGEN]
    codegen = [load(n, results) for n in CODEGEN]
    ruler = load(RULER, results)
    body = (
        "Judged by the parity rule stated before measuring ([quality.md](quality.md#the-parity-rule-and-the-"
        "long-generation-yardstick-vtoken-bench-longgen)): a setting is at parity when the text half and, on "
        "every task, the task half hold.\n\n### Text: human-written continuations, eviction after every "
        "token\n\n"
        + text_table(longgen)
        + "\n### Tasks: HumanEval, code the model writes\n\n"
        + task_table(codegen)
        + "\n### Tasks: RULER at 1k and 2k tokens on the model that uses its context"
        "\n\n" + ruler_table(ruler)
    )
    sources = "".join(source_line(n, r) for n, r in zip([*LONGGEN, *CODEGEN, RULER], [*longgen, *codegen, ruler]))
    return body, sources


def render(results: Path = ROOT / "docs/results") -> str:
    """docs/results.md's text from the reports under ``results``."""
    parts = [
        "# Current results\n\n",
        "<!-- Generated by scripts/results_doc.py from docs/results/*.json; edit the script, not this file -->\n\n",
        "The figures vToken stands on today, each read from its JSON under [results/](results/) with the command "
        "that wrote it (the report's `command`; `--out` names where it was first written). How each benchmark "
        "works and what its variants mean: [serving.md](serving.md), [vllm-integration.md](vllm-integration.md), "
        "[simulator.md](simulator.md), [fleet.md](fleet.md). How each figure came about, stated before "
        "measuring: [experiments/](experiments/README.md).\n\n",
    ]
    for title, (body, sources) in (
        ("Quality: what eviction costs, against the full cache", quality_rows(results)),
        ("Served: SLO-constrained request rate", served_rows(results)),
        ("Served when memory is short: bursts, evicting only under pressure", pressure_rows(results)),
        ("Capacity in the engine: `vtoken bench capacity`", capacity_rows(results)),
        ("Retained blocks: `vtoken bench retained`", retained_rows(results)),
        ("A fleet on paper: `vtoken bench fleet`", fleet_rows(results)),
    ):
        parts += [f"## {title}\n\n", body, "\nReports and commands:\n\n", sources, "\n"]
    return "".join(parts).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/results.md is stale")
    args = ap.parse_args(argv)
    path = ROOT / DOC
    existing = path.read_text() if path.exists() else None
    text = render()
    if args.check:
        if text != existing:
            print(f"{DOC} is stale: run python scripts/results_doc.py", file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
