"""vToken's worker and runner for vLLM's CPU platform (what ``VTokenWorker`` builds there).

Imported only on vLLM's CPU platform (``vtoken.vllm.worker.platform_worker_class``): importing vLLM's CPU
worker module replaces CUDA events, streams and pinned memory process-wide (``vllm.v1.worker.cpu.shm``),
which is harmless on the CPU platform and breaks a CUDA worker.

``VTokenCPUWorker`` is vLLM's ``CPUWorker`` whose ``init_device`` switches the fresh V1 ``CPUModelRunner``
instance to ``VTokenCPUModelRunner``: the mixin with the CPU backend's probed layout (its ISA packs block
interiors), the torch mover and the torch score accumulator.
"""

from __future__ import annotations

from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from vtoken.kernels.gpu_layout import paged_layout
from vtoken.kernels.moves import TorchSlotMover
from vtoken.kernels.scores import ScoreAccumulator
from vtoken.vllm.runner.mixin import VTokenRunnerMixin
from vtoken.vllm.runner.worker_base import VTokenWorkerBase


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
            ops.cpu_attn_reshape_and_cache(k, v, kc, vc, sm, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")

        token_layout = probe_layout(writer, bs, nkv, two_hd // 2, kv.dtype)
        return token_layout, paged_layout(kv, "cpu", token_layout)

    def _vt_make_mover(self, layout):
        return TorchSlotMover(layout)

    def _vt_make_accumulator(self, layout):
        return ScoreAccumulator(layout)


class VTokenCPUWorker(VTokenWorkerBase, CPUWorker):
    """vLLM's CPU worker running ``VTokenCPUModelRunner``."""

    def init_device(self) -> None:
        super().init_device()
        if self.use_v2_model_runner or type(self.model_runner) is not CPUModelRunner:
            got = type(self.model_runner).__name__
            raise RuntimeError(f"vToken hooks vLLM's V1 CPU model runner, got {got}")
        self.model_runner.__class__ = VTokenCPUModelRunner
