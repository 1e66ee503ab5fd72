"""vToken's worker class for vLLM's CPU platform (``worker_cls`` / ``--worker-cls``).

``worker_extension_cls`` can only *add* methods, and the model runner's methods must be overridden, so
vToken ships a worker class: vLLM's ``CPUWorker`` whose ``init_device`` switches the freshly built V1
``CPUModelRunner`` instance to ``VTokenCPUModelRunner`` (the same class with ``VTokenRunnerMixin`` in
front; no extra constructor state). Nothing is patched at import time or globally.
"""

from __future__ import annotations

from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from vtoken.vllm.runner import VTokenRunnerMixin


class VTokenCPUModelRunner(VTokenRunnerMixin, CPUModelRunner):
    """vLLM's V1 CPU model runner with vToken's step hooks."""


class VTokenCPUWorker(CPUWorker):
    """vLLM's CPU worker running ``VTokenCPUModelRunner``."""

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        from vtoken.vllm.config import EngineSettings
        from vtoken.vllm.internals import check_vllm_version

        check_vllm_version()
        # Validate the settings here too: the worker starts before the model loads, so a bad value fails
        # start-up in seconds (the scheduler, which owns them, is built after the KV cache is sized).
        EngineSettings.from_additional_config(vllm_config.additional_config, vllm_config.cache_config.block_size)
        super().__init__(vllm_config, *args, **kwargs)

    def init_device(self) -> None:
        super().init_device()
        if self.use_v2_model_runner or type(self.model_runner) is not CPUModelRunner:
            raise RuntimeError(
                "vToken hooks vLLM's V1 model runner; Model Runner V2 is not supported yet: "
                "set VLLM_USE_V2_MODEL_RUNNER=0"
            )
        self.model_runner.__class__ = VTokenCPUModelRunner


VTokenWorker = VTokenCPUWorker
