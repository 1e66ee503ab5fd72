"""`vtoken bench …`: the commands run, print what they measured as JSON with the command, and reject bad
input with a message naming the value. Numbers are never asserted as wall-clock targets; what is asserted
is deterministic (the engine is stepped in-process, so admission and preemption repeat exactly)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
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
        assert burst["finished"] == burst["requests"] == 8 == len(burst["ttft_s"]) == len(burst["tpot_s"])
        assert burst["sla_attainment"] in attainments(burst, report["slo"]), (mode, burst, report["slo"])
        assert burst["throughput_tok_s"] > 0 and burst["peak_running"] <= 8
    naive, repack = modes["naive"]["max_feasible_concurrency"], modes["repack"]["max_feasible_concurrency"]
    assert repack > naive >= 1
    assert modes["reuse+repack"]["max_feasible_concurrency"] >= naive


def attainments(burst: dict, slo: dict) -> set[float]:
    """SLA attainment recomputed from the report's own per-request lists: the share of the burst's
    requests whose TTFT and TPOT both meet their SLO. The lists are rounded (TTFT to 1 ms, TPOT to 0.1 ms),
    so a value within half a unit of its SLO may count either way: every possible share is returned."""
    ttft, tpot = np.array(burst["ttft_s"]), np.array(burst["tpot_s"])
    surely = np.sum((ttft < slo["ttft_s"] - 5e-4) & (tpot < slo["tpot_s"] - 5e-5))
    maybe = np.sum((ttft <= slo["ttft_s"] + 5e-4) & (tpot <= slo["tpot_s"] + 5e-5))
    return {round(k / burst["requests"], 4) for k in range(int(surely), int(maybe) + 1)}


def test_sla_attainment_counts_requests_meeting_both_slos():
    """A burst's attainment = requests meeting both SLOs (at most the SLO counts) / requests submitted (an
    unfinished one misses); goodput = those requests per second of the burst."""
    from vtoken.bench.capacity import Outcome, goodput_row

    out = Outcome(requests=6, finished=5, peak_running=5, mean_running=4.0, preemptions=1, wall_s=2.0,
                  generated_tokens=50, ttft_s=(0.5, 1.0, 2.5, 0.2, 0.3), tpot_s=(0.05, 0.1, 0.01, 0.2, 0.09))
    # request by request: meets both, meets both (at the limits), TTFT misses, TPOT misses, meets both;
    # the sixth never finished
    row = goodput_row(out, ttft_slo=1.0, tpot_slo=0.1)
    assert row["sla_attainment"] == 0.5 and row["goodput_req_s"] == 1.5
    assert row["sla_attainment"] in attainments(row, {"ttft_s": 1.0, "tpot_s": 0.1})


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


@pytest.mark.parametrize("command", [["bench", "overhead"], ["bench", "prefix"], ["verify", "--model", "tiny-llama", "--json"]])
def test_engine_commands_refuse_a_block_size_the_cpu_backend_cannot_run(command):
    run = vtoken(*command, "--block-size", "16", timeout=120)
    assert run.returncode == 2 and "multiple of 32 on vLLM's CPU backend, got 16" in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr


def test_overhead_with_attention_policies_pairs_naive_and_repack_per_policy_in_one_run(tmp_path):
    """``--policy scissorhands --policy h2o``: the hooks engine scores, each policy runs every evicting variant
    (``mode/policy``) in the same run, naive and repack take the same decisions, and no score-collection rows
    (they compare against the query-free policy, not run here)."""
    run = vtoken("bench", "overhead", "--model", "tiny-llama", "--policy", "scissorhands", "--policy", "h2o",
                 "--batch", "2", "--prompt-len", "64", "--gen-len", "8", "--repeats", "1",
                 "--out", str(tmp_path / "o.json"))
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout)
    assert report == json.loads((tmp_path / "o.json").read_text())
    assert report["policies"] == ["scissorhands", "h2o"] and "policy" not in report
    assert report["scores"] == {"none": "never", "hooks": "auto"}  # what a served engine collects, no more
    pairs = [f"{m}/{p}" for p in ("scissorhands", "h2o") for m in ("naive", "repack", "reuse+repack")]
    assert set(report["decode_step_ms"]) == {"none", *pairs}
    assert all(ms > 0 for ms in report["decode_step_ms"].values())
    assert all(len(runs) == 1 for runs in report["decode_step_ms_run_means"].values())
    assert "score_collection_pct" not in report and "scores_vs_repack_ratio" not in report
    assert set(report["repack_vs_naive_pct"]) == {"scissorhands", "h2o"}
    moves = report["moves_per_run"]
    for p in ("scissorhands", "h2o"):  # budget 0.5 of 64 + 8 tokens: evictions leave holes to pack
        assert moves[f"repack/{p}"] == moves[f"naive/{p}"] > 0
    # each policy took its own decisions (deterministic: seeded prompts, greedy; measured 58 vs 38)
    assert moves["repack/scissorhands"] != moves["repack/h2o"], moves


def test_overhead_compares_several_policies_only_among_attention_policies():
    from typer.testing import CliRunner

    from vtoken.cli import app

    res = CliRunner().invoke(app, ["bench", "overhead", "--policy", "h2o", "--policy", "random"])
    assert res.exit_code == 2 and "--policy 'random' with other policies" in res.output, res.output
    res = CliRunner().invoke(app, ["bench", "overhead", "--policy", "h2o", "--policy", "lru"])
    assert res.exit_code == 2 and "unknown policy 'lru'" in res.output, res.output


def test_retained_grid_prints_json_with_the_command(tmp_path):
    run = vtoken("bench", "retained", "--policies", "h2o,random", "--budgets", "0.2", "--block-sizes", "16",
                 "--prompt-len", "96", "--gen-len", "32", "--requests", "4", "--sinks", "2", "--recent", "8",
                 "--out", str(tmp_path / "r.json"))
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout)
    assert json.loads((tmp_path / "r.json").read_text()) == report
    assert report["command"].startswith("vtoken bench retained") and len(report["rows"]) == 2
    from vtoken.sim.run import SimConfig, run_simulation

    for row, policy in zip(report["rows"], ("h2o", "random"), strict=True):
        # each row is the simulation its cell describes (the block counts themselves are checked against
        # the pool in tests/cpu/test_sim.py::test_blocks_taken_from_the_pool_follow_the_live_set)
        sim, _ = run_simulation(SimConfig.of(policy=policy, budget="0.2", block_size=16, prompt_len=96, gen_len=32,
                                             requests=4, sinks=2, recent=8))
        m = sim["modes"]
        assert (row["policy"], row["budget"], row["block_size"]) == (policy, 0.2, 16)
        assert row == {**row, "none": m["none"]["retained_blocks_mean"], "naive": m["naive"]["retained_blocks_mean"],
                       "repack": m["repack"]["retained_blocks_mean"], "packing_bound": sim["packing_bound_mean"],
                       "repack_vs_naive_pct": m["repack"]["vs_naive_pct"], "moves_repack": m["repack"]["moves_total"],
                       "moves_reuse_repack": m["reuse+repack"]["moves_total"]}
        assert row["naive"] > row["repack"]  # measured: at 20 % the survivors stay scattered


def test_committed_results_are_reports_with_the_command_that_made_them():
    results = sorted((Path(__file__).resolve().parents[2] / "docs" / "results").glob("*.json"))
    assert results
    for path in results:
        report = json.loads(path.read_text())
        assert report["command"].startswith("vtoken "), path.name
