"""The fidelity oracle: vToken in vLLM versus Hugging Face transformers with exactly the same keys masked.

``vtoken verify --model PATH --policy P --budget F --mode M --block-size B --seed S --json``

1. Runs greedy generation in vLLM (in-process engine, fp32, vToken on) for the requested mode and, paired
   with it, ``naive`` (same prompt, same policy, same salt ⇒ the same eviction decisions). Every request
   writes a trace: which tokens each forward step could see (``vtoken.vllm.trace``).
2. Replays each trace through the HF model (eager attention, fp32; ``vtoken.models.hf_reference``): one
   teacher-forced forward per epoch with the trace's visibility mask.
3. Reports ``match`` (vLLM's greedy tokens == the masked model's argmax at every step),
   ``max_abs_logprob_diff`` (|vLLM's log-prob − HF's| of each generated token), ``steps``,
   ``evicted_tokens``, ``retained_blocks_mean`` / ``packing_bound_mean`` / ``naive_blocks_mean`` (per
   scheduled step, from vLLM's own pool), and ``paired_naive_match`` (identical tokens to the naive run).

``run_cases`` is the library entry: one engine, many (policy, mode, budget) cases as concurrent requests
(per-request settings via ``SamplingParams.extra_args``), which is what the test matrix uses.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
import tempfile
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from vtoken.core.config import Budget, ConfigError, Mode, VTokenConfig

PROSE = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
    "want of a wife. However little known the feelings or views of such a man may be on his first entering "
    "a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is "
    "considered the rightful property of some one or other of their daughters. My dear Mr. Bennet, said his "
    "lady to him one day, have you heard that Netherfield Park is let at last? Mr. Bennet replied that he had "
    "not. But it is, returned she; for Mrs. Long has just been here, and she told me all about it. "
)


@dataclass(frozen=True)
class VerifyCase:
    """One request of a verification run."""

    policy: str
    mode: str
    budget: float | int
    name: str = ""

    def key(self) -> str:
        return self.name or f"{self.policy}_{Mode.parse(self.mode).value.replace('+', '-')}_{self.budget}"


@dataclass
class VerifyResult:
    case: VerifyCase
    match: bool
    max_abs_logprob_diff: float
    steps: int
    evicted_tokens: int
    moves: int
    retained_blocks_mean: float
    packing_bound_mean: float
    naive_blocks_mean: float
    retained_minus_bound_max: int
    epochs: int
    tokens: list[int] = field(default_factory=list)
    paired_naive_match: bool | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["case"] = asdict(self.case)
        return d


def make_prompt(tokenizer_path: str | Path, n_tokens: int) -> list[int]:
    """``n_tokens`` token ids of English prose (repeated as needed), from the model's own tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_path))
    ids: list[int] = []
    while len(ids) < n_tokens:
        ids.extend(tok(PROSE, add_special_tokens=False)["input_ids"])
    return ids[:n_tokens]


def reference_scores(model, prompt: list[int], tokens: list[int], trace) -> tuple[np.ndarray, np.ndarray]:
    """(argmax ids, log-prob of each generated token) under the trace's masks; one forward per epoch."""
    from vtoken.models.hf_reference import LiveTrace, masked_logprobs, score_trace

    P, M = len(prompt), len(tokens)
    T = P + M - 1
    ids = prompt + tokens[:-1]
    if len(trace.epochs) == 1:  # the common case: the reference module's own LiveTrace path
        vis = trace.epochs[0].mask(T)
        live = [np.flatnonzero(vis[P + s - 1, : P + s]) for s in range(M)]
        res = score_trace(model, LiveTrace(prompt, tokens, live, prefill_visible=vis[:P, :P]))
        return res.top1_ids, res.token_logprobs
    top = np.zeros(M, np.int64)
    lps = np.zeros(M, np.float64)
    for ep in trace.epochs:
        n = min(len(ep.placed_round), T)
        if n == 0:
            continue
        logp = masked_logprobs(model, ids[:n], ep.mask(n))
        for s in range(M):
            q = P + s - 1
            if q < n and trace.epoch_of_query(q) is ep:
                top[s] = int(logp[q].argmax())
                lps[s] = float(logp[q, tokens[s]])
    return top, lps


def run_cases(
    model: str | Path,
    block_size: int,
    cases: list[VerifyCase],
    *,
    prompt: list[int] | None = None,
    prompt_len: int = 160,
    max_tokens: int = 24,
    sinks: int = 4,
    recent: int = 16,
    seed: int = 0,
    llm=None,
    trace_dir: str | None = None,
    reference_model=None,
) -> list[VerifyResult]:
    """Run ``cases`` as concurrent requests in one engine and check each against the HF reference.

    ``llm``: an existing in-process ``vllm.LLM`` started with ``engine_kwargs(..., trace_dir=trace_dir)``
    (its engine-level policy is overridden per request); if ``None``, one is started here.
    """
    from vllm import SamplingParams

    from vtoken.models.hf_reference import load_reference_model
    from vtoken.vllm.trace import RequestTrace

    model = str(model)
    if prompt is None:
        prompt = make_prompt(model, prompt_len)
    for c in cases:  # fail before any engine work on a bad value
        VTokenConfig(policy=c.policy, budget=Budget.parse(c.budget), mode=c.mode, block_size=block_size)
    own = llm is None
    tmp = None
    if own:
        tmp = tempfile.TemporaryDirectory(prefix="vtoken-verify-")
        trace_dir = tmp.name
        llm = start_engine(model, block_size, trace_dir, sinks=sinks, recent=recent, seed=seed)
    assert trace_dir is not None, "pass the trace_dir the engine was started with"
    salt = zlib.crc32(bytes(np.asarray(prompt, np.int64)))  # same prompt ⇒ same salt ⇒ paired decisions
    requests = []
    for c in cases:
        extra = {"vtoken": {"policy": c.policy, "mode": Mode.parse(c.mode).value, "budget": c.budget,
                            "trace_id": c.key(), "sinks": sinks, "recent": recent, "seed": seed, "salt": salt}}
        requests.append(SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, seed=seed,
                                       ignore_eos=True, extra_args=extra))
    outs = llm.generate([{"prompt_token_ids": list(prompt)}] * len(cases), requests, use_tqdm=False)
    ref = reference_model if reference_model is not None else load_reference_model(model)
    results: list[VerifyResult] = []
    for c, out in zip(cases, outs):
        comp = out.outputs[0]
        tokens = list(comp.token_ids)
        vllm_lp = np.array([d[t].logprob for d, t in zip(comp.logprobs, tokens)], dtype=np.float64)
        trace = RequestTrace.read(Path(trace_dir) / f"{c.key()}.json")
        top, ref_lp = reference_scores(ref, list(prompt), tokens, trace)
        held = np.asarray(trace.held_blocks)
        bound = np.asarray(trace.packing_bound)
        results.append(
            VerifyResult(
                case=c,
                match=bool(np.array_equal(top, np.asarray(tokens))),
                max_abs_logprob_diff=float(np.max(np.abs(vllm_lp - ref_lp))) if tokens else 0.0,
                steps=len(tokens),
                evicted_tokens=int(trace.evicted),
                moves=int(trace.moves),
                retained_blocks_mean=float(held.mean()) if held.size else 0.0,
                packing_bound_mean=float(bound.mean()) if bound.size else 0.0,
                naive_blocks_mean=float(np.mean(trace.naive_blocks)) if trace.naive_blocks else 0.0,
                retained_minus_bound_max=int((held - bound).max()) if held.size else 0,
                epochs=len(trace.epochs),
                tokens=tokens,
            )
        )
    by_policy_naive = {(r.case.policy, r.case.budget): r.tokens for r in results if Mode.parse(r.case.mode) is Mode.NAIVE}
    for r in results:
        naive = by_policy_naive.get((r.case.policy, r.case.budget))
        if naive is not None:
            r.paired_naive_match = r.tokens == naive
    if tmp is not None:
        tmp.cleanup()
    return results


@contextlib.contextmanager
def scoped_env(**values: str):
    """Set environment variables for the ``with`` body only (vLLM reads these when an engine is built).

    vLLM memoises its environment once an engine core starts (``vllm.envs.enable_envs_cache``); the cache
    is cleared on entry and exit so this engine sees ``values`` and later engines see the real environment.
    """
    import vllm.envs as envs

    old = {k: os.environ.get(k) for k in values}
    envs.disable_envs_cache()
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        envs.disable_envs_cache()


def start_engine(model: str, block_size: int, trace_dir: str, *, sinks: int = 4, recent: int = 16, seed: int = 0,
                 max_model_len: int = 1024, **kwargs):
    """An in-process fp32 vLLM engine with vToken on (hooks enabled; policies come per request).

    In-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with a 1 GiB KV pool unless the caller's environment
    says otherwise; the environment is only changed while the engine is built."""
    from vllm import LLM

    from vtoken.vllm import engine_kwargs

    cfg = VTokenConfig(policy="h2o", budget=0.5, mode="repack", block_size=block_size, sinks=sinks, recent=recent,
                       seed=seed)
    kw = engine_kwargs(cfg, trace_dir=trace_dir, check=True)
    kw.update(kwargs)
    kw.setdefault("enable_prefix_caching", False)  # paired requests share a prompt: keep their blocks private
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    with scoped_env(**env):
        return LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=max_model_len, seed=seed,
                   gpu_memory_utilization=0.5, **kw)


# ---------------------------------------------------------------------------------------------- CLI
def verify(
    model: Annotated[str, typer.Option(help="default | tiny-llama | tiny-qwen2 | PATH to an HF checkpoint")] = "tiny-llama",
    policy: Annotated[str, typer.Option(help="eviction policy (see `vtoken policies`)")] = "h2o",
    budget: Annotated[str, typer.Option(help="fraction in (0, 1] or a token count")] = "0.3",
    mode: Annotated[str, typer.Option(help="naive | repack | reuse+repack")] = "repack",
    block_size: Annotated[int, typer.Option("--block-size", help="KV block size (multiple of 32 on CPU)")] = 32,
    seed: Annotated[int, typer.Option(help="seed (random policy, vLLM)")] = 0,
    prompt_len: Annotated[int, typer.Option("--prompt-len", help="prompt tokens")] = 160,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="generated tokens")] = 24,
    sinks: Annotated[int, typer.Option(help="protected first tokens")] = 4,
    recent: Annotated[int, typer.Option(help="protected last tokens")] = 16,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Run vToken in vLLM, replay through HF with the same keys masked, and compare (exit 1 on mismatch)."""
    from vtoken.models.default import resolve_model

    from vtoken.vllm import engine_kwargs

    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries only the report
    try:
        b = Budget.parse(budget)
        m = Mode.parse(mode)
        if not m.evicts:
            raise ConfigError("mode 'none' evicts nothing; verify one of: naive, repack, reuse+repack")
        cfg = VTokenConfig(policy=policy, budget=b, mode=m, block_size=block_size, sinks=sinks, recent=recent,
                           seed=seed)
        engine_kwargs(cfg)  # also checks the block size against the installed vLLM
        path = resolve_model(model)
    except (ConfigError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    bval = b.count if b.count is not None else b.fraction
    cases = [VerifyCase(policy, m.value, bval)]
    if m is not Mode.NAIVE:
        cases.append(VerifyCase(policy, Mode.NAIVE.value, bval))
    from rich.console import Console

    with Console(stderr=True).status(f"verifying {policy} {m.value} (+ paired naive) in vLLM and HF …"):
        results = run_cases(path, block_size, cases, prompt_len=prompt_len, max_tokens=max_tokens, sinks=sinks,
                            recent=recent, seed=seed)
    main, naive = results[0], results[-1]
    report = {
        "command": "vtoken " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "model": str(path),
        "policy": policy,
        "budget": str(b),
        "mode": m.value,
        "block_size": block_size,
        "seed": seed,
        "match": main.match,
        "max_abs_logprob_diff": main.max_abs_logprob_diff,
        "steps": main.steps,
        "evicted_tokens": main.evicted_tokens,
        "moves": main.moves,
        "retained_blocks_mean": main.retained_blocks_mean,
        "packing_bound_mean": main.packing_bound_mean,
        "naive_blocks_mean": main.naive_blocks_mean,
        "paired_naive_match": True if m is Mode.NAIVE else main.tokens == naive.tokens,
        "paired_naive_retained_blocks_mean": naive.retained_blocks_mean,
        "naive_match": naive.match,
        "naive_max_abs_logprob_diff": naive.max_abs_logprob_diff,
    }
    if as_json:
        typer.echo(json.dumps(report))
    else:
        for k, v in report.items():
            typer.echo(f"{k:36s} {v}")
    ok = report["match"] and report["paired_naive_match"] and report["naive_match"]
    raise typer.Exit(0 if ok else 1)
