"""``vtoken bench`` through the served stack: serve (``vllm bench serve`` against ``vtoken serve``) and soak.
Mounted by ``vtoken/bench/cli.py``."""

from __future__ import annotations

import typer

from vtoken.bench.report import refuse
from vtoken.models.default import MODEL_HELP

app = typer.Typer()


@app.command("soak")
def soak_cmd(
    duration: float = typer.Option(120.0, min=10.0, help="seconds of load (minutes here, hours where you run it)"),
    concurrency: int = typer.Option(6, min=1, max=64, help="client threads"),
    seed: int = typer.Option(0, help="draws the requests (and their aborts)"),
    pool_blocks: int = typer.Option(64, "--pool-blocks", min=40, help="each replica's KV pool, in blocks"),
    kill_at: float = typer.Option(
        0.4, "--kill-at", min=0.0, max=0.9, help="share of the duration at which one replica is killed (0: none)"
    ),
    abort_rate: float = typer.Option(0.15, "--abort-rate", min=0.0, max=1.0, help="share of client aborts"),
    out: str = typer.Option(None, help="also write the JSON here"),
) -> None:
    """Chaos soak of the served stack (tiny model, 2 replicas on loopback): mixed requests, client aborts,
    pool pressure, a replica killed mid-run; exits 1 unless every request is accounted for, no KV
    invariant broke, nothing is held or left running and the greedy replay matches."""
    from vtoken.bench.report import emit
    from vtoken.bench.served.soak import SoakSetup, run_soak

    setup = SoakSetup(
        duration_s=duration,
        concurrency=concurrency,
        seed=seed,
        pool_blocks=pool_blocks,
        kill_at=kill_at,
        abort_rate=abort_rate,
    )
    report = run_soak(setup, on_phase=lambda text: typer.echo(f"[soak] {text}", err=True))
    emit(report, out)
    raise typer.Exit(0 if report["passed"] else 1)


@app.command("serve")
def serve_cmd(
    model: str = typer.Option("default", help=MODEL_HELP),
    modes: str = typer.Option("none,naive,repack", help="comma-separated: none naive repack reuse+repack"),
    policies: str = typer.Option("h2o", help="comma-separated policies for the evicting modes"),
    budget: str = typer.Option(
        "0.2",
        help="fraction in (0, 1] or token count, over every token (scope all; "
        "--set vtoken.scope=generated: decode-only)",
    ),
    pool_blocks: int = typer.Option(64, "--pool-blocks", help="the replica's KV pool (blocks)"),
    max_num_seqs: int = typer.Option(16, "--max-num-seqs", help="engine batch limit"),
    rates: str = typer.Option("1.5", help="comma-separated request rates (req/s, Poisson)"),
    num_prompts: int = typer.Option(48, "--num-prompts", help="requests per run"),
    input_len: int = typer.Option(256, "--input-len"),
    output_len: int = typer.Option(96, "--output-len"),
    dataset: str = typer.Option("random", help="random | chat (shared system prompt, lengths ±50 %)"),
    prefix_len: int = typer.Option(128, "--prefix-len", help="chat: shared system-prompt tokens"),
    ttft_ms: float = typer.Option(15000, "--ttft-ms", help="TTFT SLO (ms), the same for every mode"),
    tpot_ms: float = typer.Option(300, "--tpot-ms", help="TPOT SLO (ms), the same for every mode"),
    seed: int = typer.Option(0, help="workload seed of the first repeat (repeat i: seed + i)"),
    burstiness: float = typer.Option(1.0, help="arrival burstiness: 1 Poisson, < 1 bursts (gamma intervals)"),
    range_ratio: float = typer.Option(
        0.0,
        "--range-ratio",
        help="random dataset: request lengths uniform in "
        "(1 ± this) × --input-len / --output-len (long and short mixed)",
    ),
    admission: str = typer.Option("off", help="SLO-aware admission per variant: off | on | off,on (an A/B)"),
    triggers: str = typer.Option(
        "step",
        help="eviction triggers per evicting variant, comma-separated: step (the fixed budget) | pressure "
        "(evict only when the pool is short; --budget is the floor)",
    ),
    stop_after_misses: int = typer.Option(
        0,
        "--stop-after-misses",
        help="stop a variant's sweep once this many rates in a row missed 90 % attainment (0: run every rate)",
    ),
    repeats: int = typer.Option(
        1,
        help="run every variant this many times in this one command; ratios per repeat, summarised as median (min-max)",
    ),
    sets: list[str] = typer.Option([], "--set", help="serve config key=value for every server (repeatable)"),
    as_json: bool = typer.Option(False, "--json", help="print the JSON only (progress otherwise on stderr)"),
    log: str = typer.Option(None, help="the servers' output goes here (default: discarded)"),
    out: str = typer.Option(None, help="also write the JSON here"),
    plot: str = typer.Option(None, help="write the attainment / goodput vs rate plot (PNG) here"),
) -> None:
    """The served path per mode: `vtoken serve` + `vllm bench serve`, goodput and SLO attainment per rate."""
    from vtoken.bench.report import emit, partial_writer
    from vtoken.bench.served.bench import pool_shape_of, run_serve_bench, variant_config
    from vtoken.bench.served.plan import DATASETS, ServeBenchSetup
    from vtoken.models.default import resolve_model
    from vtoken.vllm.offline.launch import vllm_logs_to_stderr

    vllm_logs_to_stderr()  # the pool probe builds vLLM's engine config; servers and client log to --log
    try:
        rate_list = tuple(float(x) for x in rates.split(",") if x.strip())
    except ValueError:
        refuse(f"--rates {rates!r}: comma-separated numbers")
    checks = [
        (not rate_list or min(rate_list) <= 0, f"--rates {rates!r}: positive request rates"),
        (dataset not in DATASETS, f"--dataset {dataset!r}: valid are {', '.join(DATASETS)}"),
        (min(num_prompts, input_len, output_len) < 1, "--num-prompts, --input-len, --output-len must be ≥ 1"),
        (ttft_ms <= 0 or tpot_ms <= 0, "--ttft-ms / --tpot-ms must be > 0"),
        (stop_after_misses < 0, f"--stop-after-misses {stop_after_misses}: 0 (every rate) or a count ≥ 1"),
        (repeats < 1, f"--repeats {repeats}: need at least 1"),
        (burstiness <= 0, f"--burstiness {burstiness}: must be > 0"),
        (not 0 <= range_ratio < 1, f"--range-ratio {range_ratio}: must be in [0, 1)"),
        (range_ratio and dataset == "chat", f"--range-ratio {range_ratio}: chat sets its own (±50 %)"),
    ]
    switches = {"off": False, "on": True}
    trigger_list = tuple(t.strip() for t in triggers.split(",") if t.strip())
    checks.append(
        (
            not trigger_list or not set(trigger_list) <= {"step", "pressure"},
            f"--triggers {triggers!r}: valid are step, pressure",
        )
    )
    admission_list = [a.strip() for a in admission.split(",") if a.strip()]
    checks.append(
        (
            not admission_list or not set(admission_list) <= set(switches),
            f"--admission {admission!r}: valid are off, on, off,on",
        )
    )
    for failed, message in checks:
        if failed:
            refuse(message)
    setup = ServeBenchSetup(
        model=model,
        modes=tuple(m.strip() for m in modes.split(",") if m.strip()),
        policies=tuple(p.strip() for p in policies.split(",") if p.strip()),
        budget=budget,
        pool_blocks=pool_blocks,
        max_num_seqs=max_num_seqs,
        rates=rate_list,
        num_prompts=num_prompts,
        input_len=input_len,
        output_len=output_len,
        dataset=dataset,
        prefix_len=prefix_len,
        ttft_ms=ttft_ms,
        tpot_ms=tpot_ms,
        seed=seed,
        burstiness=burstiness,
        range_ratio=range_ratio,
        admission=tuple(switches[a] for a in admission_list),
        triggers=trigger_list,
        extra=tuple(sets),
        stop_after_misses=stop_after_misses,
        repeats=repeats,
    )
    if not setup.variants():
        refuse(f"--modes {modes!r} / --policies {policies!r}: nothing to run")
    try:  # the model's KV cache groups, as vLLM will build them for every server
        shape = pool_shape_of(setup, str(resolve_model(setup.model)))
    except ValueError as exc:
        refuse(str(exc))
    for v in setup.variants():  # every server's config is valid before the first one starts
        try:
            variant_config(setup, v.mode, v.policy, v.admission, shape=shape, trigger=v.trigger)
        except ValueError as exc:
            refuse(f"mode {v.mode!r}, policy {v.policy!r}, trigger {v.trigger!r}: {exc}")
    echo = (lambda *_: None) if as_json else (lambda line: typer.echo(line, err=True))
    try:
        report = run_serve_bench(setup, echo, log, checkpoint=partial_writer(out), shape=shape)
    except RuntimeError as exc:
        refuse(str(exc))
    if plot:
        from vtoken.bench.served.plot import plot_serve

        plot_serve(report, plot)
    emit(report, out)
