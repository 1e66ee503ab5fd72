"""Engine step times for ``vtoken bench fleet``: measured on this machine, fitted, saved, loaded.

``measure_steps`` runs one real in-process vLLM engine with vToken on (``mode``/``policy``/``budget`` as
the fleet's replicas use them) and times ``LLMEngine.step()``:

* decode steps of ``b`` requests (each past a ``context``-token prompt), ``b`` in ``decode_batches``;
* prefill steps of one ``p``-token prompt, ``p`` in ``prefill_lens``;

with vLLM's own CPU binding, after one untimed run of each shape (oneDNN builds kernels on first use).
This machine is shared: a step is slowed by whatever else runs (measured: the same decode step of
SmolLM2 from 65 ms to 6 s; pinning the engine to one core made it worse), so the fit uses each shape's
10th-percentile step — close to its cost without interference, robust to a lucky outlier — and the
medians are reported too.
One least-squares fit over the shapes (milliseconds)::

    step_ms = base_ms + per_seq_ms · (decoding requests) + per_token_ms · (prompt tokens prefilled)

which the simulation uses for every replica, multiplied by ``time_scale`` (1 = this machine). Side
effects: loads the model (may convert it on first use), prints progress on stderr.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vtoken.bench.fleet.model import BASE
from vtoken.core.config import VTokenConfig
from vtoken.vllm.offline.launch import scheduler_of

DEFAULT_STEPS_FILE = Path("docs/results/fleet-steps.json")
# the top-level keys ``measure_steps`` returns (``environment`` included: the steps file is written as is);
# tests/integration/test_bench.py holds the committed docs/results/fleet-steps.json to them
REPORT_KEYS = frozenset(
    {
        "bench",
        "command",
        "what",
        "model",
        "block_size",
        "mode",
        "policy",
        "budget",
        "decode_context_tokens",
        "repeats",
        "statistic",
        "decode_step_ms",
        "prefill_step_ms",
        "decode_step_ms_median",
        "prefill_step_ms_median",
        "fit",
        "seconds",
        "load_average_1_5_15",
        "environment",
    }
)


@dataclass(frozen=True)
class StepModel:
    """``seconds(n_decode, n_prefill_tokens)`` of one engine step (pure)."""

    base_s: float
    per_seq_s: float
    per_token_s: float
    time_scale: float = 1.0

    def seconds(self, n_decode, n_prefill_tokens=0):
        return self.time_scale * (self.base_s + self.per_seq_s * n_decode + self.per_token_s * n_prefill_tokens)


def fit(samples: list[tuple[int, int, float]]) -> dict[str, float]:
    """Least squares over ``(decoding requests, prefill tokens, ms)`` samples (pure); coefficients ≥ 0."""
    a = np.array([[1.0, d, p] for d, p, _ in samples])
    y = np.array([ms for _, _, ms in samples])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    coef = np.maximum(coef, 0.0)
    residual = y - a @ coef
    return {
        "base_ms": round(float(coef[0]), 4),
        "per_seq_ms": round(float(coef[1]), 5),
        "per_token_ms": round(float(coef[2]), 6),
        "max_abs_error_pct": round(float(np.max(np.abs(residual) / y)) * 100, 1),
    }


def load_steps(path: Path, time_scale: float = 1.0) -> tuple[StepModel, dict]:
    """The fitted model and the measurement report in ``path`` (written by ``measure_steps``)."""
    report = json.loads(Path(path).read_text())
    f = report["fit"]
    model = StepModel(f["base_ms"] / 1e3, f["per_seq_ms"] / 1e3, f["per_token_ms"] / 1e3, time_scale)
    return model, report


def _engine(model: str, cfg: VTokenConfig):
    from vllm import LLM

    from vtoken.vllm import engine_kwargs
    from vtoken.vllm.offline.launch import inprocess_env, scoped_env

    with scoped_env(**inprocess_env()):
        return LLM(
            model=model,
            dtype="float32",
            enforce_eager=True,
            max_model_len=2048,
            seed=0,
            max_num_seqs=64,
            max_num_batched_tokens=2048,
            enable_prefix_caching=False,
            gpu_memory_utilization=0.5,
            **engine_kwargs(cfg),
        )


def _run(llm, prompts: list[list[int]], gen: int, tag: str) -> tuple[list[float], list[float]]:
    """(prefill step seconds, decode step seconds) of one batch run to completion."""
    from vllm import SamplingParams

    eng = llm.llm_engine
    sched = scheduler_of(llm)
    for i, p in enumerate(prompts):
        eng.add_request(
            f"{tag}-{i}", {"prompt_token_ids": p}, SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
        )
    prefill, decode = [], []
    while eng.has_unfinished_requests():
        decoding = len(sched.running) == len(prompts) and all(
            r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running
        )
        fresh = not sched.running
        t0 = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t0
        (decode if decoding else prefill if fresh else []).append(dt)
    return prefill, decode


def measure_steps(
    model: str = "tiny-llama",
    vtoken: VTokenConfig = BASE,
    decode_batches=(1, 2, 4, 8, 16),
    prefill_lens=(64, 256, 1024),
    context: int = 256,
    decode_steps: int = 16,
    repeats: int = 4,
) -> dict:
    """Time decode and prefill steps of a real engine with ``vtoken``'s settings (the fleet's replicas'); returns
    the report (see the module docstring): ``REPORT_KEYS``."""
    from transformers import AutoConfig

    from vtoken.models.default import resolve_model

    path = str(resolve_model(model))
    vocab = AutoConfig.from_pretrained(path).vocab_size
    rng = np.random.default_rng(0)
    llm = _engine(path, vtoken)
    started = time.perf_counter()

    def tokens(n: int) -> list[int]:
        return rng.integers(10, min(vocab, 30000), n).tolist()

    decode, prefill = {}, {}
    for r in range(repeats + 1):  # run 0 warms each shape up (oneDNN builds its kernels on first use)
        for b in decode_batches:
            steps = _run(llm, [tokens(context) for _ in range(b)], decode_steps, f"d{b}-{r}")[1]
            if r:
                decode.setdefault(b, []).extend(steps)
            print(f"  decode batch {b} (run {r}/{repeats}, 0 = warm-up)", file=sys.stderr)
        for p in prefill_lens:
            first, _ = _run(llm, [tokens(p)], 2, f"p{p}-{r}")
            if r:
                prefill.setdefault(p, []).extend(first[:1])
    llm.llm_engine.engine_core.shutdown()
    decode_ms = {b: float(np.percentile(v, 10)) * 1e3 for b, v in decode.items()}
    prefill_ms = {p: float(np.percentile(v, 10)) * 1e3 for p, v in prefill.items()}
    samples = [(b, 0, ms) for b, ms in decode_ms.items()] + [(0, p, ms) for p, ms in prefill_ms.items()]
    from vtoken.bench.report import environment

    return {
        "bench": "fleet-steps",
        "command": f"vtoken bench fleet --measure-steps --steps-model {shlex.quote(model)}",
        "what": "engine step wall times of one in-process vLLM engine with vToken, measured on this machine",
        "model": path,
        "block_size": vtoken.block_size,
        "mode": vtoken.mode.value,
        "policy": vtoken.policy,
        "budget": vtoken.budget.to_json(),
        "decode_context_tokens": context,
        "repeats": repeats,
        "statistic": "10th percentile of each shape's steps (fit); medians beside",
        "decode_step_ms": {str(b): round(ms, 3) for b, ms in decode_ms.items()},
        "prefill_step_ms": {str(p): round(ms, 3) for p, ms in prefill_ms.items()},
        "decode_step_ms_median": {str(b): round(statistics.median(v) * 1e3, 3) for b, v in decode.items()},
        "prefill_step_ms_median": {str(p): round(statistics.median(v) * 1e3, 3) for p, v in prefill.items()},
        "fit": fit(samples),
        "seconds": round(time.perf_counter() - started, 1),
        "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],  # a shared machine: see the spread
        "environment": environment(),
    }
