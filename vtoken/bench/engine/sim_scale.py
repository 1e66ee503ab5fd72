"""Simulator throughput at scale (10,000 requests × 8,192 tokens by default)."""

from __future__ import annotations

import os
import platform
import shlex
import sys
from dataclasses import replace

from vtoken.bench.report import emit
from vtoken.sim.run import SimConfig, run_simulation

# the simulated config, declared once: the simulator's default (``SimConfig``) at the engine's block size; every
# mode runs, so ``mode`` is the bench's own (``settings.configure``)
BASE = replace(SimConfig().vtoken, block_size=32)
OWN = {"mode": "every mode runs"}
# the top-level keys of the report ``run_sim_scale`` emits (``report.emit`` adds ``environment``); ``result``
# is ``run_simulation``'s (``vtoken.sim.run.RESULT_KEYS``)
REPORT_KEYS = frozenset(
    {
        "bench",
        "command",
        "tokens_per_request",
        "request_steps",
        "seconds",
        "request_steps_per_second",
        "machine",
        "result",
    }
)


def run_sim_scale(cfg: SimConfig, out: str | None) -> dict:
    """Run ``cfg`` with a progress bar; emits and returns the report (``REPORT_KEYS``)."""
    from rich.progress import BarColumn, Progress, TimeElapsedColumn, TimeRemainingColumn

    requests, gen_len = cfg.requests, cfg.gen_len
    with Progress(
        "{task.description}",
        BarColumn(),
        "{task.completed}/{task.total}",
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        transient=True,
        console=None,
    ) as bar:
        task = bar.add_task("requests", total=requests)
        result, _ = run_simulation(cfg, on_requests=lambda n: bar.advance(task, n))
    report = {
        "bench": "sim-scale",
        "command": "vtoken bench sim-scale " + shlex.join(sys.argv[3:]) if len(sys.argv) > 2 else None,
        "tokens_per_request": cfg.prompt_len + gen_len,
        "request_steps": requests * gen_len,
        "seconds": result["seconds"],
        "request_steps_per_second": round(requests * gen_len / result["seconds"], 1),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "processor": platform.machine()},
        "result": result,
    }
    emit(report, out)
    return report
