"""The worker's per-step ``StepResult``: reduced from the step's device-side statistics and attached to vLLM's
output — at once for a ``ModelRunnerOutput``, or when an async output is read (async scheduling: vLLM's
``get_output()`` runs after the step's GPU work, so the worker never waits for it at sampling time).

``parts`` is what ``VTokenRunnerMixin._vt_attach`` hands over: ``(result, score accumulator or None,
{request: (start, end, seq_len)} of key-norm rows or None, Σ-over-layers key norms (device) or None, layer
count, (start, end) CUDA events around the moves or None)``.

With async scheduling vLLM reads step N's output after it has enqueued step N+1, so reading the statistics
there with ``.cpu()`` would wait for N+1's forward on the current stream. ``HostReadback`` copies them the way
vLLM copies its sampled tokens (``AsyncGPUModelRunnerOutput``): on a side stream, ordered after step N's work,
into pinned host memory, with an event; ``get_output`` waits on that event only::

    current stream   … forward N ─┬─ moves N+1, forward N+1 …
    copy stream                   └─ wait ─ sums/rows/norms → pinned host ─ event N
    get_output(N)                                                 event N.synchronize() → finish on host
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from vllm.v1.outputs import AsyncModelRunnerOutput

from vtoken.core.step_stats import SlotScores
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
            "score hook this step (a FULL CUDA graph replay?); every-layer attention statistics need "
            "cudagraph_mode PIECEWISE or NONE, a score_layers subset its query buffers (docs/gpu.md)"
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


class HostReadback:
    """Starts the copy of one step's device statistics to host memory without waiting for the device.

    ``cuda`` is the ``torch.cuda`` module (a stand-in in the CPU tests). The copy stream is created once per
    runner; each ``start`` makes it wait for the work already on the current stream (the step's forward, and
    with TP the all-reduce), enqueues non-blocking copies into pinned host tensors, marks the device buffers
    as used by that stream (the caching allocator must not hand them to step N+1 before the copy ran) and
    records an event. Mutates the accumulator (its buffers become the host copies)."""

    def __init__(self, cuda=torch.cuda) -> None:
        self._cuda = cuda
        self._stream = cuda.Stream()

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
        host.copy_(t, non_blocking=True)
        if t.is_cuda:
            t.record_stream(self._stream)
        return host

    def start(self, parts: tuple) -> tuple[tuple, object]:
        """``(parts with host buffers, event)``: ``finish_step_result`` may run once the event completed."""
        res, acc, norm_reqs, norm_sum, norm_layers, timer = parts
        stream = self._stream
        stream.wait_stream(self._cuda.current_stream())
        with self._cuda.stream(stream):
            if acc is not None:
                acc.to_host(self._copy)
            if norm_sum is not None:
                norm_sum = self._copy(norm_sum)
            ready = self._cuda.Event()
            ready.record(stream)
        return (res, acc, norm_reqs, norm_sum, norm_layers, timer), ready


class DeferredResultOutput(AsyncModelRunnerOutput):
    """An ``AsyncModelRunnerOutput`` (async scheduling) whose ``get_output()`` also finishes and attaches the
    step's vToken result, after vLLM's own copy. ``ready``: the ``HostReadback`` event of this step's copy
    (``None``: the buffers are host tensors already); only that event is waited on, never the stream."""

    def __init__(self, inner, parts, ready=None) -> None:
        self._inner, self._parts, self._ready = inner, parts, ready

    def get_output(self):
        out = self._inner.get_output()
        if self._ready is not None:
            self._ready.synchronize()
        return attach_step_result(out, self._parts)
