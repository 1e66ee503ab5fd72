"""vToken's worker: ``worker_cls="vtoken.vllm.worker.VTokenWorker"`` (``--worker-cls``) on every platform.

``worker_extension_cls`` can only *add* methods, and the model runner's methods must be overridden, so
vToken ships a worker class. ``VTokenWorker`` is the one name to use: constructing it builds the
implementation for vLLM's current platform (``platform_worker_class``)::

    CPU    VTokenCPUWorker = VTokenWorker + vLLM's CPUWorker; init_device switches the fresh V1
           CPUModelRunner instance to VTokenCPUModelRunner (probed CPU layout, torch mover and scores;
           vtoken/vllm/runner/cpu.py, imported only there)
    CUDA   VTokenGPUWorker = VTokenWorker + vLLM's GPU Worker; _make_model_runner builds
           VTokenGPUModelRunner (layout from the cache view's strides, Triton mover and scores;
           vtoken/vllm/runner/gpu.py, imported only there)

Before vLLM's own constructor runs, ``VTokenWorker.__init__`` validates the vToken settings and refuses
engine configurations vToken cannot keep exact (``check_engine_config``: a bad value or an unsupported
feature fails start-up in seconds, before the model loads) and applies the engine choices of
``vtoken.vllm.engine_setup`` to this engine's config: vLLM's V1 model runner, and PIECEWISE CUDA graphs
for attention statistics from every layer (a ``score_layers`` subset keeps vLLM's graphs: its queries are
copied inside them, ``vtoken/vllm/runner/score_capture.py``). Nothing is patched at import time or globally.

Importing this module imports no platform's worker: vLLM imports it in *every* worker process to resolve
``--worker-cls``, and vLLM's CPU worker module (``vllm.v1.worker.cpu_worker``) replaces ``torch.cuda.Event``,
streams, ``Tensor.pin_memory`` and more process-wide when it is imported (``vllm.v1.worker.cpu.shm``), which
on a CUDA worker would break event timing, vLLM's async output copy and memory profiling. Each platform's
classes are imported by ``platform_worker_class`` only on that platform
(``tests/integration/test_vllm_import_hygiene.py``).
"""

from __future__ import annotations

from vllm.v1.worker.gpu_worker import Worker

from vtoken.errors import ConfigError


class VTokenWorker(Worker):
    """The vToken worker for vLLM's current platform (constructing it returns the platform's subclass)."""

    def __new__(cls, *args, **kwargs):
        return super().__new__(platform_worker_class() if cls is VTokenWorker else cls)

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        from vtoken.vllm.config import EngineSettings
        from vtoken.vllm.engine_setup import prepare_engine
        from vtoken.vllm.internals import check_vllm_version

        check_vllm_version()
        # The scheduler, which owns the settings, is built after the KV cache is sized: validate here too.
        settings = EngineSettings.from_additional_config(
            vllm_config.additional_config, vllm_config.cache_config.block_size
        )
        if settings.enabled:  # what the config alone refuses, before the model loads (vtoken/vllm/supported_configs.py)
            from vtoken.vllm.supported_configs import check_engine_config

            check_engine_config(vllm_config)
        prepare_engine(vllm_config, settings)  # V1 runner, CUDA-graph mode: before vLLM reads them
        super().__init__(vllm_config, *args, **kwargs)


def platform_worker_class(platform=None) -> type[VTokenWorker]:
    """The ``VTokenWorker`` subclass for ``platform`` (default: vLLM's current platform). Raises
    ``ConfigError`` on a platform vToken does not run on."""
    if platform is None:
        from vllm.platforms import current_platform as platform
    if platform.is_cpu():
        from vtoken.vllm.runner.cpu import VTokenCPUWorker

        return VTokenCPUWorker
    if platform.is_cuda():
        from vtoken.vllm.runner.gpu import VTokenGPUWorker

        return VTokenGPUWorker
    raise ConfigError(f"vToken runs on vLLM's CPU and CUDA platforms, not on {platform.device_name!r}")
