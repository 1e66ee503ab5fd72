"""Tensor parallelism on vLLM's CPU platform (multiprocess executor, one core per rank, 1 GiB KV pool):
with TP = 2 every policy generates exactly the TP = 1 tokens and matches the masked Hugging Face reference,
on a GQA model (tiny Llama, 2 KV heads: one per rank) and an MQA model (tiny Qwen2, 1 KV head replicated on
both ranks: its key norms must not be counted twice). Scores are all-reduced over the TP group
(vtoken/vllm/runner/tp.py); one TP = 2 engine per model.
"""

from __future__ import annotations

import os

import pytest
from support.cli import last_json_line, run_vtoken
from support.engine import verify_on_engine

from vtoken.vllm.offline.launch import start_engine
from vtoken.vllm.offline.verify import VerifyCase

pytestmark = pytest.mark.slow

POLICIES = ["h2o", "tova", "scissorhands", "knorm", "random", "streamingllm", "rkv"]
CASES = [VerifyCase(p, mode, 0.3) for p in POLICIES for mode in ("repack", "naive")]  # every case paired
TOL = 1e-4


def _run(path, tp: int, trace_dir: str, ref):
    os.makedirs(trace_dir, exist_ok=True)
    llm = start_engine(str(path), 32, trace_dir, tensor_parallel_size=tp)
    return verify_on_engine(llm, path, 32, CASES, trace_dir, 182, ref=ref)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tp2_equals_tp1_and_the_masked_reference(arch, tmp_path):
    from vtoken.models.hf_reference import load_reference_model
    from vtoken.models.tiny import tiny_model

    path = tiny_model(arch)
    ref = load_reference_model(path)
    one = _run(path, 1, str(tmp_path / "tp1"), ref)
    two = _run(path, 2, str(tmp_path / "tp2"), ref)
    for a, b in zip(one, two):
        key = b.case.key()
        assert b.evicted_tokens > 0, key
        assert b.match and b.max_abs_logprob_diff <= TOL, (key, b.max_abs_logprob_diff)
        assert b.tokens == a.tokens, f"{key}: TP=2 tokens differ from TP=1"
        assert b.evicted_tokens == a.evicted_tokens and b.moves == a.moves, key
        assert b.paired_naive_match is True, key  # repack and naive of one policy: the same tokens


def test_vtoken_verify_tensor_parallel_cli():
    """`vtoken verify --tensor-parallel-size 2 --json`: the same report, exact, on the MQA model."""
    proc = run_vtoken(
        "verify",
        "--model",
        "tiny-qwen2",
        "--policy",
        "knorm",
        "--budget",
        "0.3",
        "--mode",
        "repack",
        "--tensor-parallel-size",
        "2",
        "--json",
        timeout=500,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = last_json_line(proc)
    assert report["tensor_parallel_size"] == 2 and report["match"] and report["paired_naive_match"]
    assert report["evicted_tokens"] > 0 and report["max_abs_logprob_diff"] <= TOL


def test_vtoken_bench_capacity_tensor_parallel():
    """`vtoken bench capacity --tensor-parallel-size 2`: the same report (its setup fields gain
    tensor_parallel_size), and
    the probes and the burst run on the TP = 2 engine (every request of the burst finishes)."""
    import json

    proc = run_vtoken(
        "bench",
        "capacity",
        "--kv-blocks",
        "12",
        "--prompt-len",
        "64",
        "--gen-len",
        "16",
        "--requests",
        "4",
        "--repeats",
        "1",
        "--modes",
        "repack",
        "--tensor-parallel-size",
        "2",
        timeout=500,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert "--tensor-parallel-size 2" in report["command"]
    assert report["tensor_parallel_size"] == 2
    burst = report["modes"]["repack"]["burst"]
    assert burst["finished"] == burst["requests"] == 4 and report["modes"]["repack"]["max_feasible_concurrency"] >= 1
