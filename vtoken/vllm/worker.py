"""vToken's worker: ``worker_cls="vtoken.vllm.worker.VTokenWorker"`` (``--worker-cls``) on every platform.

``worker_extension_cls`` can only *add* methods, and the model runner's methods must be overridden, so
vToken ships a worker class. ``VTokenWorker`` is the one name to use: constructing it builds the
implementation for vLLM's current platform (``platform_worker_class``)::

    CPU    VTokenCPUWorker = VTokenWorkerBase + vLLM's CPUWorker; init_device switches the fresh V1
           CPUModelRunner instance to VTokenCPUModelRunner (probed CPU layout, torch mover and scores;
           vtoken/vllm/runner/cpu.py, imported only there)
    CUDA   VTokenGPUWorker = VTokenWorkerBase + vLLM's GPU Worker; _make_model_runner builds
           VTokenGPUModelRunner (layout from the cache view's strides, Triton mover and scores;
           vtoken/vllm/runner/gpu.py, imported only there)

Both share ``VTokenWorkerBase`` (vtoken/vllm/runner/worker_base.py): before vLLM's own constructor runs it
validates the vToken settings, refuses engine configurations vToken cannot keep exact and applies
``vtoken.vllm.engine_setup``'s choices to the engine's config. ``VTokenWorker(...)`` returns the platform
worker, built; the platform modules never import this one (imports run one way). Nothing is patched at
import time or globally.

Importing this module imports no platform's worker: vLLM imports it in *every* worker process to resolve
``--worker-cls``, and vLLM's CPU worker module (``vllm.v1.worker.cpu_worker``) replaces ``torch.cuda.Event``,
streams, ``Tensor.pin_memory`` and more process-wide when it is imported (``vllm.v1.worker.cpu.shm``), which
on a CUDA worker would break event timing, vLLM's async output copy and memory profiling. Each platform's
classes are imported by ``platform_worker_class`` only on that platform
(``tests/integration/test_vllm_import_hygiene.py``).
"""

from __future__ import annotations

from vtoken.errors import ConfigError
from vtoken.vllm.runner.worker_base import VTokenWorkerBase


class VTokenWorker(VTokenWorkerBase):
    """The name vLLM is configured with: constructing it returns the current platform's worker, built (an
    instance of that class, not of this one, so Python does not run ``__init__`` twice). A user subclass
    is built as itself, with ``VTokenWorkerBase``'s start-up."""

    def __new__(cls, *args, **kwargs):
        if cls is VTokenWorker:
            return platform_worker_class()(*args, **kwargs)
        return super().__new__(cls)


def platform_worker_class(platform=None) -> type[VTokenWorkerBase]:
    """The vToken worker class for ``platform`` (default: vLLM's current platform). Raises ``ConfigError`` on
    a platform vToken does not run on."""
    if platform is None:
        from vllm.platforms import current_platform as platform
    if platform.is_cpu():
        from vtoken.vllm.runner.cpu import VTokenCPUWorker

        return VTokenCPUWorker
    if platform.is_cuda():
        from vtoken.vllm.runner.gpu import VTokenGPUWorker

        return VTokenGPUWorker
    raise ConfigError(f"vToken runs on vLLM's CPU and CUDA platforms, not on {platform.device_name!r}")
