"""vToken's worker and runner for vLLM's CUDA platform (what ``VTokenWorker`` builds on a GPU).

``VTokenGPUWorker`` is vLLM's GPU ``Worker`` whose ``_make_model_runner`` (vLLM's hook for subclasses) builds
``VTokenGPUModelRunner``: vLLM's V1 ``GPUModelRunner`` with ``VTokenRunnerMixin`` in front and these parts:

    layout   ``paged_layout(layer.kv_cache)``: block/head/token strides of the layer's ``[B, H, N, 2D]`` view
             (vtoken/kernels/gpu_layout.py: LBNHC for FlashAttention, Triton attention, FlashInfer on SM90;
             any ``VLLM_KV_CACHE_LAYOUT``), checked against every layer by the mover
    mover    ``TritonSlotMover``: all moves of the step, every layer, fixed-shape launches on the current
             stream (after the previous step's forward, before this step's)
    scores   ``TritonScoreAccumulator`` on CUDA tensors (``PagedScoreAccumulator``, the torch reference,
             otherwise: the CPU tests drive this class on CPU tensors)

Model Runner V2 is not hooked: ``VTokenWorkerBase.__init__`` pins V1 on the engine's config first
(``vtoken.vllm.engine_setup``). Importable without a GPU (vLLM's CPU build ships the same classes).
"""

from __future__ import annotations

from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vtoken.kernels.gpu_layout import PagedScoreAccumulator, paged_layout
from vtoken.kernels.triton.knorm import TritonKeyNorms
from vtoken.kernels.triton.moves import TritonSlotMover
from vtoken.kernels.triton.scores import TritonScoreAccumulator
from vtoken.vllm.runner.mixin import VTokenRunnerMixin
from vtoken.vllm.runner.step_result import HostReadback
from vtoken.vllm.runner.worker_base import VTokenWorkerBase


class VTokenGPUModelRunner(VTokenRunnerMixin, GPUModelRunner):
    """vLLM's V1 GPU model runner with vToken's step hooks (Triton mover and scores)."""

    def _vt_make_layout(self, layer):
        """The layer view's ``PagedLayout`` (raises on caches vToken cannot address: fp8, kernel blocks)."""
        kv = layer.kv_cache
        if kv.dim() != 4 or kv.shape[3] % 2:
            raise RuntimeError(
                f"vToken: unexpected KV cache view {tuple(kv.shape)} (want [blocks, kv heads, block size, 2*head_dim])"
            )
        if "fp8" in str(getattr(layer.impl, "kv_cache_dtype", "auto")) or kv.element_size() == 1:
            raise RuntimeError("vToken does not support quantized (fp8) KV caches yet")
        block_size = self.cache_config.block_size
        if kv.shape[2] != block_size:
            raise RuntimeError(
                f"vToken: the attention backend splits --block-size {block_size} into kernel blocks of "
                f"{kv.shape[2]} tokens; vToken addresses whole blocks: set --block-size {kv.shape[2]}"
            )
        layout = paged_layout(kv, getattr(self.kv_cache_config, "kv_cache_layout", None) or "cuda")
        return layout, layout

    def _vt_make_mover(self, layout):
        return TritonSlotMover(layout)

    def _vt_make_accumulator(self, layout):
        if self.device.type == "cuda":
            return TritonScoreAccumulator(layout)
        return PagedScoreAccumulator(layout)

    def _vt_make_key_norms(self, layout):
        """CUDA: ``TritonKeyNorms`` (every layer's key norms in one launch); elsewhere the torch loop."""
        return TritonKeyNorms(layout) if self.device.type == "cuda" else None

    def _vt_warmup(self, layers) -> None:
        """CUDA: compile the Triton mover's three variants, the score kernels' one each and the key-norm
        kernel now, on harmless launches that leave every cache byte unchanged (``TritonSlotMover.warmup``,
        ``TritonScoreAccumulator.warmup``, ``TritonKeyNorms.warmup``): otherwise they compile during the
        first requests (seconds of stall; an error under ``--jit-monitor-mode=error``). Runs before vLLM
        captures CUDA graphs."""
        if self.device.type != "cuda":
            return
        impl, mover = layers[0].impl, self._vt_mover
        assert isinstance(mover, TritonSlotMover), "the CUDA runner's mover (_vt_make_mover)"
        mover.warmup(self._vt_kv_tensors)
        self._vt_knorm.warmup(self._vt_kv_tensors)
        TritonScoreAccumulator.warmup(
            self._vt_layout,
            layers[0].kv_cache,
            int(impl.num_heads),
            int(impl.head_size),
            layers[0].kv_cache.dtype,
            float(impl.scale),
        )

    def _vt_make_readback(self):
        """CUDA: async outputs copy the step's statistics on a side stream (``HostReadback``)."""
        if self.device.type == "cuda":
            import torch

            return HostReadback(torch.cuda)
        return None


class VTokenGPUWorker(VTokenWorkerBase):
    """vLLM's GPU worker running ``VTokenGPUModelRunner`` (V1; the engine's config pins it)."""

    def _make_model_runner(self):
        if self.use_v2_model_runner or self.vllm_config.is_mm_encoder_only:
            raise RuntimeError(
                "vToken hooks vLLM's V1 GPU model runner (text generation); this engine "
                "selected another one; see docs/gpu.md"
            )
        return VTokenGPUModelRunner(self.vllm_config, self.device)
