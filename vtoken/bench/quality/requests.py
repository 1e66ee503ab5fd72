"""How every quality task runs its requests: one request per (point, case) on one in-process engine.

Shared by the pass-key, language-modelling, RULER and fidelity tasks of ``vtoken bench quality``: each
request carries its point's vToken settings in ``SamplingParams.extra_args`` and its own trace id, and the
trace (``held_blocks`` per step, read from vLLM's block rows) gives the retained-block figure.
"""

from __future__ import annotations

import statistics
import tempfile


def run_points(llm, trace_dir: str, cases, pts, params_for) -> dict:
    """Every (point, case) as one request, all submitted at once; ``params_for(extra, case)`` makes its
    ``SamplingParams``. Returns ``{(point key, case name): (output, trace)}`` (reads the traces)."""
    from vtoken.vllm.scheduling.trace import RequestTrace

    prompts, params, keys = [], [], []
    for pt in pts:
        for i, case in enumerate(cases):
            tid = f"{pt.key}__{case.name}".replace("/", "_")
            prompts.append({"prompt_token_ids": list(case.prompt_ids)})
            params.append(params_for(pt.extra(tid, salt=1000 + i), case))
            keys.append((pt.key, case.name, tid))
    outs = llm.generate(prompts, params, use_tqdm=False)
    return {(k, c): (out, RequestTrace.read_id(trace_dir, tid)) for (k, c, tid), out in zip(keys, outs)}


def run_on_engine(setup, cases, pts, params_for, **engine) -> dict:
    """Start an in-process engine with ``setup``'s model, block size, sinks, recent window, seed and TP
    (``engine``: more vLLM options), run every (point, case) on it (``run_points``), and let it go. The
    traces live in a temporary directory removed on return (they are read before)."""
    from vtoken.vllm.offline.launch import start_engine

    with tempfile.TemporaryDirectory(prefix="vtoken-quality-") as tmp:
        llm = start_engine(
            setup.model,
            setup.block_size,
            tmp,
            sinks=setup.sinks,
            recent=setup.recent,
            seed=setup.seed,
            check=False,
            tensor_parallel_size=setup.tensor_parallel_size,
            **engine,
        )
        try:
            return run_points(llm, tmp, cases, pts, params_for)
        finally:
            del llm


def blocks_summary(traces) -> dict:
    """Mean blocks held per step (vLLM's block rows), the packing bound, and the tokens evicted."""
    held = [statistics.fmean(t.held_blocks) for t in traces if t.held_blocks]
    bound = [statistics.fmean(t.packing_bound) for t in traces if t.packing_bound]
    return {
        "retained_blocks_mean": round(statistics.fmean(held), 3) if held else None,
        "packing_bound_mean": round(statistics.fmean(bound), 3) if bound else None,
        "evicted_tokens": sum(t.evicted for t in traces),
    }
