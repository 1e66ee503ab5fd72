"""The long-generation yardstick's runner: forced decoding on the real engine, then the masked replay.

Side effects: starts one in-process vLLM engine (``vtoken.vllm.offline.launch.start_engine``) with the
``TeacherForcing`` logits processor and a KV pool of ``kv_space_gib`` (so no request is preempted: a
recompute would be a prefill, not per-token eviction — a trace with a second epoch raises), writes the
traces to a temporary directory it removes, and loads the Hugging Face reference model. Returns plain
dicts; ``report`` turns them into the JSON report.
"""

from __future__ import annotations

import math
import statistics
import tempfile
from dataclasses import dataclass

import numpy as np

from vtoken.bench.quality.longgen.texts import Window
from vtoken.core.config import VTokenConfig


@dataclass(frozen=True)
class LonggenSetup:
    """One run: ``points`` are ``(label, VTokenConfig)``; each window is ``prompt_tokens`` of prompt then
    ``continuation_tokens`` forced one decode step at a time."""

    model: str
    points: tuple[tuple[str, VTokenConfig], ...]
    prompt_tokens: int = 32
    continuation_tokens: int = 224
    windows: int = 100
    seed: int = 0
    block_size: int = 32
    max_num_seqs: int = 128
    kv_space_gib: int = 6

    @property
    def window_tokens(self) -> int:
        return self.prompt_tokens + self.continuation_tokens


def request_settings(cfg: VTokenConfig, trace_id: str, salt: int) -> dict:
    """The per-request ``extra_args["vtoken"]`` that runs ``cfg`` exactly, whatever the engine's defaults:
    every field a request may override (``RequestSettings.keys``: all but the engine's ``block_size``)."""
    from vtoken.vllm.config import RequestSettings

    vt = {k: v for k, v in cfg.to_dict().items() if k in RequestSettings.keys()}
    return {**vt, "trace_id": trace_id, "salt": salt}


def generate(setup, prompts: list[dict], params: list, trace_dir: str, max_model_len: int, **engine) -> list:
    """``prompts`` with their ``params`` on one fresh in-process engine built from ``setup``'s ``model``,
    ``block_size``, ``seed``, ``max_num_seqs`` and ``kv_space_gib`` (a ``LonggenSetup`` or a ``CodegenSetup``;
    ``engine``: more ``start_engine`` keywords); returns vLLM's outputs in order. Side effects: builds and drops
    the engine, which writes each request's trace under ``trace_dir``."""
    from vtoken.vllm.offline.launch import scoped_env, start_engine

    with scoped_env(VLLM_CPU_KVCACHE_SPACE=str(setup.kv_space_gib)):
        llm = start_engine(
            setup.model,
            setup.block_size,
            trace_dir,
            seed=setup.seed,
            check=False,
            max_model_len=max_model_len,
            max_num_seqs=setup.max_num_seqs,
            **engine,
        )
    try:
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        del llm


def unpreempted_trace(trace_dir: str, trace_id: str):
    """The ``RequestTrace`` ``trace_id`` under ``trace_dir``; ``RuntimeError`` if the request was preempted (a
    second epoch: recomputed from its prompt, a different eviction history). Reads the trace file."""
    from vtoken.vllm.scheduling.trace import RequestTrace

    trace = RequestTrace.read_id(trace_dir, trace_id)
    if len(trace.epochs) != 1:
        raise RuntimeError(f"{trace_id} was preempted ({len(trace.epochs)} epochs): raise --kv-space-gib")
    return trace


def run_engine(setup: LonggenSetup, wins: list[Window], trace_dir: str) -> dict:
    """Every (point, window) as one request on one engine: ``{(label, window name): (engine log-probs of the
    forced tokens, RequestTrace)}``. Raises ``RuntimeError`` if a request was not forced or was preempted."""
    from vllm import SamplingParams

    from vtoken.vllm.offline.teacher import TEACHER_KEY, TeacherForcing

    p, n = setup.prompt_tokens, setup.continuation_tokens
    prompts, params, keys = [], [], []
    for label, cfg in setup.points:
        for i, w in enumerate(wins):
            tid = f"{label}__{w.name}"
            prompts.append({"prompt_token_ids": list(w.prompt_ids[:p])})
            extra = {"vtoken": request_settings(cfg, tid, 1000 + i), TEACHER_KEY: list(w.prompt_ids[p:])}
            params.append(SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=1, extra_args=extra))
            keys.append((label, w, tid))
    outs = generate(setup, prompts, params, trace_dir, setup.window_tokens + 8, logits_processors=[TeacherForcing])
    result = {}
    for (label, w, tid), out in zip(keys, outs):
        got = list(out.outputs[0].token_ids)
        if got != list(w.prompt_ids[p:]):
            raise RuntimeError(f"{tid}: the engine did not generate the teacher's tokens (first {got[:8]})")
        trace = unpreempted_trace(trace_dir, tid)
        lps = [d[t].logprob for d, t in zip(out.outputs[0].logprobs, got)]
        result[(label, w.name)] = (np.asarray(lps, dtype=np.float64), trace)
    return result


def replay(model, w: Window, prompt_tokens: int, traces: dict) -> dict:
    """One window through the masked reference: the full cache (causal) and each point's trace visibility.
    ``traces``: ``{label: RequestTrace}``. Returns ``{"full": {...}, label: {...}}`` of per-position arrays
    ``nll`` (−log p of the real next token), ``top1`` (argmax id), and for points ``kl`` (full ‖ point, nats,
    whole vocabulary)."""
    import torch

    from vtoken.models.hf_reference import masked_logprobs

    ids = list(w.prompt_ids[:-1])  # queries: every token but the last
    t, p = len(ids), prompt_tokens
    target = torch.as_tensor(w.prompt_ids[p:], dtype=torch.long)
    causal = np.tri(t, dtype=bool)

    def rows(visible):
        return masked_logprobs(model, ids, visible)[p - 1 :]

    full = rows(causal)
    out = {"full": _position_stats(full, target)}
    pf = full.exp()
    for label, trace in traces.items():
        vis = trace.epochs[0].mask(t)
        lp = full if np.array_equal(vis, causal) else rows(vis)
        stats = _position_stats(lp, target)
        stats["kl"] = (pf * (full - lp)).sum(dim=-1).clamp_min(0).double().numpy()
        out[label] = stats
    return out


def _position_stats(logp, target) -> dict:
    return {"nll": (-logp.gather(1, target[:, None])[:, 0]).double().numpy(), "top1": logp.argmax(dim=-1).numpy()}


def full_cache_blocks(prompt_tokens: int, continuation_tokens: int, block_size: int) -> float:
    """Mean blocks a full cache holds over the decode steps (⌈seen / B⌉ at each step). Pure."""
    seen = range(prompt_tokens, prompt_tokens + continuation_tokens)
    return statistics.fmean(math.ceil(s / block_size) for s in seen)


def run_longgen(setup: LonggenSetup, wins: list[Window], on_phase=lambda text: None) -> dict:
    """Engine then replay; ``{"full": {window: stats}, "points": {label: {window: stats + engine}}}``."""
    from vtoken.models.hf_reference import load_reference_model

    on_phase(f"engine: {len(setup.points)} points × {len(wins)} windows, {setup.continuation_tokens} forced steps")
    with tempfile.TemporaryDirectory(prefix="vtoken-longgen-") as tmp:
        engine = run_engine(setup, wins, tmp)
    on_phase("replay through the masked reference")
    model = load_reference_model(setup.model)
    full, points = {}, {label: {} for label, _ in setup.points}
    for w in wins:
        traces = {label: engine[(label, w.name)][1] for label, _ in setup.points}
        res = replay(model, w, setup.prompt_tokens, traces)
        full[w.name] = res["full"]
        for label, _ in setup.points:
            lps, trace = engine[(label, w.name)]
            stats = res[label]
            stats["engine_logprob_diff"] = float(np.abs(lps + stats["nll"]).max())
            stats["held_blocks"] = statistics.fmean(trace.held_blocks) if trace.held_blocks else None
            stats["evicted"] = trace.evicted
            points[label][w.name] = stats
    return {"full": full, "points": points}
