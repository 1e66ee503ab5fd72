"""The quality parity rule and its statistics (pure functions).

Stated in docs/quality.md ("The parity rule") before any point it judges was measured:

* **text**: a point is at parity on long generations when the upper bound of its perplexity ratio's
  paired bootstrap 95 % interval (over windows) is ≤ ``RATIO_BOUND``;
* **tasks**: on every task, the one-sided 95 % lower bound of the paired accuracy difference (point − full
  cache, per instance) is ≥ ``TASK_DIFF_BOUND``.

A point is at parity when both hold. The ratio is ``exp(mean NLL_point − mean NLL_full)`` over the
continuation tokens; windows have equal lengths, so resampling windows resamples tokens in blocks that
keep each window's tokens together (their errors are correlated).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

RATIO_BOUND = 1.02  # the perplexity ratio's 95 % upper bound must not exceed this
TASK_DIFF_BOUND = -0.05  # the paired accuracy difference's one-sided 95 % lower bound must not be below this
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


def _resamples(n: int, resamples: int, seed: int) -> np.ndarray:
    """``[resamples, n]`` indices drawn with replacement (one fixed generator: the interval is reproducible)."""
    if n < 2:
        raise ValueError(f"a bootstrap needs at least 2 paired units, got {n}")
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def perplexity_ratio(
    nll_point: Sequence[float],
    nll_full: Sequence[float],
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> dict:
    """Per-window mean NLLs (nats/token, same windows in the same order) → ``{"ratio", "ci95"}``: the
    perplexity ratio point ÷ full and its paired bootstrap percentile 95 % interval over windows."""
    if len(nll_point) != len(nll_full):
        raise ValueError(f"paired per-window NLLs needed, got {len(nll_point)} and {len(nll_full)}")
    d = np.asarray(nll_point, dtype=np.float64) - np.asarray(nll_full, dtype=np.float64)
    means = d[_resamples(d.size, resamples, seed)].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return {"ratio": round(math.exp(d.mean()), 4), "ci95": [round(math.exp(low), 4), round(math.exp(high), 4)]}


def paired_difference(
    point: Sequence[bool], full: Sequence[bool], *, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED
) -> dict:
    """Per-instance correctness (same instances, same order) → ``{"difference", "lower95"}``: the accuracy
    difference point − full and its one-sided 95 % lower bound (paired bootstrap, 5th percentile)."""
    if len(point) != len(full):
        raise ValueError(f"paired per-instance results needed, got {len(point)} and {len(full)}")
    d = np.asarray(point, dtype=np.float64) - np.asarray(full, dtype=np.float64)
    means = d[_resamples(d.size, resamples, seed)].mean(axis=1)
    return {"difference": round(float(d.mean()), 4), "lower95": round(float(np.percentile(means, 5)), 4)}


def at_parity(ratio: dict, tasks: dict[str, dict] | None = None) -> dict:
    """The rule: ``ratio`` from ``perplexity_ratio``, ``tasks`` ``{name: paired_difference(...)}`` (none
    measured: the text half alone). Returns ``{"at_parity", "text", "tasks", "failed"}`` naming what failed."""
    failed = []
    text_ok = ratio["ci95"][1] <= RATIO_BOUND
    if not text_ok:
        failed.append(f"perplexity ratio 95 % upper bound {ratio['ci95'][1]} > {RATIO_BOUND}")
    task_ok = {}
    for name, diff in (tasks or {}).items():
        task_ok[name] = diff["lower95"] >= TASK_DIFF_BOUND
        if not task_ok[name]:
            failed.append(f"{name}: accuracy difference lower bound {diff['lower95']} < {TASK_DIFF_BOUND}")
    return {"at_parity": not failed, "text": text_ok, "tasks": task_ok, "failed": failed}
