"""`vtoken bench …`: the commands run, print what they measured as JSON with the command, and reject bad
input with a message naming the value. Numbers are never asserted as wall-clock targets; what is asserted
is deterministic (the engine is stepped in-process, so admission and preemption repeat exactly)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from support.cli import parse_vtoken, run_vtoken
from support.paths import RESULTS
from support.quality import small_quality_setup


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_capacity_repack_fits_more_concurrent_requests_than_naive_in_the_same_pool(tmp_path):
    out = tmp_path / "cap.json"
    run = run_vtoken(
        "bench",
        "capacity",
        "--kv-blocks",
        "24",
        "--prompt-len",
        "64",
        "--gen-len",
        "32",
        "--requests",
        "8",
        "--repeats",
        "1",
        "--out",
        str(out),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert json.loads(run.stdout) == report and report["command"].startswith("vtoken bench capacity")
    modes = report["modes"]
    assert set(modes) == {"naive", "repack", "reuse+repack"}
    assert [g["kind"] for g in report["kv_cache_groups"]] == ["full"]
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


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_capacity_on_a_hybrid_model_counts_the_whole_pool(tmp_path):
    """The tiny Gemma 3 (3 sliding-window groups of 64 tokens beside the global group, one shared pool): the
    report names the groups, and repack still fits more requests than naive though every request also holds
    its sliding-window blocks, which no mode evicts."""
    out = tmp_path / "cap.json"
    run = run_vtoken(
        "bench",
        "capacity",
        "--model",
        "tiny-gemma3",
        "--kv-blocks",
        "64",
        "--prompt-len",
        "256",
        "--gen-len",
        "96",
        "--requests",
        "2",
        "--repeats",
        "1",
        "--modes",
        "naive,repack",
        "--out",
        str(out),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    groups = sorted((g["kind"], g.get("window")) for g in report["kv_cache_groups"])
    assert groups == [("full", None)] + [("sliding_window", 64)] * 3
    modes = report["modes"]
    assert modes["repack"]["max_feasible_concurrency"] > modes["naive"]["max_feasible_concurrency"] >= 1, modes


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
    from vtoken.bench.engine.capacity import Outcome, goodput_row

    out = Outcome(
        requests=6,
        finished=5,
        peak_running=5,
        mean_running=4.0,
        preemptions=1,
        wall_s=2.0,
        generated_tokens=50,
        ttft_s=(0.5, 1.0, 2.5, 0.2, 0.3),
        tpot_s=(0.05, 0.1, 0.01, 0.2, 0.09),
    )
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
        (["--budget", "0"], "invalid budget '0'"),  # a token count (Budget.parse), as every command reads it
        (["--block-size", "33"], "power of two, got 33"),
        (["--block-size", "16"], "multiple of 32 on vLLM's CPU backend, got 16"),
        (["--model", "/no/such/model"], "/no/such/model"),
    ],
)
def test_capacity_bad_input_exits_2_naming_the_value(args, named):
    run = run_vtoken("bench", "capacity", *args, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    assert named in run.stderr and "Traceback" not in run.stderr
    assert run.stdout == ""


@pytest.mark.parametrize(
    "command", [["bench", "overhead"], ["bench", "prefix"], ["verify", "--model", "tiny-llama", "--json"]]
)
def test_engine_commands_refuse_a_block_size_the_cpu_backend_cannot_run(command):
    run = run_vtoken(*command, "--block-size", "16", timeout=120)
    assert run.returncode == 2 and "multiple of 32 on vLLM's CPU backend, got 16" in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr


def test_overhead_with_attention_policies_pairs_naive_and_repack_per_policy_in_one_run(tmp_path):
    """``--policy scissorhands --policy h2o``: the hooks engine scores, each policy runs every evicting variant
    (``mode/policy``) in the same run, naive and repack take the same decisions, and no score-collection rows
    (they compare against the query-free policy, not run here)."""
    run = run_vtoken(
        "bench",
        "overhead",
        "--model",
        "tiny-llama",
        "--policy",
        "scissorhands",
        "--policy",
        "h2o",
        "--batch",
        "2",
        "--prompt-len",
        "64",
        "--gen-len",
        "8",
        "--repeats",
        "1",
        "--out",
        str(tmp_path / "o.json"),
    )
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
    run = run_vtoken(
        "bench",
        "retained",
        "--policies",
        "h2o,random",
        "--budgets",
        "0.2",
        "--block-sizes",
        "16",
        "--prompt-len",
        "96",
        "--gen-len",
        "32",
        "--requests",
        "4",
        "--sinks",
        "2",
        "--recent",
        "8",
        "--out",
        str(tmp_path / "r.json"),
    )
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout)
    assert json.loads((tmp_path / "r.json").read_text()) == report
    assert report["command"].startswith("vtoken bench retained") and len(report["rows"]) == 2
    from vtoken.sim.run import SimConfig, run_simulation

    for row, policy in zip(report["rows"], ("h2o", "random"), strict=True):
        # each row is the simulation its cell describes (the block counts themselves are checked against
        # the pool in tests/integration/test_sim.py::test_blocks_taken_from_the_pool_follow_the_live_set)
        sim, _ = run_simulation(
            SimConfig.of(
                policy=policy, budget="0.2", block_size=16, prompt_len=96, gen_len=32, requests=4, sinks=2, recent=8
            )
        )
        m = sim["modes"]
        assert (row["policy"], row["budget"], row["block_size"]) == (policy, 0.2, 16)
        assert row == {
            **row,
            "none": m["none"]["retained_blocks_mean"],
            "naive": m["naive"]["retained_blocks_mean"],
            "repack": m["repack"]["retained_blocks_mean"],
            "packing_bound": sim["packing_bound_mean"],
            "repack_vs_naive_pct": m["repack"]["vs_naive_pct"],
            "moves_repack": m["repack"]["moves_total"],
            "moves_reuse_repack": m["reuse+repack"]["moves_total"],
        }
        assert row["naive"] > row["repack"]  # measured: at 20 % the survivors stay scattered
    from vtoken.bench.engine.retained import REPORT_KEYS

    assert set(report) == REPORT_KEYS | {"environment"}


# ---- the report keys each bench writes (REPORT_KEYS, declared next to each builder) -----------------------


def test_serve_report_has_exactly_its_report_keys():
    from vtoken.bench.served.bench import REPORT_KEYS, _report
    from vtoken.bench.served.plan import ServeBenchSetup

    variant = {
        "mode": "repack",
        "policy": "h2o",
        "admission": False,
        "runs": [],
        "max_rate_at_target": 0.3,
        "rate_at_target_interpolated": 0.32,
        "peak_running": 4,
    }
    report = _report(ServeBenchSetup(), "/models/m", [[variant]], 0.0)
    assert set(report) == REPORT_KEYS and report["repeats_done"] == 1
    assert set(report["setup"]) == set(ServeBenchSetup.__dataclass_fields__)


def test_quality_report_has_exactly_its_report_keys(monkeypatch):
    """``run_quality`` with both tasks stubbed (no engine): the report it assembles."""
    import transformers

    from vtoken.bench.quality import bench as quality

    def task(key):
        def run(setup, tokenizer, pts, on_phase):
            row = {key: 1.0, "retained_blocks_mean": 2.0, "packing_bound_mean": 1.5}
            return {"cases" if key == "accuracy" else "windows": [], "points": {pt.key: row for pt in pts}}

        return run

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", staticmethod(lambda *a, **k: None))
    monkeypatch.setattr(quality, "run_retrieval", task("accuracy"))
    monkeypatch.setattr(quality, "run_language_modelling", task("perplexity"))
    report = quality.run_quality(small_quality_setup())
    assert set(report) == quality.REPORT_KEYS
    assert set(report["setup"]) == set(quality.QualitySetup.__dataclass_fields__) - {"model"}


def test_capacity_report_has_exactly_its_report_keys(monkeypatch):
    """``run_capacity`` with the engine stubbed: every batch fits (so the search stops at ``max_seqs``)."""
    from vtoken.bench.engine import capacity

    def run_batch(llm, setup, mode, count, tag, stop_on_preemption):
        return capacity.Outcome(
            count, count, count, float(count), 0, 1.0, count * setup.gen_len, (0.1,) * count, (0.01,) * count
        )

    monkeypatch.setattr(capacity, "build_engine", lambda setup: None)
    monkeypatch.setattr(capacity, "kv_cache_groups", lambda llm: [{"kind": "full", "layers": 2}])
    monkeypatch.setattr(capacity, "close", lambda llm: None)
    monkeypatch.setattr(capacity, "run_batch", run_batch)
    setup = capacity.CapacitySetup(model="m", kv_blocks=8, prompt_len=8, gen_len=4, max_seqs=4)
    report = capacity.run_capacity(setup, ("naive", "repack"), requests=2, ttft_slo=1.0, tpot_slo=0.1, repeats=1)
    assert set(report) == capacity.REPORT_KEYS
    assert report["modes"]["repack"]["max_feasible_concurrency"] == 4


@pytest.mark.parametrize("policies", [("random",), ("scissorhands", "h2o")])
def test_overhead_report_has_its_report_keys(monkeypatch, policies):
    """``run_overhead`` with engines and steps stubbed: ``REPORT_KEYS``, ``policy`` or ``policies``, and the
    score-collection keys with a query-free policy only."""
    from types import SimpleNamespace

    import transformers

    import vtoken.models.default
    from vtoken.bench.engine import overhead

    counters = SimpleNamespace(repack_moves=0)
    scheduler = SimpleNamespace(vtoken_stats=lambda: SimpleNamespace(counters=counters))
    core = SimpleNamespace(engine_core=SimpleNamespace(scheduler=scheduler), shutdown=lambda: None)
    llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=core))

    def steps(llm, prompts, gen_len, mode, tag, advance, score_layers=None, policy="random"):
        counters.repack_moves += 3
        return [0.01 + 0.001 * len(tag)] * 2

    monkeypatch.setattr(vtoken.models.default, "resolve_model", lambda model: "/models/m")
    monkeypatch.setattr(
        transformers.AutoConfig, "from_pretrained", staticmethod(lambda *a, **k: SimpleNamespace(vocab_size=100))
    )
    monkeypatch.setattr(overhead, "_engine", lambda *a, **k: llm)
    monkeypatch.setattr(overhead, "_decode_steps", steps)
    report = overhead.run_overhead("m", overhead.BASE, 2, 8, 3, 1, policies=policies)
    one = len(policies) == 1
    assert set(report) == (
        overhead.REPORT_KEYS | {"policy" if one else "policies"} | (overhead.SCORE_COLLECTION_KEYS if one else set())
    )


def test_kernels_report_has_exactly_its_report_keys():
    import torch

    from vtoken.bench.engine.kernels import REPORT_KEYS, run_kernels
    from vtoken.kernels.backend_check import Shape

    report = run_kernels("torch", "cpu", "cpu", Shape(1, 1, 1, 8, 4, 4, torch.float32), 2, 0, 8)
    assert set(report) == REPORT_KEYS  # + "timings" on CUDA only


def test_sim_scale_report_has_exactly_its_report_keys(tmp_path, capsys):
    from vtoken.bench.engine.sim_scale import REPORT_KEYS, run_sim_scale
    from vtoken.sim.run import RESULT_KEYS, SimConfig

    cfg = SimConfig.of(policy="h2o", budget="0.2", block_size=16, prompt_len=64, gen_len=8, requests=2)
    report = run_sim_scale(cfg, str(tmp_path / "s.json"))
    assert set(report) == REPORT_KEYS | {"environment"}  # report.emit added it
    assert set(report["result"]) == RESULT_KEYS
    assert json.loads((tmp_path / "s.json").read_text()) == report


def test_score_host_report_has_exactly_its_report_keys():
    """A small shape: the old and new paths fold the same statistics for every evictable token."""
    from vtoken.bench.engine.score_host import REPORT_KEYS, run_score_host

    report = run_score_host("h2o", 16, 1, 0, shapes=((3, 200),))
    assert set(report) == REPORT_KEYS
    assert [r["scope"] for r in report["rows"]] == ["generated", "all"]
    assert all(r["same_statistics"] for r in report["rows"])
    assert [r["first_scored"] for r in report["rows"]] == [184, 4]


def test_fleet_report_has_exactly_its_report_keys():
    from vtoken.bench.fleet.bench import AUTOSCALER_KEYS, REPORT_KEYS, run_fleet
    from vtoken.bench.fleet.model import BASE
    from vtoken.serve.telemetry.sla import SloTargets

    steps = RESULTS / "fleet-steps.json"
    report = run_fleet(
        2,
        [0.5],
        ["kv"],
        ["naive"],
        6.0,
        2.0,
        32,
        4,
        BASE,
        steps,
        False,
        "tiny-llama",
        1.0,
        0.5,
        SloTargets(2.0, 0.2),
        (4,),
        echo=lambda *a: None,
    )
    assert set(report) == REPORT_KEYS
    assert set(report["replicas_needed"]["naive"]["autoscaler"]) == AUTOSCALER_KEYS


# ---- every committed docs/results/*.json: current, or marked superseded ------------------------------------


def bench_keys() -> dict[str, tuple[frozenset, bool]]:
    """bench name → (top-level REPORT_KEYS, whether it runs vLLM: its report must name the vLLM version)."""
    from vtoken.bench.engine import capacity, kernels, overhead, prefix, retained, score_host, sim_scale
    from vtoken.bench.fleet import bench as fleet
    from vtoken.bench.fleet import steps as fleet_steps
    from vtoken.bench.quality import bench as quality
    from vtoken.bench.quality import yardstick_plot
    from vtoken.bench.quality.longgen import codegen
    from vtoken.bench.quality.longgen import report as longgen_report
    from vtoken.bench.served import bench as serve_bench
    from vtoken.bench.served import soak

    return {
        "serve": (serve_bench.REPORT_KEYS, True),
        "quality": (quality.REPORT_KEYS, True),
        "overhead": (overhead.REPORT_KEYS, True),
        "capacity": (capacity.REPORT_KEYS, True),
        "prefix": (prefix.REPORT_KEYS, True),
        "fleet-steps": (fleet_steps.REPORT_KEYS, True),
        "fleet": (fleet.REPORT_KEYS, False),
        "retained": (retained.REPORT_KEYS, False),
        "sim-scale": (sim_scale.REPORT_KEYS, False),
        "kernels": (kernels.REPORT_KEYS, False),
        "soak": (soak.REPORT_KEYS, True),
        "yardstick": (yardstick_plot.REPORT_KEYS, False),
        "longgen": (longgen_report.REPORT_KEYS, True),
        "codegen": (codegen.REPORT_KEYS, True),
        "score-host": (score_host.REPORT_KEYS, False),
    }


def bench_of(words: list[str], report: dict) -> str:
    """The bench a ``vtoken bench NAME …`` command's report comes from (``fleet --measure-steps`` also
    writes the steps file, ``bench: fleet-steps``)."""
    assert words[1] == "bench", words
    name = words[2]
    if name == "fleet" and "--measure-steps" in words and report.get("bench") == "fleet-steps":
        return "fleet-steps"
    return name


def required_keys(bench: str, words: list[str], report: dict) -> list[tuple[tuple, frozenset]]:
    """``(path, keys)`` pairs: the keys the current code writes at each path of ``bench``'s report."""
    from dataclasses import fields

    from vtoken.bench.engine.overhead import SCORE_COLLECTION_KEYS
    from vtoken.bench.fleet.bench import AUTOSCALER_KEYS
    from vtoken.bench.quality.bench import QualitySetup
    from vtoken.bench.served.plan import ServeBenchSetup
    from vtoken.policies import get_policy_class
    from vtoken.sim.run import RESULT_KEYS

    top = set(bench_keys()[bench][0])
    nested: list[tuple[tuple, frozenset]] = []
    if bench == "overhead":
        policies = [words[i + 1] for i, w in enumerate(words) if w == "--policy"] or ["random"]
        top.add("policy" if len(set(policies)) == 1 else "policies")
        if not get_policy_class(policies[0]).needs_attention():
            top |= SCORE_COLLECTION_KEYS
    elif bench == "quality":
        nested.append((("setup",), frozenset(f.name for f in fields(QualitySetup)) - {"model"}))
    elif bench == "serve":
        nested.append((("setup",), frozenset(f.name for f in fields(ServeBenchSetup))))
    elif bench == "fleet":
        nested += [(("replicas_needed", m, "autoscaler"), AUTOSCALER_KEYS) for m in report.get("modes", ())]
    elif bench == "sim-scale":
        nested.append((("result",), RESULT_KEYS))
    return [((), frozenset(top)), *nested]


def result_problems(name: str, report: dict) -> list[str]:
    """Why a committed result is neither current (the keys the current code writes, vLLM's version where
    the bench runs vLLM) nor marked ``superseded`` with why and how to reproduce it (empty: fine)."""
    if not isinstance(report.get("command"), str):
        return [f"{name}: no command"]
    parts = parse_vtoken(report["command"])  # --out may name another file (written elsewhere, copied)
    if "superseded" in report:
        old = report["superseded"]
        out = (
            []
            if isinstance(old, dict) and set(old) == {"why", "reproduce"}
            else [f"{name}: superseded must be {{why, reproduce}}, got {old!r}"]
        )
        why = old.get("why") if isinstance(old, dict) else None
        if not (isinstance(why, str) and why.strip() and "\n" not in why):
            out.append(f"{name}: superseded.why must be one sentence, got {why!r}")
        reproduce = old.get("reproduce") if isinstance(old, dict) else None
        again = parse_vtoken(reproduce) if isinstance(reproduce, str) else []
        if len(again) != 1 or bench_of(again[0], {}) not in bench_keys():
            out.append(f"{name}: superseded.reproduce must be one vtoken bench command, got {reproduce!r}")
        return out
    out = []
    for part in parts:
        bench = bench_of(part, report)
        if bench not in bench_keys():
            return [f"{name}: 'vtoken bench {bench}' has no REPORT_KEYS"]
        if report.get("bench", bench) != bench:
            out.append(f"{name}: bench {report['bench']!r} but the command runs {bench!r}")
        if len(parts) > 1:
            out.append(f"{name}: {len(parts)} commands in one report (one command writes one report)")
            break
        for path, keys in required_keys(bench, part, report):
            node = report
            for step in path:
                node = node.get(step, {}) if isinstance(node, dict) else {}
            if missing := sorted(keys - set(node)):
                where = ".".join(path) or "top level"
                out.append(f"{name}: {where} lacks {missing} (the current code writes them)")
        if bench_keys()[bench][1] and not (report.get("environment") or {}).get("vllm"):
            out.append(f"{name}: no environment.vllm (which vLLM it ran on)")
    return out


def test_committed_results_are_current_reports_or_marked_superseded():
    """Every figure in the docs comes from a JSON here that the current code reproduces: each file has the
    keys its command's bench writes today (``REPORT_KEYS`` and the nested sets ``required_keys`` names) and,
    for a bench that runs vLLM, the vLLM version in ``environment``; or it says it is ``superseded``: why
    (one sentence) and the command that produces its current form."""
    results = sorted(RESULTS.glob("*.json"))
    assert results
    problems = [p for path in results for p in result_problems(path.name, json.loads(path.read_text()))]
    assert not problems, "\n".join(problems)


def test_the_results_check_flags_a_stale_report_and_a_bad_mark():
    """A stale report without its mark fails (quality-smollm2.json predates score_layers in the setup), and
    so does a mark whose reproduce command the CLI cannot parse."""
    report = json.loads((RESULTS / "quality-smollm2.json").read_text())
    mark = report.pop("superseded")
    assert any("setup lacks" in p and "score_layers" in p for p in result_problems("q.json", report))
    with pytest.raises(Exception, match="No such option: --nope"):
        bad = {**mark, "reproduce": "vtoken bench quality --nope"}
        result_problems("q.json", {**report, "superseded": bad})
    with pytest.raises(Exception, match="valid integer"):
        parse_vtoken("vtoken bench overhead --score-layers x")
    with pytest.raises(AssertionError, match="no command 'nope'"):
        parse_vtoken("vtoken bench quality && vtoken bench nope")
