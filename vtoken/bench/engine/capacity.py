"""``vtoken bench capacity``: what the reclaimed blocks buy — max feasible concurrency and SLA goodput.

One in-process vLLM engine with a deliberately fixed KV pool (``--kv-blocks``), vToken hooks on, and the
reclamation mode switched per request (``extra_args``), so every mode sees the same pool, model, policy,
prompts and scheduler limits. ``max_num_batched_tokens = max(prompt_len, 256)``: with prompts of 256
tokens or more, one prompt is prefilled per step, so requests are admitted one by one as blocks become
free (vLLM's own admission rule).

Two measurements per mode:

* **max feasible concurrency** — the largest K such that K requests submitted together are all running
  at the same step and all finish with zero preemptions. Found by doubling then bisection (K probes stop
  at the first preemption). Assumes feasibility is monotone in K, as it is for identical requests.
* **burst goodput** — ``--requests`` requests submitted at t=0 (arrival = submission), ``--repeats``
  times per mode, modes interleaved; ``burst`` is the run with the *lower median* goodput (a real run, so
  its fields agree; with 2 runs the worse one, with 3 the middle one; ``burst_selection`` says so and
  every run is kept in ``burst_runs``). Per request TTFT
  (first token − arrival) and TPOT ((finish − first token) / (tokens − 1)) against ``--ttft-slo`` /
  ``--tpot-slo``. Reports wall time, throughput (generated tokens/s), SLA attainment, goodput (requests
  meeting both SLOs per second), peak / mean running requests, preemptions.

Ratios are taken against the paired ``naive`` run of the same process (``*_vs_naive``). Prints JSON with
the command that produced it; progress on stderr. ``kv_cache_groups`` lists vLLM's KV cache groups: on a hybrid
model (sliding-window + global layers) the pool is shared by all of them and vToken evicts from the global group
only, so the concurrency a mode reaches is of the whole pool, the sliding-window blocks included.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from vtoken.bench.report import command_line, emit
from vtoken.bench.settings import EVICTING
from vtoken.core.config import VTokenConfig
from vtoken.vllm.offline.launch import scheduler_of, vllm_logs_to_stderr

MODES = ("naive", "repack", "reuse+repack")
# the engine's config, declared once: every token may be evicted (scope all), as in every report; the mode is
# set per request (``--modes``), so ``mode`` is the bench's own (``settings.configure``)
BASE = EVICTING
OWN = {"mode": "--modes picks the modes, one per request"}


@dataclass(frozen=True)
class CapacitySetup:
    """What every probe shares (the engine is built from it once, with ``vtoken``'s settings)."""

    model: str
    kv_blocks: int
    prompt_len: int
    gen_len: int
    vtoken: VTokenConfig = BASE
    max_seqs: int = 256
    tensor_parallel_size: int = 1  # > 1: vLLM's multiprocess executor, one core per rank on CPU

    def to_report(self) -> dict:
        """The report's setup fields (flat, as every capacity report has them)."""
        cfg = self.vtoken
        return {
            "model": self.model,
            "policy": cfg.policy,
            "budget": cfg.budget.to_json(),
            "block_size": cfg.block_size,
            "kv_blocks": self.kv_blocks,
            "prompt_len": self.prompt_len,
            "gen_len": self.gen_len,
            "sinks": cfg.sinks,
            "recent": cfg.recent,
            "max_seqs": self.max_seqs,
            "tensor_parallel_size": self.tensor_parallel_size,
        }


SETUP_KEYS = (
    "model",
    "policy",
    "budget",
    "block_size",
    "kv_blocks",
    "prompt_len",
    "gen_len",
    "sinks",
    "recent",
    "max_seqs",
    "tensor_parallel_size",
)
# the top-level keys ``run_capacity`` returns (``report.emit`` adds ``environment``); tests/integration/test_bench.py
# holds the builder and the committed capacity-*.json to them
REPORT_KEYS = frozenset(
    {"bench", "command", *SETUP_KEYS, "requests", "repeats", "slo", "kv_cache_groups", "modes", "ratios_vs_naive"}
)


@dataclass(frozen=True)
class Outcome:
    """One batch of requests run to completion (or stopped at the first preemption)."""

    requests: int
    finished: int
    peak_running: int
    mean_running: float
    preemptions: int
    wall_s: float
    generated_tokens: int
    ttft_s: tuple[float, ...]
    tpot_s: tuple[float, ...]

    @property
    def feasible(self) -> bool:
        """All requests ran at the same step and none was preempted."""
        return self.preemptions == 0 and self.peak_running == self.requests == self.finished


def build_engine(setup: CapacitySetup):
    """An in-process ``LLM`` with the fixed pool. Side effect: starts an engine (free with ``close``)."""
    from vllm import LLM

    from vtoken.vllm import engine_kwargs
    from vtoken.vllm.offline.launch import scoped_env, tp_engine_kwargs

    cfg = setup.vtoken
    tp_kw, tp_env = tp_engine_kwargs(setup.tensor_parallel_size)
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", **tp_env}
    with scoped_env(**env):
        return LLM(
            model=setup.model,
            dtype="float32",
            enforce_eager=True,
            seed=0,
            max_model_len=setup.prompt_len + setup.gen_len + cfg.block_size,
            num_gpu_blocks_override=setup.kv_blocks,
            max_num_seqs=setup.max_seqs,
            max_num_batched_tokens=max(setup.prompt_len, 256),
            enable_prefix_caching=False,
            enable_chunked_prefill=True,
            **tp_kw,
            **engine_kwargs(cfg),
        )


def kv_cache_groups(llm) -> list[dict]:
    """The engine's KV cache groups (``vtoken.vllm.supported_configs.describe_groups``)."""
    from vtoken.vllm.supported_configs import describe_groups

    return describe_groups(scheduler_of(llm).kv_cache_config.kv_cache_groups)


def close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()


def run_batch(llm, setup: CapacitySetup, mode: str, count: int, tag: str, stop_on_preemption: bool) -> Outcome:
    """Submit ``count`` requests at once in ``mode`` and step the engine until they finish (or, with
    ``stop_on_preemption``, until the first preemption; the rest are aborted)."""
    from vllm import SamplingParams

    eng = llm.llm_engine
    sched = scheduler_of(llm)
    rng = np.random.default_rng(1234)  # the same prompts for every mode
    vocab = min(eng.vllm_config.model_config.get_vocab_size(), 30_000)
    params = SamplingParams(
        max_tokens=setup.gen_len, temperature=0.0, ignore_eos=True, extra_args={"vtoken": {"mode": mode}}
    )
    ids = [f"{tag}-{i}" for i in range(count)]
    preempted_before = sched.vtoken_stats().counters.preemptions
    t0 = time.perf_counter()
    for rid in ids:
        eng.add_request(rid, {"prompt_token_ids": rng.integers(3, vocab, setup.prompt_len).tolist()}, params)
    first: dict[str, float] = {}
    done: dict[str, tuple[float, int]] = {}
    running: list[int] = []
    preemptions = 0
    while eng.has_unfinished_requests():
        outputs = eng.step()
        now = time.perf_counter()
        running.append(len(sched.running))
        for out in outputs:
            n = len(out.outputs[0].token_ids)
            if n and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                done[out.request_id] = (now, n)
        preemptions = sched.vtoken_stats().counters.preemptions - preempted_before
        if preemptions and stop_on_preemption:
            eng.abort_request([r for r in ids if r not in done])
            while eng.has_unfinished_requests():
                eng.step()
            break
    wall = time.perf_counter() - t0
    ttft = tuple(first[r] - t0 for r in ids if r in done)
    tpot = tuple((done[r][0] - first[r]) / max(done[r][1] - 1, 1) for r in ids if r in done)
    return Outcome(
        requests=count,
        finished=len(done),
        peak_running=max(running, default=0),
        mean_running=statistics.fmean(running) if running else 0.0,
        preemptions=preemptions,
        wall_s=wall,
        generated_tokens=sum(n for _, n in done.values()),
        ttft_s=ttft,
        tpot_s=tpot,
    )


def max_feasible_concurrency(llm, setup: CapacitySetup, mode: str, on_probe=None) -> tuple[int, list[dict]]:
    """Largest feasible K (doubling, then bisection); returns it and every probe made."""
    probes: list[dict] = []

    def feasible(k: int) -> bool:
        out = run_batch(llm, setup, mode, k, f"cap-{mode}-{k}", stop_on_preemption=True)
        probes.append(
            {"k": k, "feasible": out.feasible, "peak_running": out.peak_running, "preemptions": out.preemptions}
        )
        if on_probe is not None:
            on_probe(mode, k, out.feasible)
        return out.feasible

    lo, hi = 0, 1
    while hi <= setup.max_seqs and feasible(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, setup.max_seqs + 1)
    while hi - lo > 1:  # lo feasible (or 0), hi infeasible
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if feasible(mid) else (lo, mid)
    return lo, probes


def goodput_row(out: Outcome, ttft_slo: float, tpot_slo: float) -> dict:
    met = sum(1 for a, b in zip(out.ttft_s, out.tpot_s, strict=True) if a <= ttft_slo and b <= tpot_slo)
    return {
        "requests": out.requests,
        "finished": out.finished,
        "wall_s": round(out.wall_s, 3),
        "throughput_tok_s": round(out.generated_tokens / out.wall_s, 2),
        "sla_attainment": round(met / max(out.requests, 1), 4),
        "goodput_req_s": round(met / out.wall_s, 4),
        "ttft_p50_s": round(float(np.percentile(out.ttft_s, 50)), 3) if out.ttft_s else None,
        "ttft_p90_s": round(float(np.percentile(out.ttft_s, 90)), 3) if out.ttft_s else None,
        "tpot_p50_s": round(float(np.percentile(out.tpot_s, 50)), 4) if out.tpot_s else None,
        "peak_running": out.peak_running,
        "mean_running": round(out.mean_running, 2),
        "preemptions": out.preemptions,
        "ttft_s": [round(x, 3) for x in out.ttft_s],  # per request, so other SLOs can be checked later
        "tpot_s": [round(x, 4) for x in out.tpot_s],
    }


def run_capacity(
    setup: CapacitySetup, modes: tuple[str, ...], requests: int, ttft_slo: float, tpot_slo: float, repeats: int = 3
) -> dict:
    """Both measurements for every mode on one engine; returns the JSON-able report (``REPORT_KEYS``)."""
    from rich.progress import Progress

    report: dict = {
        "bench": "capacity",
        "command": command_line(),
        **setup.to_report(),
        "requests": requests,
        "repeats": repeats,
        "slo": {"ttft_s": ttft_slo, "tpot_s": tpot_slo},
        "modes": {},
    }
    llm = build_engine(setup)
    try:
        report["kv_cache_groups"] = kv_cache_groups(llm)
        with Progress(transient=True, redirect_stdout=False) as bar:
            task = bar.add_task("capacity", total=None)
            run_batch(llm, setup, modes[0], 2, "warm", stop_on_preemption=False)

            def on_probe(mode: str, k: int, ok: bool) -> None:
                bar.update(task, description=f"{mode}: K={k} {'fits' if ok else 'does not fit'}")

            for mode in modes:
                k, probes = max_feasible_concurrency(llm, setup, mode, on_probe)
                report["modes"][mode] = {
                    "max_feasible_concurrency": k,
                    "capped_at_max_seqs": k == setup.max_seqs,
                    "probes": probes,
                    "burst_runs": [],
                }
            for r in range(repeats):  # modes interleaved, so bursts of machine noise hit them evenly
                for mode in modes:
                    bar.update(task, description=f"{mode}: burst of {requests} (run {r + 1}/{repeats})")
                    out = run_batch(llm, setup, mode, requests, f"burst-{mode}-{r}", stop_on_preemption=False)
                    report["modes"][mode]["burst_runs"].append(goodput_row(out, ttft_slo, tpot_slo))
    finally:
        close(llm)
    for row in report["modes"].values():
        row["burst"] = lower_median_run(row["burst_runs"])
        row["burst_selection"] = f"lower median goodput of {len(row['burst_runs'])} run(s)"
    report["ratios_vs_naive"] = ratios(report["modes"])
    return report


def lower_median_run(runs: list[dict]) -> dict:
    """The run with the lower median goodput: the middle one of an odd count, the lower of the two middle
    ones of an even count (a real run, so its fields stay consistent with each other)."""
    return sorted(runs, key=lambda r: (r["goodput_req_s"], r["throughput_tok_s"]))[(len(runs) - 1) // 2]


def ratios(modes: dict) -> dict:
    """``mode → {concurrency, throughput, goodput}`` divided by naive's (None where naive's is 0)."""
    if "naive" not in modes:
        return {}
    base = modes["naive"]

    def ratio(a: float, b: float) -> float | None:
        return round(a / b, 3) if b else None

    return {
        m: {
            "max_feasible_concurrency": ratio(v["max_feasible_concurrency"], base["max_feasible_concurrency"]),
            "throughput": ratio(v["burst"]["throughput_tok_s"], base["burst"]["throughput_tok_s"]),
            "goodput": ratio(v["burst"]["goodput_req_s"], base["burst"]["goodput_req_s"]),
        }
        for m, v in modes.items()
        if m != "naive"
    }


def main(
    setup: CapacitySetup,
    modes: tuple[str, ...],
    requests: int,
    ttft_slo: float,
    tpot_slo: float,
    repeats: int,
    out: str | None,
) -> dict:
    vllm_logs_to_stderr()
    report = run_capacity(setup, modes, requests, ttft_slo, tpot_slo, repeats)
    emit(report, out)
    return report
