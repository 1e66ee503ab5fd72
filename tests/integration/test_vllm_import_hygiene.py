"""Importing what vLLM imports by name leaves torch as torch defines it (issue 24, defect 1).

vLLM imports ``--scheduler-cls``, ``--worker-cls`` and the ``vllm.general_plugins`` entry point in every
process it starts, CUDA workers included. vLLM's CPU worker module replaces ``torch.cuda.Event``, streams,
``Tensor.pin_memory`` and more process-wide when imported (``vllm.v1.worker.cpu.shm``); a vToken module that
imported it at module level would silently switch off CUDA events, stream ordering and pinned memory in
every CUDA worker. Each check runs in a fresh interpreter (this test process already has vLLM's CPU worker
loaded by other tests).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# What vllm/v1/worker/cpu/shm.py (vLLM 0.32) replaces: (module, attribute) pairs read before and after.
PATCHED_BY_CPU_WORKER = [
    ("torch", "Event"),
    ("torch.cuda", "Event"),
    ("torch.cuda", "Stream"),
    ("torch.cuda", "set_stream"),
    ("torch.cuda", "current_stream"),
    ("torch.cuda", "stream"),
    ("torch.accelerator", "synchronize"),
    ("torch.accelerator", "empty_cache"),
    ("torch.accelerator", "get_memory_info"),
    ("torch.Tensor", "pin_memory"),
    ("torch.Tensor", "record_stream"),
    ("vllm.utils.torch_utils", "async_tensor_h2d"),
]

_PROBE = r"""
import importlib, json, sys
import torch, vllm.utils.torch_utils
pairs = json.loads(sys.argv[1])
def resolve(mod):
    obj = importlib.import_module(mod.split(".")[0])
    for part in mod.split(".")[1:]:
        obj = getattr(obj, part)
    return obj
before = {f"{m}.{a}": getattr(resolve(m), a) for m, a in pairs}
from vtoken.vllm import SCHEDULER_CLS, WORKER_CLS, engine_kwargs
from vtoken.core.config import VTokenConfig
names = {engine_kwargs(VTokenConfig(block_size=32))[k] for k in ("scheduler_cls", "worker_cls")}
assert names == {SCHEDULER_CLS, WORKER_CLS}, names
for name in sorted(names) + [sys.argv[2]]:
    module, _, attr = name.rpartition(".")
    getattr(importlib.import_module(module), attr)
importlib.import_module("vtoken.vllm.plugin").register()
changed = sorted(k for k, v in before.items()
                 if getattr(resolve(k.rpartition(".")[0]), k.rpartition(".")[2]) is not v)
loaded = sorted(m for m in sys.modules if m in ("vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu.shm",
                                                 "vtoken.vllm.runner.cpu"))
print(json.dumps({"changed": changed, "loaded": loaded}))
"""


def _probe(extra: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(PATCHED_BY_CPU_WORKER), extra],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "extra", ["vtoken.vllm.runner.gpu.VTokenGPUWorker", "vtoken.vllm.runner.step_result.DeferredResultOutput"]
)
def test_importing_the_named_classes_leaves_cuda_events_streams_and_pinned_memory_alone(extra):
    got = _probe(extra)
    assert got == {"changed": [], "loaded": []}, (
        "importing vToken's scheduler/worker/plugin (what vLLM imports in a CUDA worker) replaced torch's "
        f"CUDA APIs or loaded vLLM's CPU worker: {got}"
    )


def test_the_cpu_platform_still_gets_the_cpu_worker():
    """The probe above is not vacuous: on the CPU platform the CPU classes load when the worker is built."""
    from vllm.platforms import current_platform

    from vtoken.vllm.runner.worker_base import VTokenWorkerBase
    from vtoken.vllm.worker import platform_worker_class

    assert current_platform.is_cpu()
    cls = platform_worker_class()
    assert cls.__module__ == "vtoken.vllm.runner.cpu" and issubclass(cls, VTokenWorkerBase)
    import torch
    from vllm.v1.worker.cpu import shm  # noqa: F401  (what loading the CPU class loads)

    assert torch.cuda.Event is shm._EventPlaceholder  # the hazard the probe guards against is real
