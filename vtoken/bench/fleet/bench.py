"""``vtoken bench fleet``: N replicas on paper — routers × modes × load, replicas needed, routing cost.

What is measured and what is assumed (also written into the JSON's ``assumptions``):

* per-step service times: measured engine steps of a real vLLM + vToken engine on this machine
  (``fleet.steps``; ``--measure-steps`` re-measures), fitted linearly, times ``--time-scale``;
* per-request KV: each request class's blocks at every decode step from vToken's core (``vtoken.sim``)
  under the policy, budget and mode — naive frees only whole evicted blocks, repack packs live tokens;
* routing: the project's KV-aware ranking and Serve's/llm-d's alternatives (``fleet.model``), on stats
  polled every second; autoscaling: the project's ``decide`` (``fleet.sim``);
* load: Poisson arrivals of ``WORKLOAD``'s classes at fractions of the fleet's nominal capacity in naive
  mode (``capacity``), so both modes see the same absolute rates.

Side effects: may measure engine steps (loads a model) when the steps file is missing; prints progress
on stderr; ``--plot`` writes a PNG.
"""

from __future__ import annotations

import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from vtoken.bench.fleet.model import MODES, ROUTERS, WORKLOAD, KVAware, kv_profiles, make_router
from vtoken.bench.fleet.sim import FleetSpec, View, simulate
from vtoken.bench.fleet.steps import StepModel, load_steps, measure_steps
from vtoken.core.config import VTokenConfig
from vtoken.serve.control.autoscaling import ScalingParams
from vtoken.serve.telemetry.sla import SloTargets
from vtoken.serve.telemetry.stat_logger import routing_stats

DECISION_SIZES = (64, 128, 256, 512, 1024)
# the top-level keys ``run_fleet`` returns (``report.emit`` adds ``environment``), and those of each mode's
# ``replicas_needed[mode]["autoscaler"]`` (``replicas_needed``)
REPORT_KEYS = frozenset(
    {
        "bench",
        "command",
        "replicas",
        "loads",
        "routers",
        "modes",
        "duration_s",
        "warmup_s",
        "replica",
        "workload",
        "kv_per_request_blocks_mean",
        "service_times",
        "slo",
        "capacity_per_replica",
        "base_rate_req_s",
        "project_code",
        "assumptions",
        "runs",
        "replicas_needed",
        "decision_cost_us",
        "seconds",
    }
)
AUTOSCALER_KEYS = frozenset(
    {
        "replicas_at_end_of_arrivals",
        "replicas_mean",
        "slo_attainment",
        "goodput_req_s",
        "mean_kv_utilization",
        "replicas_trace_1s",
    }
)
SLO_TARGET = 0.99  # share of requests meeting the SLO that "replicas needed" asks for (as the alerts')
ASSUMPTIONS = [
    "service times: measured engine steps on this machine (see service_times), fitted as "
    "base + per_seq·decoding + per_token·prefilled, times time_scale; one step model for every replica",
    "KV per request: vToken's core (vtoken.sim, synthetic attention) under policy/budget/mode, mean of each class",
    "replicas: FIFO admission while a sequence slot and the prompt's blocks (+1) are free; prefill "
    "batched into decode steps; pool overflow preempts the newest request (recompute)",
    "routers see stats polled every stats_period_s and live queue lengths; no network or proxy cost",
    "autoscaling: vtoken.serve.control.autoscaling.decide every 1 s on 5 s means, Serve's delays, "
    "replicas serve startup_s after being requested (measured ≈30 s for a tiny-model replica here)",
]


def capacity(step: StepModel, profiles, classes, pool_blocks: int, max_seqs: int) -> dict:
    """Nominal requests/s of one replica (pure): the concurrency its pool holds at the classes' mean
    blocks over a request's life (≤ max_seqs), over the time a request takes at that batch size."""
    w = np.array([c.weight for c in classes]) / sum(c.weight for c in classes)
    mean_blocks = float(sum(wi * float(np.mean(p.held)) for wi, p in zip(w, profiles, strict=True)))
    batch = max(1, min(max_seqs, int(0.9 * pool_blocks / mean_blocks)))
    service = float(
        sum(
            wi * (c.gen * step.seconds(batch) + step.seconds(0, c.prompt) - step.seconds(0))
            for wi, c in zip(w, classes)
        )
    )
    return {"batch": batch, "mean_blocks": round(mean_blocks, 2), "req_s": round(batch / service, 4)}


def decision_cost(sizes=DECISION_SIZES, repeats: int = 200, seed: int = 0) -> dict:
    """µs per routing decision of each router at each fleet size (random stats and queues)."""
    from vtoken.core.reporting.engine_kv import KVSnapshot

    rng = np.random.default_rng(seed)
    out = {}
    for n in sizes:
        view, now = View(n), 1000.0
        view.queue[:] = rng.integers(0, 8, n)
        for r, h in enumerate(rng.integers(0, 128, n)):
            snap = KVSnapshot(
                live_tokens=int(h) * 24, held_blocks=int(h), pool_blocks=128, num_running=int(view.queue[r]), at=now
            )
            view.set_stats(r, routing_stats(snap, now))
        candidates = np.arange(n)
        out[str(n)] = {}
        for name in ROUTERS:
            router = make_router(name, seed, memo=False)
            t0 = time.perf_counter()
            for _ in range(repeats):
                router.choose(view, candidates, now)
            out[str(n)][name] = round(1e6 * (time.perf_counter() - t0) / repeats, 2)
    return out


def replicas_needed(spec: FleetSpec, rate: float, slo_target: float, echo) -> dict:
    """At ``rate``: the smallest fixed fleet (≤ 2 · ``spec.replicas``) meeting ``slo_target`` with the KV
    router (bisection to 1/32 of the fleet; None if even the largest misses), and where the project's
    autoscaler settles (allowed up to 2 · ``spec.replicas``) starting from a quarter of the fleet."""
    lo, hi, probes = 0, 2 * spec.replicas, {}
    top = simulate(replace(spec, replicas=hi), KVAware(spec.seed), rate)
    probes[hi] = top["slo_attainment"]
    if top["slo_attainment"] < slo_target:
        hi = None
    while hi is not None and hi - lo > max(1, spec.replicas // 32):
        mid = (lo + hi) // 2
        run = simulate(replace(spec, replicas=mid), KVAware(spec.seed), rate)
        probes[mid] = run["slo_attainment"]
        echo(f"  {mid} replicas: SLO {run['slo_attainment']:.3f}")
        lo, hi = (lo, mid) if run["slo_attainment"] >= slo_target else (mid, hi)
    auto = replace(
        spec,
        replicas=2 * spec.replicas,
        autoscale=ScalingParams(),
        initial_replicas=max(1, spec.replicas // 4),
        duration_s=max(spec.duration_s, 300.0),
        warmup_s=max(spec.warmup_s, 240.0),
    )
    run = simulate(auto, KVAware(spec.seed), rate)
    trace = run["replicas_trace_1s"]
    return {
        "min_fixed_replicas_meeting_slo": hi,
        "slo_probes": {str(k): v for k, v in sorted(probes.items())},
        "autoscaler": {
            "replicas_at_end_of_arrivals": trace[int(auto.duration_s) - 1],
            **{
                k: run[k]
                for k in (
                    "replicas_mean",
                    "slo_attainment",
                    "goodput_req_s",
                    "mean_kv_utilization",
                    "replicas_trace_1s",
                )
            },
        },
    }


def run_fleet(
    replicas: int,
    loads: list[float],
    routers: list[str],
    modes: list[str],
    duration: float,
    warmup: float,
    pool_blocks: int,
    max_seqs: int,
    vtoken: VTokenConfig,
    steps_file: Path,
    measure: bool,
    steps_model: str,
    time_scale: float,
    target_load: float,
    slo: SloTargets,
    decision_sizes=DECISION_SIZES,
    echo=print,
) -> dict:
    """Every experiment of the module docstring, the replicas running ``vtoken``'s settings (its seed seeds the
    routers and the simulation too); returns the report (JSON-able): ``REPORT_KEYS``."""
    started = time.perf_counter()
    block_size, seed = vtoken.block_size, vtoken.seed
    if measure or not steps_file.exists():
        echo(f"measuring engine steps ({steps_model}) → {steps_file}")
        import json

        steps_file.parent.mkdir(parents=True, exist_ok=True)
        measured = measure_steps(steps_model, vtoken)
        steps_file.write_text(json.dumps(measured, indent=2) + "\n")
    step, steps_report = load_steps(steps_file, time_scale)
    profiles = kv_profiles(WORKLOAD, vtoken)
    caps = {m: capacity(step, profiles[m], WORKLOAD, pool_blocks, max_seqs) for m in MODES}
    base_rate = caps["naive"]["req_s"] * replicas
    spec = {
        m: FleetSpec(
            replicas,
            pool_blocks,
            max_seqs,
            block_size,
            step,
            WORKLOAD,
            profiles[m],
            slo,
            duration_s=duration,
            warmup_s=warmup,
            seed=seed,
        )
        for m in modes
    }
    runs = []
    for mode in modes:
        for router in routers:
            for load in loads:
                run = simulate(spec[mode], make_router(router, seed), load * base_rate)
                runs.append({"mode": mode, "load": load, **run})
                echo(
                    f"{mode:7} {router:12} load {load:4.2f}: SLO {run['slo_attainment']:.3f}, goodput "
                    f"{run['goodput_req_s']:8.1f}/s, ttft p99 {run['ttft_p99_s']}, {run['decision_us']} µs"
                )
    needed = {}
    for mode in modes:
        echo(f"{mode}: replicas needed at load {target_load}")
        needed[mode] = replicas_needed(spec[mode], target_load * base_rate, SLO_TARGET, echo)
    w = {c: round(c.weight, 3) for c in WORKLOAD}
    return {
        "bench": "fleet",
        "command": "vtoken " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "replicas": replicas,
        "loads": loads,
        "routers": routers,
        "modes": modes,
        "duration_s": duration,
        "warmup_s": warmup,
        "replica": {
            "pool_blocks": pool_blocks,
            "max_num_seqs": max_seqs,
            "block_size": block_size,
            "policy": vtoken.policy,
            "budget": vtoken.budget.to_json(),
        },
        "workload": [{"prompt": c.prompt, "gen": c.gen, "share": w[c]} for c in WORKLOAD],
        "kv_per_request_blocks_mean": {m: [round(float(np.mean(p.held)), 2) for p in profiles[m]] for m in MODES},
        "service_times": {
            "source": "measured engine steps on this machine",
            "file": str(steps_file),
            "model": steps_report["model"],
            "fit": steps_report["fit"],
            "decode_step_ms": steps_report["decode_step_ms"],
            "prefill_step_ms": steps_report["prefill_step_ms"],
            "time_scale": time_scale,
            "measured_on": steps_report.get("environment"),
        },
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "capacity_per_replica": caps,
        "base_rate_req_s": round(base_rate, 2),
        "project_code": {
            "kv_router": "vtoken.serve.control.ranking.effective_free_tokens + rank_by_kv",
            "autoscaler": "vtoken.serve.control.autoscaling.decide",
            "stats": "vtoken.serve.telemetry.stat_logger.routing_stats",
            "slo": "vtoken.serve.telemetry.sla.meets_slo",
            "kv": "vtoken.sim.run_simulation",
        },
        "assumptions": ASSUMPTIONS,
        "runs": runs,
        "replicas_needed": {
            "load": target_load,
            "rate_req_s": round(target_load * base_rate, 2),
            "slo_target": SLO_TARGET,
            **needed,
        },
        "decision_cost_us": decision_cost(decision_sizes, seed=seed),
        "seconds": round(time.perf_counter() - started, 1),
    }


def plot(report: dict, path: str) -> None:
    """Four panels: SLO attainment and goodput vs load, decision cost vs N, replicas needed (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 4, figsize=(20, 4.5))
    for mode, style in zip(report["modes"], ("--", "-")):
        for router in report["routers"]:
            rs = [r for r in report["runs"] if r["mode"] == mode and r["router"] == router]
            x = [r["load"] for r in rs]
            ax[0].plot(x, [r["slo_attainment"] for r in rs], style, marker="o", label=f"{router} {mode}")
            ax[1].plot(x, [r["goodput_req_s"] for r in rs], style, marker="o", label=f"{router} {mode}")
    ax[0].set(title=f"SLO attainment, {report['replicas']} replicas", xlabel="load (× naive capacity)")
    ax[1].set(title="goodput (req/s meeting the SLO)", xlabel="load (× naive capacity)")
    sizes = [int(n) for n in report["decision_cost_us"]]
    for router in report["routers"]:
        cost = [report["decision_cost_us"][str(n)][router] for n in sizes]
        ax[2].loglog(sizes, cost, marker="o", label=router)
    ax[2].set(title="router decision cost", xlabel="replicas", ylabel="µs / request")
    need = report["replicas_needed"]
    modes = report["modes"]
    ax[3].bar([f"{m}\nfixed" for m in modes], [need[m]["min_fixed_replicas_meeting_slo"] or 0 for m in modes])
    ax[3].bar([f"{m}\nautoscaled" for m in modes], [need[m]["autoscaler"]["replicas_mean"] for m in modes])
    ax[3].set(title=f"replicas for {need['rate_req_s']} req/s (load {need['load']})")
    for a in ax[:3]:
        a.legend(fontsize=7)
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summary(report: dict) -> str:
    """A short text table of the runs (for stderr when --json is not given)."""
    lines = [f"{'mode':7} {'router':12} {'load':>5} {'SLO':>6} {'goodput':>8} {'µs/dec':>7}"]
    for r in report["runs"]:
        lines.append(
            f"{r['mode']:7} {r['router']:12} {r['load']:5.2f} {r['slo_attainment']:6.3f} "
            f"{r['goodput_req_s']:8.1f} {r['decision_us']:7.1f}"
        )
    return "\n".join(lines)
