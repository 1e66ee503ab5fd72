"""``vtoken bench kernels`` and ``scripts/gpu_check.py`` from the outside (subprocesses), as people run them.

No GPU here: the Triton backend runs in Triton's interpreter (``TRITON_INTERPRET=1``, as docs/gpu.md says
to run it), the GPU check in its ``--dry-run`` mode. What is asserted is the contract: the JSON fields,
exact moves, scores within 1e-4, exit status 2 and a message naming each bad value, and that the GPU check
imports nothing but torch, triton, numpy and vToken's kernel modules.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.paths import ROOT

VTOKEN = str(Path(sys.executable).with_name("vtoken"))
SHAPE = [
    "--layers",
    "2",
    "--kv-heads",
    "2",
    "--q-heads",
    "4",
    "--head-dim",
    "64",
    "--block-size",
    "16",
    "--blocks",
    "24",
    "--requests",
    "4",
    "--seed",
    "0",
]


def run(args: list[str], interpret: bool = True, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1" if interpret else "0")
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.slow
@pytest.mark.parametrize("backend,layout", [("triton", "flash_attn"), ("torch", "cpu")])
def test_bench_kernels_reports_exact_moves_and_close_scores(tmp_path, backend, layout):
    out = tmp_path / "k.json"
    proc = run(
        [
            VTOKEN,
            "bench",
            "kernels",
            "--backend",
            backend,
            "--device",
            "cpu",
            "--layout",
            layout,
            *SHAPE,
            "--json",
            "--out",
            str(out),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report == json.loads(out.read_text())
    assert report["command"].startswith("vtoken bench kernels --backend " + backend)
    assert (report["backend"], report["layout"], report["device"]) == (backend, layout, "cpu")
    assert report["kv_cache_layout"] == ("LBNHC" if layout == "flash_attn" else "cpu (vec ISA)")
    plan = report["plan"]
    assert plan["requests"] == 4 and plan["moves"] > 0 and plan["ranges_overlap"]
    assert report["moves_exact"] is True and report["moves_mismatched_elements"] == 0
    assert 0 <= report["scores_max_abs_err"] <= 1e-4 and report["scores_bits_ok"] is True
    assert report["bits_mismatched"] == report["bits_mismatched_near_threshold"] == 0
    assert report["environment"]["torch"] and "timings" not in report  # timings only on CUDA


def test_bench_kernels_runs_the_lhbnc_layout_and_counts_bit_mismatches():
    """``--layout LHBNC`` (heads outside blocks: the layout whose layer views pass 2^31 elements at H200
    scale) in-process, the interpreter; the report counts the bits' mismatches instead of one boolean."""
    from vtoken.bench.engine.kernels import problems, run_kernels
    from vtoken.kernels.backend_check import Shape

    assert problems("triton", "cpu", "LHBNC", "float16", {"--blocks": 8}, 4, 2) == []
    report = run_kernels("triton", "cpu", "LHBNC", Shape(2, 2, 4, 64, 16, 8, torch.float16), 3, 0, 16)
    assert report["kv_cache_layout"] == "LHBNC" and report["moves_exact"], report
    assert report["scores_max_abs_err"] <= 1e-4 and report["scores_bits_ok"] is True, report
    assert report["bits_mismatched"] >= report["bits_mismatched_near_threshold"] >= 0
    assert report["bits_near_tie_rtol"] > 0 and "scores_bits_equal" not in report


@pytest.mark.slow
def test_bench_kernels_refuses_bad_values_naming_them():
    proc = run(
        [
            VTOKEN,
            "bench",
            "kernels",
            "--backend",
            "cutlass",
            "--layout",
            "NHDX",
            "--dtype",
            "int8",
            "--q-heads",
            "3",
            "--blocks",
            "0",
            "--device",
            "tpu",
        ]
    )
    assert proc.returncode == 2 and proc.stdout == ""
    for named in (
        "--backend 'cutlass'",
        "--layout 'NHDX'",
        "--dtype 'int8'",
        "--q-heads 3",
        "--blocks 0",
        "--device 'tpu'",
    ):
        assert named in proc.stderr, (named, proc.stderr)
    proc = run([VTOKEN, "bench", "kernels", "--device", "cuda"])  # this machine has no GPU
    assert proc.returncode == 2 and "--device 'cuda'" in proc.stderr


@pytest.mark.slow
def test_gpu_check_dry_run_exercises_every_section(tmp_path):
    """Correctness on several layouts, bandwidth, scores vs attention, the step loop (eager: no CUDA
    graphs on a CPU), one report; nothing imported beyond torch, triton, numpy and vtoken's kernels."""
    out = tmp_path / "gpu.json"
    proc = run([sys.executable, "scripts/gpu_check.py", "--dry-run", "--out", str(out)], interpret=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["dry_run"] is True and report["forbidden_modules_loaded"] == []
    for section in ("warmup", "correctness", "bandwidth", "scores_vs_attention", "graph_loop"):
        assert "error" not in report[section] and "skipped" not in report[section], report[section]
    rows = report["correctness"]
    for name in ("cpu", "LHBNC", "BLHNC"):
        assert rows[name]["moves_exact"] and rows[name]["scores_max_abs_err"] <= 1e-4, rows[name]
        assert rows[name]["scores_bits_ok"] and rows[name]["bits_mismatched"] == 0, rows[name]
    assert report["large_offsets"]["skipped"].startswith("needs CUDA")  # 12.9 GB: on the GPU only
    assert report["warmup"]["ok"] and report["warmup"]["caches_unchanged"], report["warmup"]
    assert rows["paged_attention"]["ok"]
    bandwidth = report["bandwidth"]
    assert bandwidth["moves"] > 0 and bandwidth["direct_gb_s"] > 0 and bandwidth["staged_gb_s"] > 0
    assert report["graph_loop"]["cuda_graphs"].startswith("skipped: needs CUDA")
    assert {"eager_ms_plain", "eager_ms_repack", "eager_ms_repack_scores"} <= set(report["graph_loop"])


def test_gpu_check_imports_only_the_kernel_modules():
    """Importing the script's module pulls none of vLLM, typer, rich, ray, transformers, pydantic."""
    code = (
        "import runpy, sys; runpy.run_path('scripts/gpu_check.py', run_name='not_main'); "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('vllm', 'typer', 'rich', 'ray', 'transformers', 'pydantic')); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = run([sys.executable, "-c", code], interpret=False, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]


def test_gpu_check_without_a_gpu_and_without_dry_run_exits_2():
    proc = run([sys.executable, "scripts/gpu_check.py", "--out", os.devnull], interpret=False, timeout=300)
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr
