"""``vtoken bench serve``: the served path, measured with vLLM's own load generator.

Per variant (a reclamation mode and, for evicting modes, a policy) one ``vtoken serve`` process (Ray Serve,
one replica, the OpenAI routes, a fixed KV pool of ``pool_blocks``), then per request rate one
``vllm bench serve`` run (Poisson arrivals, ``--goodput`` at the stated SLOs, results saved as JSON)::

    repeat N times (--repeats): all variants in one command; ratios per repeat, medians (summary.py)
    for variant in modes × policies × triggers × admission:   none: stock vLLM (+ none +admission if on)
        vtoken serve --mode M --policy P --set vtoken.trigger=T --set engine.kv_cache_blocks=N …
                                                    (waits for /v1/models)
        for rate in rates:                          ascending; --stop-after-misses K: stop once K in a row missed
            vllm bench serve --request-rate rate --goodput ttft:… tpot:… --save-result
            (a thread polls the replica's /metrics: peak running batch, prefix-cache hits, preemptions)
        stop the server (SIGINT to its process group, as Ctrl-C)

Per run: request rate achieved, goodput, **SLO attainment** (requests meeting both SLOs / requests sent),
TTFT and TPOT p50/p99, peak running batch, the lowest SLO-admission limit, prefix-cache hit rate (tokens),
preemptions (requests vLLM preempted for KV blocks: recomputed later), and what the requests paid (requests
trimmed, the share of context they lost, tokens and attention mass evicted; vtoken/core/reporting/request_cost.py).
Per variant: the **maximum rate with ≥ 90 % attainment** among the rates run (a lower bound: the next rate
failed or was not run) and where attainment crosses 90 % between the rates run (linear). The
SLOs are arguments, the same for every variant. Side effects: starts and stops servers (ports from
``free_port``), writes vLLM's result files into a temporary directory, prints progress on stderr.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from vtoken.bench.report import command_line
from vtoken.bench.served.measures import (
    ATTAINMENT_TARGET,
    ReplicaMetrics,
    max_rate_meeting,
    rate_at_target,
    run_summary,
    sweep_done,
    variant_label,
)
from vtoken.bench.served.plan import ServeBenchSetup, Variant
from vtoken.bench.served.summary import headline, summarize
from vtoken.vllm.scheduling.pool_need import FULL, PoolShape


def server_command(config_path: str, port: int) -> list[str]:
    """argv of one variant's ``vtoken serve`` process (pure): its config file, its HTTP port."""
    return [sys.executable, "-m", "vtoken.cli", "serve", "--config", config_path, "--port", str(port)]


def client_command(
    s: ServeBenchSetup, url: str, model_path: str, rate: float, result_dir: str, name: str, repeat: int = 0
) -> list[str]:
    """argv of one ``vllm bench serve`` run of repeat ``repeat`` (pure; its workload seed is
    ``s.repeat_seed(repeat)``); the ``vllm`` script next to this interpreter."""
    cmd = [
        str(Path(sys.executable).with_name("vllm")),
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        url,
        "--endpoint",
        "/v1/completions",
        "--model",
        served_name(s.model),
        "--tokenizer",
        model_path,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(s.input_len),
        "--random-output-len",
        str(s.output_len),
        "--num-prompts",
        str(s.num_prompts),
        "--request-rate",
        str(rate),
        "--seed",
        str(s.repeat_seed(repeat)),
        "--ignore-eos",
        "--disable-tqdm",
        "--goodput",
        f"ttft:{s.ttft_ms:g}",
        f"tpot:{s.tpot_ms:g}",
        "--percentile-metrics",
        "ttft,tpot,e2el",
        "--metric-percentiles",
        "50,90,99",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        result_dir,
        "--result-filename",
        name,
    ]
    if s.dataset == "chat":
        cmd += ["--random-prefix-len", str(s.prefix_len)]
    if s.spread():
        cmd += ["--random-range-ratio", str(s.spread())]
    if s.burstiness != 1.0:
        cmd += ["--burstiness", str(s.burstiness)]
    return cmd


def variant_config(
    s: ServeBenchSetup,
    mode: str,
    policy: str | None,
    admission: bool = False,
    metrics_port: int = 9500,
    shape: PoolShape | None = None,
    trigger: str = "step",
):
    """The ``ServeAppConfig`` of one variant's server: one replica, the fixed pool, the variant's mode,
    policy, budget, trigger and scope ``all`` (the benchmark's own, not the engine's default) and ``slo.admission``,
    the benchmark's SLOs (what admission targets and ``vtoken:slo_met`` counts), then ``s.extra``
    (``key=value`` as ``vtoken serve --set``; it may override any of these).
    ``shape``: the model's KV cache groups (``pool_shape_of``; default one full-attention group) — its
    ``max_model_len`` is the longest the pool holds in every group. Validates: raises ``ValueError``
    (pydantic's ``ValidationError``) naming the bad setting, before any server starts."""
    from vtoken.serve.config import ServeAppConfig
    from vtoken.serve.launch.cli import parse_scalar

    vt = {"mode": mode} | ({"policy": policy, "budget": s.budget, "scope": "all", "trigger": trigger} if policy else {})
    block_size = ServeAppConfig.model_validate({"model": s.model, "vtoken": vt}).vtoken.block_size
    shape = shape or PoolShape(windows=(FULL,), block_size=block_size, in_flight_tokens=0)
    if shape.need(s.longest_request()) > s.pool_blocks:
        raise ValueError(
            f"--pool-blocks {s.pool_blocks} cannot hold the longest request "
            f"({s.longest_request()} tokens) in every KV cache group: "
            f"{shape.describe(s.longest_request())} = {shape.need(s.longest_request())} blocks"
        )
    # max_model_len: what the pool holds in every group. Not the longest request itself: the client
    # re-tokenizes its random prompts, and a small-vocabulary tokenizer can make them much longer than asked.
    config = ServeAppConfig.model_validate(
        {
            "model": s.model,
            "vtoken": vt,
            "deployment": {"num_replicas": 1},
            "engine": {
                "kv_cache_blocks": s.pool_blocks,
                "max_num_seqs": s.max_num_seqs,
                "max_model_len": shape.longest_len(s.pool_blocks),
            },
            "limits": {"max_tokens": s.longest_output()},
            "metrics": {"port": metrics_port},
            # the server's SLO (metrics, admission) = the client's
            "slo": {"ttft_ms": s.ttft_ms, "tpot_ms": s.tpot_ms, "admission": admission},
        }
    )
    extra = {}
    for item in s.extra:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set expects key=value, got {item!r}")
        extra[key.strip()] = parse_scalar(value.strip())
    return config.merged(extra) if extra else config


def pool_shape_of(s: ServeBenchSetup, model_path: str) -> PoolShape:
    """The model's KV cache groups as vLLM will build them for the servers (``pool_need``): vLLM's engine
    config for a stock-vLLM variant (reads the model's config, loads no weights)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from vtoken.serve.replica.engine import engine_args
    from vtoken.vllm.scheduling.pool_need import pool_shape

    # probed at the one-group max_model_len, which no variant of a model with a full-attention group exceeds:
    # the in-flight tokens vLLM reserves for never shrink as the length grows, so the shape's need is never
    # under what the servers' engines need
    probe = variant_config(s, "none", None)
    return pool_shape(AsyncEngineArgs(**engine_args(probe, model_path)).create_engine_config())


def served_name(model: str) -> str:
    """The model name ``vtoken serve`` answers to for ``--model`` (``default`` serves under its alias)."""
    from vtoken.serve.config import ServeAppConfig

    return ServeAppConfig.model_validate({"model": model}).model_name


def wait_ready(url: str, proc: subprocess.Popen, timeout: float, path: str = "/v1/models") -> None:
    """Block until ``GET url+path`` answers 200; raise ``RuntimeError`` if the server process exits first or
    ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}{path}", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the server was not ready after {timeout:.0f} s")


def stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    """Ctrl-C the server's process group, then kill it if it has not exited after ``timeout``."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def run_variant(
    s: ServeBenchSetup,
    variant: Variant,
    model_path: str,
    log,
    echo,
    shape: PoolShape | None = None,
    repeat: int = 0,
) -> dict:
    """Start one server, run every rate of repeat ``repeat`` against it, stop it; returns the variant's
    report (with the workload ``seed`` it ran)."""
    from vtoken.serve.launch.local import free_port

    mode, policy, asked, trigger = variant
    port, metrics_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    config = variant_config(s, mode, policy, asked, metrics_port, shape, trigger)
    admission = config.slo.admission  # a ``--set`` wins: label and JSON say what ran
    trigger = config.vtoken.trigger.value if policy else trigger
    variant = Variant(mode, policy, admission, trigger)
    runs = []
    with tempfile.TemporaryDirectory(prefix="vtoken-bench-serve-") as tmp:
        config_path = Path(tmp, "serve.json")
        config_path.write_text(config.model_dump_json(exclude_unset=True))
        proc = subprocess.Popen(server_command(str(config_path), port), stdout=log, stderr=log, start_new_session=True)
        try:
            _drive(s, proc, url, metrics_port, model_path, variant, tmp, runs, echo, started, repeat)
        finally:
            stop(proc)
    return {
        "mode": mode,
        "policy": policy,
        "admission": admission,
        "trigger": trigger,
        "seed": s.repeat_seed(repeat),
        "runs": runs,
        "max_rate_at_target": max_rate_meeting(runs),
        "rate_at_target_interpolated": rate_at_target(runs),
        "peak_running": max((r["peak_running"] for r in runs), default=0),
    }


def _drive(
    s: ServeBenchSetup,
    proc,
    url: str,
    metrics_port: int,
    model_path: str,
    variant: Variant,
    tmp: str,
    runs: list,
    echo,
    started: float,
    repeat: int,
) -> None:
    """Wait for the server, then one ``vllm bench serve`` run per rate, ascending (appends to ``runs``), until
    ``sweep_done``."""
    mode, policy, admission, trigger = variant
    label = variant_label(*variant)
    wait_ready(url, proc, 900)
    echo(f"{label}: serving after {time.monotonic() - started:.0f} s")
    for rate in sorted(s.rates):
        name = f"{mode}-{policy}-{trigger}-{int(admission)}-{rate}.json".replace("+", "_")
        with ReplicaMetrics(f"http://127.0.0.1:{metrics_port}/metrics") as seen:
            out = subprocess.run(
                client_command(s, url, model_path, rate, tmp, name, repeat),
                capture_output=True,
                text=True,
                timeout=3600,
            )
        if out.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed ({label}, rate {rate}):\n{out.stderr[-2000:]}")
        run = run_summary(
            json.loads(Path(tmp, name).read_text()),
            s,
            rate,
            seen.peak,
            (seen.prefix_hits, seen.prefix_queries),
            seen.limit_low,
            seen.preemptions,
            seen.timeline,
            seen.cost if mode != "none" else None,  # stock vLLM evicts nothing: no cost to report
        )
        echo(
            f"{label}: rate {rate} → {run['request_throughput']} req/s, goodput {run['goodput_req_s']}, "
            f"attainment {run['slo_attainment']}, peak running {run['peak_running']}, "
            f"admission limit ≥ {run['admission_limit_min']}, "
            f"prefix-cache hits {run['prefix_cache_hit_rate']}, preemptions {run['preemptions']}, "
            f"trimmed {(run['cost'] or {}).get('trimmed')}"
        )
        runs.append(run)
        if sweep_done(runs, s.stop_after_misses):
            echo(f"{label}: {s.stop_after_misses} rate(s) in a row under the target, higher rates not run")
            return


@contextmanager
def sigterm_as_interrupt():
    """While inside (main thread only; elsewhere a no-op): SIGTERM raises ``KeyboardInterrupt``, so the
    ``finally`` blocks run as on Ctrl-C — the server's process group is stopped, ``subprocess.run`` kills the
    client. Without it a ``kill`` or ``timeout`` of the benchmark left its server running. Restores the
    previous handler on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_serve_bench(
    s: ServeBenchSetup,
    echo=lambda line: None,
    log_path: str | None = None,
    checkpoint=lambda report: None,
    shape: PoolShape | None = None,
) -> dict:
    """Every variant, one after another (one server at a time on this machine), ``s.repeats`` times; returns
    the report. ``checkpoint(report)`` gets the report of the repeats done so far after each repeat (the CLI
    writes it to ``--out``, so a long run stopped part-way keeps its finished repeats). SIGTERM stops the
    running server before the process exits (``sigterm_as_interrupt``)."""
    from vtoken.models.default import resolve_model

    model_path = str(resolve_model(s.model))
    shape = shape or pool_shape_of(s, model_path)
    started = time.perf_counter()
    repeats: list[list[dict]] = []
    with open(log_path or os.devnull, "w") as log, sigterm_as_interrupt():
        for i in range(s.repeats):
            if s.repeats > 1:
                echo(f"repeat {i + 1} of {s.repeats}")
            repeats.append([run_variant(s, variant, model_path, log, echo, shape, i) for variant in s.variants()])
            checkpoint(_report(s, model_path, repeats, started))
    report = _report(s, model_path, repeats, started)
    for line in headline(report["summary"]):
        echo(line)
    return report


# the top-level keys ``_report`` writes (``report.emit`` adds ``environment``); tests/integration/test_bench.py holds
# the builder and every committed docs/results/serve-*.json to them
REPORT_KEYS = frozenset(
    {"bench", "command", "model", "setup", "slo", "client", "variants", "repeats", "repeats_done", "summary", "seconds"}
)


def _report(s: ServeBenchSetup, model_path: str, repeats: list[list[dict]], started: float) -> dict:
    """The report of the repeats done so far (pure but the clock): ``REPORT_KEYS``."""

    return {
        "bench": "serve",
        "command": command_line(),
        "model": model_path,
        "setup": {k: (list(v) if isinstance(v, tuple) else v) for k, v in s.__dict__.items()},
        "slo": {"ttft_ms": s.ttft_ms, "tpot_ms": s.tpot_ms, "attainment_target": ATTAINMENT_TARGET},
        "client": "vllm bench serve (Poisson arrivals, --ignore-eos, --goodput)",
        "variants": repeats[0],  # the first repeat (the plot draws it); every repeat in "repeats"
        "repeats": repeats,
        "repeats_done": len(repeats),
        "summary": summarize(repeats),
        "seconds": round(time.perf_counter() - started, 1),
    }
