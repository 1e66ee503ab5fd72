"""Retained-block grid: the paper's claim (−27.2…−72.3% blocks vs Naive-Evict) reproduced per cell."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import typer

from vtoken.bench.report import emit, refuse
from vtoken.errors import ConfigError

PAPER_RANGE_PCT = (-72.3, -27.2)
# the top-level keys of the report ``run_retained`` emits (``report.emit`` adds ``environment``)
REPORT_KEYS = frozenset({"bench", "command", "source", "prompt_len", "gen_len", "requests", "sinks",
                         "recent", "paper_range_pct", "rows"})


def run_retained(policies: str, budgets: str, block_sizes: str, prompt_len: int, gen_len: int, requests: int,
                 traces: str | None, sinks: int, recent: int, markdown: bool, out: str | None = None) -> list[dict]:
    from rich.progress import Progress

    from vtoken.sim.run import SimConfig, run_simulation

    try:
        grid = [(p.strip(), b.strip(), int(bs)) for p in policies.split(",") for b in budgets.split(",")
                for bs in block_sizes.split(",")]
        cfgs = [SimConfig.of(policy=p, budget=b, block_size=bs, prompt_len=prompt_len, gen_len=gen_len,
                             requests=requests, traces=Path(traces) if traces else None, sinks=sinks, recent=recent)
                for p, b, bs in grid]
    except (ConfigError, ValueError) as err:
        refuse(err)
    rows = []
    with Progress(transient=True) as bar:
        task = bar.add_task("grid", total=len(cfgs))
        for cfg in cfgs:
            result, _ = run_simulation(cfg)
            m = result["modes"]
            rows.append({
                "policy": cfg.vtoken.policy, "budget": result["budget"], "block_size": cfg.vtoken.block_size,
                "none": m["none"]["retained_blocks_mean"], "naive": m["naive"]["retained_blocks_mean"],
                "repack": m["repack"]["retained_blocks_mean"], "packing_bound": result["packing_bound_mean"],
                "repack_vs_naive_pct": m["repack"]["vs_naive_pct"],
                "moves_repack": m["repack"]["moves_total"], "moves_reuse_repack": m["reuse+repack"]["moves_total"],
            })
            bar.advance(task)
    report = {"bench": "retained", "command": "vtoken " + shlex.join(sys.argv[1:]),
              "source": traces or "synthetic", "prompt_len": prompt_len, "gen_len": gen_len,
              "requests": requests, "sinks": sinks, "recent": recent, "paper_range_pct": PAPER_RANGE_PCT,
              "rows": rows}
    emit(report, out)
    if markdown:
        typer.echo("\n| policy | budget | B | none | naive | repack (= ⌈live/B⌉) | repack vs naive | moves repack / reuse+repack |")
        typer.echo("|---|---|---|---|---|---|---|---|")
        for r in rows:
            typer.echo(f"| {r['policy']} | {r['budget']} | {r['block_size']} | {r['none']:.2f} | {r['naive']:.2f} | "
                       f"{r['repack']:.2f} | {r['repack_vs_naive_pct']:+.1f}% | {r['moves_repack']} / "
                       f"{r['moves_reuse_repack']} |")
    return rows
