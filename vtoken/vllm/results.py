"""The worker's per-step ``StepResult``: reduced from the step's device-side statistics and attached to vLLM's
output — at once for a ``ModelRunnerOutput``, or when an async output is read (async scheduling: vLLM's
``get_output()`` runs after the step's GPU work, so the worker never waits for it at sampling time).

``parts`` is what ``VTokenRunnerMixin._vt_attach`` hands over: ``(result, score accumulator or None,
{request: (start, end, seq_len)} of key-norm rows or None, Σ-over-layers key norms (device) or None, layer
count, (start, end) CUDA events around the moves or None)``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from vllm.v1.outputs import AsyncModelRunnerOutput

from vtoken.core.stats import SlotScores
from vtoken.vllm.transport import StepResult, attach_result


def finish_step_result(res: StepResult, acc, norm_reqs, norm_sum, norm_layers, timer) -> StepResult:
    """Reduce one step's device-side statistics to host arrays (waits for them; fills ``res``, returns it).
    Raises ``RuntimeError`` when a request asked for attention statistics that no layer collected."""
    if timer is not None:
        timer[1].synchronize()
        res.move_seconds = timer[0].elapsed_time(timer[1]) / 1e3
    missed = [rid for rid, rs in (acc.requests.items() if acc is not None else ()) if rs.layers == 0]
    if missed:
        raise RuntimeError(
            f"vToken: attention statistics were requested for {missed[:4]} but no attention layer ran the "
            "score hook this step (a FULL CUDA graph replay?); attention policies need cudagraph_mode "
            "PIECEWISE or NONE (docs/gpu.md)"
        )
    scores = acc.finish() if acc is not None else {}
    if norm_reqs:
        norms = (norm_sum / norm_layers).cpu().numpy().astype(np.float64) if norm_sum is not None else None
        for rid, (a, b, seq_len) in norm_reqs.items():
            base = scores.get(rid)
            kn = norms[a:b] if norms is not None and b > a else None
            if base is None:
                base = SlotScores(n_queries=b - a, seq_len=seq_len)
            scores[rid] = dataclasses.replace(base, key_norm=kn) if kn is not None else base
    res.scores = scores
    return res


def attach_step_result(out, parts):
    """Finish ``parts`` (see ``_vt_attach``) and attach the result to ``out``, a ``ModelRunnerOutput``
    (returns the output to hand on; never mutates vLLM's shared empty output)."""
    res = finish_step_result(*parts)
    return attach_result(out, res) if (res.scores or res.num_moves) else out


class DeferredResultOutput(AsyncModelRunnerOutput):
    """An ``AsyncModelRunnerOutput`` (async scheduling) whose ``get_output()`` also finishes and attaches the
    step's vToken result, after vLLM's own copy (so the worker never waits for the GPU at sampling)."""

    def __init__(self, inner, parts) -> None:
        self._inner, self._parts = inner, parts

    def get_output(self):
        return attach_step_result(self._inner.get_output(), self._parts)

