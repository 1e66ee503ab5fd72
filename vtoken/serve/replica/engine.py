"""Engine construction for one replica: model path, CPU binding, ``AsyncEngineArgs`` with vToken on.

``engine_args`` is pure (config in, kwargs out); ``bind_cpus`` is the one function that mutates the
process environment, and says so. vToken is switched on by the integration's own
``vtoken.vllm.engine_kwargs(VTokenConfig)`` — the serving layer does not know vLLM's hook names.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any

from vtoken.core.config import Trigger, VTokenConfig
from vtoken.serve.config import ServeAppConfig


class VTokenUnavailableError(RuntimeError):
    """vToken reclamation was requested but the vLLM integration (``vtoken.vllm``) is not installed."""


def vtoken_engine_kwargs(cfg: VTokenConfig, admission_tpot_ms: float | None = None) -> dict[str, Any]:
    """Extra ``AsyncEngineArgs`` kwargs from ``vtoken.vllm.engine_kwargs`` (scheduler/worker classes,
    ``additional_config``, block size; only the block size for mode ``none`` without admission).

    Raises ``VTokenUnavailableError`` when an evicting mode is configured without the integration.
    """
    try:
        from vtoken.vllm import engine_kwargs
    except ImportError as exc:
        if not cfg.mode.evicts and admission_tpot_ms is None:
            return {"block_size": cfg.block_size}
        raise VTokenUnavailableError(
            f"vToken mode {cfg.mode.value!r} needs vtoken.vllm.engine_kwargs, which is not available "
            f"({exc}); use vtoken.mode='none' to serve vanilla vLLM"
        ) from None
    return dict(engine_kwargs(cfg, admission_tpot_ms=admission_tpot_ms))


def resolve_model_path(spec: str) -> str:
    """A local checkpoint directory for ``spec`` ('default', 'tiny-llama', a directory, or an HF id).

    Side effect: may build/convert the model into the vToken cache on first use.
    """
    from vtoken.models.default import resolve_model

    try:
        return str(resolve_model(spec))
    except (ValueError, FileNotFoundError):
        if os.path.isdir(spec):
            raise
        return spec  # a Hugging Face id: vLLM resolves it (HF_HUB_OFFLINE decides if that may download)


def engine_args(cfg: ServeAppConfig, model_path: str) -> dict[str, Any]:
    """Keyword arguments for ``vllm.engine.arg_utils.AsyncEngineArgs`` (pure)."""
    e = cfg.engine
    kwargs: dict[str, Any] = dict(
        model=model_path,
        served_model_name=[cfg.model_name],
        dtype=e.dtype,
        enforce_eager=e.enforce_eager,
        block_size=cfg.vtoken.block_size,
        max_model_len=e.max_model_len,
        max_num_seqs=e.max_num_seqs,
        disable_log_stats=False,  # the stat-logger path feeds routing, autoscaling and metrics
    )
    if e.tensor_parallel_size > 1:  # ranks in the replica's placement-group bundles (launch/app.py)
        kwargs["tensor_parallel_size"] = e.tensor_parallel_size
        kwargs["distributed_executor_backend"] = "ray" if cfg.deployment.gpus_per_rank else "mp"
    if e.kv_cache_dtype != "auto":
        kwargs["kv_cache_dtype"] = e.kv_cache_dtype
    if e.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = e.max_num_batched_tokens
    if e.enable_prefix_caching is not None:
        kwargs["enable_prefix_caching"] = e.enable_prefix_caching
    if e.kv_cache_blocks is not None:
        kwargs["num_gpu_blocks_override"] = e.kv_cache_blocks
        kwargs["kv_cache_memory_bytes"] = max(64 << 20, int(e.kv_cache_gib * (1 << 30)) // 16)
    else:
        kwargs["kv_cache_memory_bytes"] = int(e.kv_cache_gib * (1 << 30))
    kwargs.update(vtoken_engine_kwargs(cfg.vtoken, cfg.slo.tpot_ms if cfg.slo.admission else None))
    return kwargs


def cpu_binding(cfg: ServeAppConfig, local_rank: int, ncpu: int | None = None) -> str:
    """The ``VLLM_CPU_OMP_THREADS_BIND`` list for the replica with ``local_rank`` (pure).

    Without ``engine.threads_per_replica`` the node's cores are split evenly between the most replicas
    the deployment may run (vLLM's default ``auto`` pins every replica's worker to core 0).
    """
    ncpu = ncpu or os.cpu_count() or 1
    most = cfg.autoscaling.max_replicas if cfg.autoscaling.enabled else cfg.deployment.num_replicas
    per = cfg.engine.threads_per_replica or max(1, (ncpu - cfg.engine.cpu_offset) // max(1, most))
    first = (cfg.engine.cpu_offset + local_rank * per) % ncpu
    last = min(ncpu - 1, first + per - 1)
    tp = cfg.engine.tensor_parallel_size
    if tp > 1:  # one list per TP rank, '|'-separated (vLLM's CPU worker r binds list r)
        cores = list(range(first, last + 1))
        n = max(1, len(cores) // tp)
        ranks = [cores[r * n : (r + 1) * n] if len(cores) >= tp else [cores[r % len(cores)]] for r in range(tp)]
        return "|".join(str(c[0]) if len(c) == 1 else f"{c[0]}-{c[-1]}" for c in ranks)
    return str(first) if first == last else f"{first}-{last}"


def preflight(cfg: ServeAppConfig, model_path: str) -> None:
    """Refuse, before anything starts, an engine this config cannot start or vToken cannot keep exact
    (raises ``ConfigError`` naming the setting or feature; ``vtoken serve`` exits with it). Builds vLLM's
    engine config from ``engine_args`` (reads the model's config, loads no weights), then checks a fixed
    pool (``engine.kv_cache_blocks``) against what vLLM needs in every KV cache group (``pool_need``; any
    mode) and runs vToken's start-up checks (evicting modes; ``trigger: pressure``'s own refusals)."""
    if cfg.engine.kv_cache_blocks is None and not cfg.vtoken.mode.evicts:
        return
    from vllm.engine.arg_utils import AsyncEngineArgs

    from vtoken.vllm.supported_configs import check_engine_config

    vllm_config = AsyncEngineArgs(**engine_args(cfg, model_path)).create_engine_config()
    check_pool(cfg, vllm_config)
    if cfg.vtoken.mode.evicts:
        check_engine_config(vllm_config)
    if cfg.vtoken.trigger is Trigger.PRESSURE:
        from vtoken.vllm.scheduling.pool_need import pool_shape
        from vtoken.vllm.scheduling.pressure import pressure_refusal, refuse_pressure

        why = pressure_refusal(vllm_config, len(pool_shape(vllm_config).windows))
        if why is not None:
            raise refuse_pressure(why)


def check_pool(cfg: ServeAppConfig, vllm_config) -> None:
    """Raise ``ConfigError`` when ``engine.kv_cache_blocks`` is under what vLLM needs to start: room for
    one ``max_model_len`` request in each of the model's KV cache groups (a hybrid model has several)."""
    from vtoken.errors import ConfigError
    from vtoken.vllm.scheduling.pool_need import pool_shape

    blocks, length = cfg.engine.kv_cache_blocks, cfg.engine.max_model_len
    shape = pool_shape(vllm_config)
    if blocks is not None and blocks < shape.need(length):
        raise ConfigError(
            f"engine.kv_cache_blocks {blocks} is too small for engine.max_model_len {length}: vLLM keeps "
            f"room for one such request in each of the model's {len(shape.windows)} KV cache group(s): "
            f"{shape.describe(length)} = {shape.need(length)} blocks. Raise engine.kv_cache_blocks to "
            f"{shape.need(length)} or lower engine.max_model_len to {shape.longest_len(blocks)}"
        )


def bind_cpus(cfg: ServeAppConfig, local_rank: int) -> str:
    """Set ``VLLM_CPU_OMP_THREADS_BIND`` for the engine this process will spawn (mutates
    ``os.environ``) unless the operator set it explicitly. Returns the binding in effect."""
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto":
        return os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(cfg, local_rank)
    return os.environ["VLLM_CPU_OMP_THREADS_BIND"]


def engine_exits_with_replica() -> None:
    """Make the engine processes this replica will start exit when it dies, by any means (mutates
    ``os.environ``: they inherit ``EXIT_WITH_PARENT_ENV``; vtoken/vllm/lifetime.py)."""
    from vtoken.vllm.lifetime import EXIT_WITH_PARENT_ENV

    os.environ[EXIT_WITH_PARENT_ENV] = "1"


@contextlib.contextmanager
def refusal_reported():
    """Around an engine start: a vToken start-up refusal raised inside the engine's processes re-raises
    here as ``ConfigError`` with its own message (vLLM reports only "Engine core initialization failed").
    Side effects: sets ``$VTOKEN_REFUSAL_FILE`` in this process (the engine's processes inherit it; the
    refusal is written there, ``vtoken.vllm.supported_configs``) to a temp file, removed on exit."""
    from vtoken.errors import ConfigError
    from vtoken.vllm.supported_configs import REFUSAL_FILE_ENV

    fd, path = tempfile.mkstemp(prefix="vtoken-refusal-")
    os.close(fd)
    os.environ[REFUSAL_FILE_ENV] = path
    try:
        yield
    except Exception as exc:
        with open(path, encoding="utf-8") as f:
            refusal = f.readline().strip()
        if refusal and not isinstance(exc, ConfigError):
            raise ConfigError(refusal) from exc
        raise
    finally:
        os.environ.pop(REFUSAL_FILE_ENV, None)
        os.unlink(path)
