"""vToken inside vLLM (out of tree). The vLLM internals it relies on are listed, with reasons, in
``vtoken.vllm.internals`` (pinned to vLLM 0.32.0).

Python::

    from vllm import LLM
    from vtoken.core.config import VTokenConfig
    from vtoken.vllm import engine_kwargs

    cfg = VTokenConfig(policy="h2o", budget=0.2, mode="repack", block_size=32)
    llm = LLM(model="...", **engine_kwargs(cfg))

Command line (what ``engine_kwargs`` expands to)::

    vllm serve MODEL --block-size 32 \\
        --scheduler-cls vtoken.vllm.scheduler.VTokenScheduler \\
        --worker-cls vtoken.vllm.worker.VTokenWorker \\
        --additional-config '{"vtoken": {"policy": "h2o", "budget": 0.2, "mode": "repack"}}'

The same names work on vLLM's CPU and CUDA platforms: ``VTokenWorker`` builds the platform's worker, and
``VTokenScheduler`` builds its async variant when vLLM schedules asynchronously (the CUDA default); on CUDA
the engine runs vLLM's V1 model runner, and PIECEWISE CUDA graphs for attention policies (docs/gpu.md).

The settings (``vtoken.vllm.config``) are validated when the engine starts; a bad value fails start-up with
a message naming it and the valid values. Per-request overrides go in
``SamplingParams(extra_args={"vtoken": {...}})`` (``vllm_xargs`` in the OpenAI API).
"""

from __future__ import annotations

from typing import Any

from vtoken.core.config import VTokenConfig
from vtoken.vllm.config import EngineSettings, check_platform_block_size

SCHEDULER_CLS = "vtoken.vllm.scheduler.VTokenScheduler"
WORKER_CLS = "vtoken.vllm.worker.VTokenWorker"  # CPU or CUDA implementation, chosen when vLLM builds it


def engine_kwargs(
    cfg: VTokenConfig | None = None,
    *,
    scores: str = "auto",
    trace_dir: str | None = None,
    check: bool = False,
    admission_tpot_ms: float | None = None,
    invariants: str = "log",
) -> dict[str, Any]:
    """Extra keyword arguments for ``LLM(...)`` / ``EngineArgs`` / ``AsyncEngineArgs`` that turn vToken on.

    Returns ``scheduler_cls``, ``worker_cls``, ``additional_config`` and ``block_size``. With
    ``cfg.mode == "none"`` it returns only ``block_size`` (vanilla vLLM, no hooks), and with
    ``admission_tpot_ms`` set also the scheduler and its ``additional_config`` (SLO-aware admission on vanilla
    vLLM's KV accounting; the worker stays vLLM's). Raises ``ConfigError``
    for invalid settings, including a block size the installed vLLM cannot run (before any engine starts).
    ``invariants``: what a KV invariant violation does (``log`` | ``fatal`` | ``off``;
    vtoken/vllm/scheduling/invariants.py).
    """
    cfg = cfg if cfg is not None else VTokenConfig()
    check_platform_block_size(cfg.block_size)
    settings = EngineSettings(
        cfg=cfg,
        scores=scores,
        trace_dir=trace_dir,
        check=check,
        admission_tpot_ms=admission_tpot_ms,
        invariants=invariants,
    )
    if not settings.enabled:
        if settings.admission is None:
            return {"block_size": cfg.block_size}
        return {
            "scheduler_cls": SCHEDULER_CLS,
            "additional_config": {"vtoken": settings.to_additional_config()},
            "block_size": cfg.block_size,
        }
    return {
        "scheduler_cls": SCHEDULER_CLS,
        "worker_cls": WORKER_CLS,
        "additional_config": {"vtoken": settings.to_additional_config()},
        "block_size": cfg.block_size,
    }


__all__ = ["SCHEDULER_CLS", "WORKER_CLS", "engine_kwargs"]
