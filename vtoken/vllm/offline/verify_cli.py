"""``vtoken verify``: check vToken in vLLM against the masked Hugging Face reference, from the command line.

``vtoken verify --model PATH --policy P --budget F --mode M --block-size B --seed S [--granularity G]
[--tensor-parallel-size N] --json``

Runs the requested mode and, paired with it, ``naive`` (``repack`` when naive is the one requested; same
prompt, policy and salt) through
``vtoken.vllm.offline.verify.run_cases`` and prints the report: one JSON object on stdout with ``--json``, else one
``key value`` line per field. Exit 0 when vLLM matches the reference in both runs and the paired runs
generate the same tokens, 1 otherwise, 2 on a bad value (one-line message on stderr, no engine started).
Side effects: may build/convert the model into the cache; starts an in-process engine and loads the HF
model; sets ``VLLM_LOGGING_STREAM`` to stderr (if unset) so stdout carries only the report; a spinner on
stderr while it runs.
"""

from __future__ import annotations

import json
import shlex
import sys
from typing import Annotated

import typer

from vtoken.core.config import SET_HELP, Budget, Granularity, Mode, VTokenConfig, parse_sets, with_sets
from vtoken.errors import ConfigError
from vtoken.models.default import MODEL_HELP
from vtoken.vllm.offline.verify import VerifyCase, run_cases

# the settings a verification run carries to vLLM and the reference (``VerifyCase`` and ``run_cases``)
VERIFY_KEYS = ("policy", "budget", "mode", "block_size", "sinks", "recent", "seed", "granularity", "score_layers")


def verify(
    model: Annotated[str, typer.Option(help=MODEL_HELP)] = "tiny-llama",
    policy: Annotated[str, typer.Option(help="eviction policy (see `vtoken policies`)")] = "h2o",
    budget: Annotated[str, typer.Option(help="fraction in (0, 1] or a token count")] = "0.3",
    mode: Annotated[str, typer.Option(help="naive | repack | reuse+repack")] = "repack",
    block_size: Annotated[int, typer.Option("--block-size", help="KV block size (multiple of 32 on CPU)")] = 32,
    seed: Annotated[int, typer.Option(help="seed (random policy, vLLM)")] = 0,
    prompt_len: Annotated[int, typer.Option("--prompt-len", help="prompt tokens")] = 160,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="generated tokens")] = 24,
    sinks: Annotated[int, typer.Option(help="protected first tokens")] = 4,
    recent: Annotated[int, typer.Option(help="protected last tokens")] = 16,
    granularity: Annotated[str, typer.Option(help="token | block (evict whole original blocks)")] = "token",
    score_layers: Annotated[
        int | None,
        typer.Option(
            "--score-layers", help="attention layers that score (evenly spread, last included); unset: every layer"
        ),
    ] = None,
    tensor_parallel_size: Annotated[
        int, typer.Option("--tensor-parallel-size", "-tp", min=1, help="TP ranks (CPU: one core and process each)")
    ] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    sets: Annotated[
        list[str] | None, typer.Option("--set", help=SET_HELP + "; verify carries " + ", ".join(VERIFY_KEYS))
    ] = None,
    gpu: Annotated[
        bool,
        typer.Option(
            "--gpu",
            help="the production CUDA path (bf16, default backend and "
            "graphs) against stock vLLM instead of fp32 against HF "
            "(vtoken/vllm/offline/gpu_verify.py); refused off CUDA",
        ),
    ] = False,
) -> None:
    """Run vToken in vLLM, replay through HF with the same keys masked, and compare (exit 1 on mismatch)."""
    from vtoken.models.default import resolve_model
    from vtoken.vllm import engine_kwargs
    from vtoken.vllm.offline.launch import vllm_logs_to_stderr

    vllm_logs_to_stderr()
    try:
        cfg = with_sets(
            VTokenConfig(
                policy=policy,
                budget=Budget.parse(budget),
                mode=Mode.parse(mode),
                block_size=block_size,
                sinks=sinks,
                recent=recent,
                seed=seed,
                granularity=Granularity.parse(granularity),
                score_layers=score_layers,
            ),
            sets or (),
        )
        carried = set(parse_sets(sets or ())) - set(VERIFY_KEYS)
        if carried:
            raise ConfigError(f"--set {', '.join(sorted(carried))}: verify carries only {', '.join(VERIFY_KEYS)}")
        b, m, policy, block_size, sinks, recent, seed, score_layers = (
            cfg.budget,
            cfg.mode,
            cfg.policy,
            cfg.block_size,
            cfg.sinks,
            cfg.recent,
            cfg.seed,
            cfg.score_layers,
        )
        if not m.evicts:
            raise ConfigError("mode 'none' evicts nothing; verify one of: naive, repack, reuse+repack")
        engine_kwargs(cfg)  # also checks the block size against the installed vLLM
        path = resolve_model(model)
    except (ConfigError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    if gpu:
        _verify_gpu(path, cfg, prompt_len, max_tokens, as_json)
    bval: float = b.count if b.count is not None else float(b.fraction or 0.0)
    partner = Mode.REPACK if m is Mode.NAIVE else Mode.NAIVE  # the paired run: same decisions, other mode
    g = cfg.granularity.value
    cases = [VerifyCase(policy, mode_.value, bval, granularity=g, score_layers=score_layers) for mode_ in (m, partner)]
    from rich.console import Console

    label = f"verifying {policy} {m.value} (+ paired {partner.value}) in vLLM and HF …"
    try:
        with Console(stderr=True).status(label):
            results = run_cases(
                path,
                block_size,
                cases,
                prompt_len=prompt_len,
                max_tokens=max_tokens,
                sinks=sinks,
                recent=recent,
                seed=seed,
                tensor_parallel_size=tensor_parallel_size,
            )
    except ConfigError as e:  # the engine refused the model or an option at construction: one line, exit 2
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    main, paired = results
    naive = main if m is Mode.NAIVE else paired
    report = {
        "command": "vtoken " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "model": str(path),
        "policy": policy,
        "budget": str(b),
        "mode": m.value,
        "granularity": g,
        "score_layers": score_layers,
        "block_size": block_size,
        "seed": seed,
        "tensor_parallel_size": tensor_parallel_size,
        "match": main.match,
        "max_abs_logprob_diff": main.max_abs_logprob_diff,
        "steps": main.steps,
        "evicted_tokens": main.evicted_tokens,
        "moves": main.moves,
        "retained_blocks_mean": main.retained_blocks_mean,
        "packing_bound_mean": main.packing_bound_mean,
        "naive_blocks_mean": main.naive_blocks_mean,
        "paired_naive_match": main.tokens == paired.tokens,
        "paired_naive_retained_blocks_mean": naive.retained_blocks_mean,
        "naive_match": naive.match,
        "naive_max_abs_logprob_diff": naive.max_abs_logprob_diff,
    }
    if as_json:
        typer.echo(json.dumps(report))
    else:
        for k, v in report.items():
            typer.echo(f"{k:36s} {v}")
    ok = report["match"] and report["paired_naive_match"] and report["naive_match"] and paired.match
    raise typer.Exit(0 if ok else 1)


def _verify_gpu(path, cfg: VTokenConfig, prompt_len: int, max_tokens: int, as_json: bool) -> None:
    """``--gpu``: refuse off CUDA (exit 2, nothing built), else run ``gpu_verify`` and exit 0/1 on its verdict."""
    from vllm.platforms import current_platform

    from vtoken.vllm.offline.gpu_verify import require_cuda, run_gpu_verify
    from vtoken.vllm.offline.verify import make_prompt

    try:
        require_cuda(current_platform.device_type)
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    report = run_gpu_verify(str(path), cfg, make_prompt(path, prompt_len), max_tokens)
    report["command"] = "vtoken " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    typer.echo(json.dumps(report) if as_json else "\n".join(f"{k:36s} {v}" for k, v in report.items()))
    raise typer.Exit(0 if report["ok"] else 1)
