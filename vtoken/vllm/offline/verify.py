"""The fidelity check: vToken in vLLM versus Hugging Face transformers with exactly the same keys masked.

Library API (the ``vtoken verify`` command is ``vtoken/vllm/offline/verify_cli.py``; engines come from
``vtoken/vllm/offline/launch.py``):

1. ``run_cases`` runs greedy generation in vLLM (in-process engine, fp32, vToken on) for each case as
   concurrent requests in one engine (per-request settings via ``SamplingParams.extra_args``). A ``naive``
   case paired with another mode (same prompt, same policy, same salt) makes the same eviction decisions.
   Every request writes a trace: which tokens each forward step could see (``vtoken.vllm.scheduling.trace``).
2. ``reference_scores`` replays each trace through the HF model (eager attention, fp32;
   ``vtoken.models.hf_reference``): one teacher-forced forward per epoch with the trace's visibility mask.
3. Each ``VerifyResult`` reports ``match`` (vLLM's greedy tokens == the masked model's argmax at every
   step), ``max_abs_logprob_diff`` (|vLLM's log-prob − HF's| of each generated token), ``steps``,
   ``evicted_tokens``, ``retained_blocks_mean`` / ``packing_bound_mean`` / ``naive_blocks_mean`` (per
   scheduled step, from vLLM's own pool), and ``paired_naive_match``: identical tokens to the paired run of
   a *different* mode with the same decisions — repack and reuse+repack against naive, naive against repack
   (or reuse+repack) — so the pairing is checked for every mode, never a run against itself.

Side effects: ``run_cases`` starts an engine unless given one (writing traces to a temporary directory it
removes) and loads the HF reference model unless given one; ``make_prompt`` loads the tokenizer. Importing
this module imports nothing heavy (vLLM/transformers are imported when these run).
"""

from __future__ import annotations

import tempfile
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vtoken.core.config import Budget, Granularity, Mode, VTokenConfig
from vtoken.vllm.offline.launch import start_engine

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
    granularity: str = "token"  # "block": whole original blocks (the block-level baseline)
    score_layers: int | None = None  # attention layers that score (None: every layer)

    def key(self) -> str:
        tail = "" if self.granularity == "token" else f"_{self.granularity}"
        tail += "" if self.score_layers is None else f"_L{self.score_layers}"
        mode = Mode.parse(self.mode).value.replace("+", "-")
        return self.name or f"{self.policy}_{mode}_{self.budget}{tail}"


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


def paired_mode(mode: Mode, present: set[Mode]) -> Mode | None:
    """The mode a ``mode`` run is compared with: naive for the repacking modes, a repacking mode for naive."""
    if mode is not Mode.NAIVE:
        return Mode.NAIVE if Mode.NAIVE in present else None
    return next((m for m in (Mode.REPACK, Mode.REUSE_REPACK) if m in present), None)


def pair_results(results: list[VerifyResult]) -> None:
    """Set ``paired_naive_match`` on each result that has a partner of another mode with the same policy,
    budget, granularity and score_layers (mutates the results; a result without one keeps ``None``)."""
    runs = {
        (r.case.policy, r.case.budget, r.case.granularity, r.case.score_layers, Mode.parse(r.case.mode)): r.tokens
        for r in results
    }
    for r in results:
        same = (r.case.policy, r.case.budget, r.case.granularity, r.case.score_layers)
        partner = paired_mode(Mode.parse(r.case.mode), {k[4] for k in runs if k[:4] == same})
        if partner is not None:
            r.paired_naive_match = r.tokens == runs[(*same, partner)]


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
    tensor_parallel_size: int = 1,
) -> list[VerifyResult]:
    """Run ``cases`` as concurrent requests in one engine and check each against the HF reference.

    ``llm``: an existing in-process ``vllm.LLM`` started with ``engine_kwargs(..., trace_dir=trace_dir)``
    (its engine-level policy is overridden per request); if ``None``, one is started here, with
    ``tensor_parallel_size`` ranks (> 1: vLLM's multiprocess executor, ``start_engine``).
    """
    from vllm import SamplingParams

    from vtoken.models.hf_reference import load_reference_model
    from vtoken.vllm.scheduling.trace import RequestTrace

    model = str(model)
    if prompt is None:
        prompt = make_prompt(model, prompt_len)
    for c in cases:  # fail before any engine work on a bad value
        VTokenConfig(
            policy=c.policy,
            budget=Budget.parse(c.budget),
            mode=Mode.parse(c.mode),
            block_size=block_size,
            granularity=Granularity.parse(c.granularity),
            score_layers=c.score_layers,
        )
    own = llm is None
    tmp = None
    if own:
        tmp = tempfile.TemporaryDirectory(prefix="vtoken-verify-")
        trace_dir = tmp.name
        tp: dict[str, Any] = {"tensor_parallel_size": tensor_parallel_size} if tensor_parallel_size > 1 else {}
        llm = start_engine(model, block_size, trace_dir, sinks=sinks, recent=recent, seed=seed, **tp)
    assert trace_dir is not None, "pass the trace_dir the engine was started with"
    salt = zlib.crc32(bytes(np.asarray(prompt, np.int64)))  # same prompt ⇒ same salt ⇒ paired decisions
    requests = []
    for c in cases:
        extra = {
            "vtoken": {
                "policy": c.policy,
                "mode": Mode.parse(c.mode).value,
                "budget": c.budget,
                "trace_id": c.key(),
                "sinks": sinks,
                "recent": recent,
                "seed": seed,
                "salt": salt,
                "granularity": c.granularity,
                "score_layers": c.score_layers,
            }
        }
        requests.append(
            SamplingParams(
                max_tokens=max_tokens, temperature=0.0, logprobs=0, seed=seed, ignore_eos=True, extra_args=extra
            )
        )
    outs = llm.generate([{"prompt_token_ids": list(prompt)}] * len(cases), requests, use_tqdm=False)
    ref = reference_model if reference_model is not None else load_reference_model(model)
    results: list[VerifyResult] = []
    for c, out in zip(cases, outs):
        comp = out.outputs[0]
        tokens = list(comp.token_ids)
        vllm_lp = np.array([d[t].logprob for d, t in zip(comp.logprobs, tokens)], dtype=np.float64)
        trace = RequestTrace.read_id(trace_dir, c.key())
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
    pair_results(results)
    if tmp is not None:
        tmp.cleanup()
    return results
