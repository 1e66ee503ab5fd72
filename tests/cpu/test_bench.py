"""`vtoken bench …`: the commands run, print what they measured as JSON with the command, and reject bad
input with a message naming the value. Numbers are never asserted as wall-clock targets; what is asserted
is deterministic (the engine is stepped in-process, so admission and preemption repeat exactly)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

VTOKEN = str(Path(sys.executable).with_name("vtoken"))


def vtoken(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([VTOKEN, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_capacity_repack_fits_more_concurrent_requests_than_naive_in_the_same_pool(tmp_path):
    out = tmp_path / "cap.json"
    run = vtoken("bench", "capacity", "--kv-blocks", "24", "--prompt-len", "64", "--gen-len", "32",
                 "--requests", "8", "--repeats", "1", "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert json.loads(run.stdout) == report and report["command"].startswith("vtoken bench capacity")
    modes = report["modes"]
    assert set(modes) == {"naive", "repack", "reuse+repack"}
    for mode, row in modes.items():
        k = row["max_feasible_concurrency"]
        verdict = {p["k"]: p["feasible"] for p in row["probes"]}
        assert verdict[k] and verdict.get(k + 1) is False, (mode, verdict)  # the boundary was probed
        assert all(ok == (kk <= k) for kk, ok in verdict.items()), (mode, verdict)  # monotone
        burst = row["burst"]
        assert burst["finished"] == burst["requests"] == 8 and 0 <= burst["sla_attainment"] <= 1
        assert burst["throughput_tok_s"] > 0 and burst["peak_running"] <= 8
    naive, repack = modes["naive"]["max_feasible_concurrency"], modes["repack"]["max_feasible_concurrency"]
    assert repack > naive >= 1
    assert modes["reuse+repack"]["max_feasible_concurrency"] >= naive
    assert report["ratios_vs_naive"]["repack"]["max_feasible_concurrency"] == round(repack / naive, 3)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--modes", "repack,bogus"], "bogus"),
        (["--kv-blocks", "1"], "--kv-blocks 1"),
        (["--requests", "0"], "--requests 0"),
        (["--repeats", "0"], "--repeats 0"),
        (["--ttft-slo", "-1"], "--ttft-slo -1"),
        (["--policy", "nope"], "nope"),
        (["--budget", "0"], "budget fraction must be in (0, 1], got 0.0"),
        (["--block-size", "33"], "power of two, got 33"),
        (["--block-size", "16"], "multiple of 32 on vLLM's CPU backend, got 16"),
        (["--model", "/no/such/model"], "/no/such/model"),
    ],
)
def test_capacity_bad_input_exits_2_naming_the_value(args, named):
    run = vtoken("bench", "capacity", *args, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    assert named in run.stderr and "Traceback" not in run.stderr
    assert run.stdout == ""


@pytest.mark.parametrize("command", [["bench", "overhead"], ["verify", "--model", "tiny-llama", "--json"]])
def test_engine_commands_refuse_a_block_size_the_cpu_backend_cannot_run(command):
    run = vtoken(*command, "--block-size", "16", timeout=120)
    assert run.returncode == 2 and "multiple of 32 on vLLM's CPU backend, got 16" in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr


def test_retained_grid_prints_json_with_the_command(tmp_path):
    run = vtoken("bench", "retained", "--policies", "h2o,random", "--budgets", "0.2", "--block-sizes", "16",
                 "--prompt-len", "96", "--gen-len", "32", "--requests", "4", "--out", str(tmp_path / "r.json"))
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout)
    assert json.loads((tmp_path / "r.json").read_text()) == report
    assert report["command"].startswith("vtoken bench retained") and len(report["rows"]) == 2
    for row in report["rows"]:
        assert row["repack"] == pytest.approx(row["packing_bound"]) and row["repack"] <= row["naive"]


def test_committed_results_are_reports_with_the_command_that_made_them():
    results = sorted((Path(__file__).resolve().parents[2] / "docs" / "results").glob("*.json"))
    assert results
    for path in results:
        report = json.loads(path.read_text())
        assert report["command"].startswith("vtoken "), path.name
