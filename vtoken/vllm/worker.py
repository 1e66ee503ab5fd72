"""vToken's worker: ``worker_cls="vtoken.vllm.worker.VTokenWorker"`` (``--worker-cls``) on every platform.

``worker_extension_cls`` can only *add* methods, and the model runner's methods must be overridden, so
vToken ships a worker class. ``VTokenWorker`` is the one name to use: constructing it builds the
implementation for vLLM's current platform (``platform_worker_class``)::

    CPU    VTokenCPUWorker = VTokenWorker + vLLM's CPUWorker; init_device switches the fresh V1
           CPUModelRunner instance to VTokenCPUModelRunner (probed CPU layout, torch mover and scores)
    CUDA   VTokenGPUWorker = VTokenWorker + vLLM's GPU Worker; _make_model_runner builds
           VTokenGPUModelRunner (layout from the cache view's strides, Triton mover and scores;
           vtoken/vllm/gpu_worker.py, imported only there)

Before vLLM's own constructor runs, ``VTokenWorker.__init__`` validates the vToken settings and refuses
engine configurations vToken cannot keep exact (``check_engine_config``: a bad value or an unsupported
feature fails start-up in seconds, before the model loads) and applies the engine choices of
``vtoken.vllm.engine_setup`` to this engine's config: vLLM's V1 model runner, and PIECEWISE CUDA graphs
for attention policies. Nothing is patched at import time or globally.
"""

from __future__ import annotations

from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_worker import Worker

from vtoken.errors import ConfigError
from vtoken.kernels.gpu_layout import paged_layout
from vtoken.kernels.moves import TorchSlotMover
from vtoken.kernels.scores import ScoreAccumulator
from vtoken.vllm.runner import VTokenRunnerMixin


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
        settings = EngineSettings.from_additional_config(vllm_config.additional_config,
                                                         vllm_config.cache_config.block_size)
        if settings.enabled:  # what the config alone refuses, before the model loads (vtoken/vllm/support.py)
            from vtoken.vllm.support import check_engine_config

            check_engine_config(vllm_config)
        prepare_engine(vllm_config, settings)  # V1 runner, CUDA-graph mode: before vLLM reads them
        super().__init__(vllm_config, *args, **kwargs)


def platform_worker_class(platform=None) -> type[VTokenWorker]:
    """The ``VTokenWorker`` subclass for ``platform`` (default: vLLM's current platform). Raises
    ``ConfigError`` on a platform vToken does not run on."""
    if platform is None:
        from vllm.platforms import current_platform as platform
    if platform.is_cpu():
        return VTokenCPUWorker
    if platform.is_cuda():
        from vtoken.vllm.gpu_worker import VTokenGPUWorker

        return VTokenGPUWorker
    raise ConfigError(f"vToken runs on vLLM's CPU and CUDA platforms, not on {platform.device_name!r}")


class VTokenCPUModelRunner(VTokenRunnerMixin, CPUModelRunner):
    """vLLM's V1 CPU model runner with vToken's step hooks (torch mover and scores on the probed layout)."""

    def _vt_make_layout(self, layer):
        """Ask the CPU backend's own cache writer where each token's elements go (its ISA packs blocks)."""
        from vllm import _custom_ops as ops

        from vtoken.kernels.layout import probe_layout

        kv = layer.kv_cache
        _, nkv, bs, two_hd = kv.shape
        isa = getattr(layer, "isa", None)
        if isa is None:
            raise RuntimeError("vToken: the CPU attention layer has no ISA set (backend changed?)")
        if "fp8" in str(getattr(layer.impl, "kv_cache_dtype", "auto")):
            raise RuntimeError("vToken does not support quantized (fp8) KV caches yet")

        def writer(k, v, kc, vc, sm):
            ops.cpu_attn_reshape_and_cache(k, v, kc, vc, sm, isa, k_scale=1.0, v_scale=1.0,
                                           kv_cache_dtype="auto")

        token_layout = probe_layout(writer, bs, nkv, two_hd // 2, kv.dtype)
        return token_layout, paged_layout(kv, "cpu", token_layout)

    def _vt_make_mover(self, layout):
        return TorchSlotMover(layout)

    def _vt_make_accumulator(self, layout):
        return ScoreAccumulator(layout)


class VTokenCPUWorker(VTokenWorker, CPUWorker):
    """vLLM's CPU worker running ``VTokenCPUModelRunner``."""

    def init_device(self) -> None:
        super().init_device()
        if self.use_v2_model_runner or type(self.model_runner) is not CPUModelRunner:
            got = type(self.model_runner).__name__
            raise RuntimeError(f"vToken hooks vLLM's V1 CPU model runner, got {got}")
        self.model_runner.__class__ = VTokenCPUModelRunner
