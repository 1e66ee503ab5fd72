"""``VTokenWorkerBase``: what every vToken worker does before vLLM's own worker constructor runs.

It validates the engine's vToken settings, refuses engine configurations vToken cannot keep exact
(``check_engine_config``: a bad value or an unsupported feature fails start-up in seconds, before the model
loads) and applies ``vtoken.vllm.engine_setup``'s choices to this engine's config: vLLM's V1 model runner,
and PIECEWISE CUDA graphs for attention statistics from every layer (a ``score_layers`` subset keeps vLLM's
graphs: its queries are copied inside them, ``runner/score_capture.py``). The platform workers
(``runner/cpu.py``, ``runner/gpu.py``) subclass it; ``vtoken.vllm.worker.VTokenWorker``, the name vLLM is
configured with, builds the current platform's. Importing this module imports no platform's worker.
"""

from __future__ import annotations

from vllm.v1.worker.gpu_worker import Worker


class VTokenWorkerBase(Worker):
    """vLLM's worker with vToken's start-up checks and engine choices (see the module docstring). Mutates
    ``vllm_config`` (runner and CUDA-graph choices) before ``Worker.__init__`` reads it."""

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        from vtoken.vllm.config import EngineSettings
        from vtoken.vllm.engine_setup import prepare_engine
        from vtoken.vllm.internals import check_vllm_version

        check_vllm_version()
        # The scheduler, which owns the settings, is built after the KV cache is sized: validate here too.
        settings = EngineSettings.from_additional_config(
            vllm_config.additional_config, vllm_config.cache_config.block_size
        )
        if settings.enabled:  # what the config alone refuses, before the model loads (vllm/supported_configs.py)
            from vtoken.vllm.supported_configs import check_engine_config

            check_engine_config(vllm_config)
        prepare_engine(vllm_config, settings)  # V1 runner, CUDA-graph mode: before vLLM reads them
        super().__init__(vllm_config, *args, **kwargs)
