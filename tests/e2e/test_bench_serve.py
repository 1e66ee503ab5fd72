"""`vtoken bench serve`: the served-path benchmark (vtoken/bench/served/bench.py).

The pure parts (variants, commands, a run's numbers from vLLM's result file, the max rate at the
attainment target) are checked on hand-built inputs; the command contract runs for real once: a
``vtoken serve`` on the tiny model driven by ``vllm bench serve``, JSON out.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from vtoken import metric_names as names
from vtoken.bench.served.bench import client_command, variant_config
from vtoken.bench.served.measures import (
    ReplicaMetrics,
    max_rate_meeting,
    rate_at_target,
    run_summary,
    sweep_done,
)
from vtoken.bench.served.plan import CHAT_RANGE_RATIO, ServeBenchSetup

VTOKEN = [sys.executable, "-m", "vtoken.cli"]


def test_variants_run_none_once_and_every_policy_for_the_evicting_modes():
    s = ServeBenchSetup(modes=("none", "naive", "repack"), policies=("h2o", "random"))
    assert s.variants() == [
        ("none", None, False, "step"),
        ("naive", "h2o", False, "step"),
        ("naive", "random", False, "step"),
        ("repack", "h2o", False, "step"),
        ("repack", "random", False, "step"),
    ]
    ab = ServeBenchSetup(modes=("repack",), policies=("tova",), admission=(True, False))
    # the A/B: off, then on
    assert ab.variants() == [("repack", "tova", False, "step"), ("repack", "tova", True, "step")]


def test_none_is_stock_vllm_and_admission_on_it_is_its_own_variant():
    """The baseline never runs vToken's admission (it would load vToken's scheduler into vanilla vLLM)."""
    on = ServeBenchSetup(model="tiny-llama", modes=("none", "repack"), policies=("h2o",), admission=(True,))
    # the control: stock vLLM with the same admission cap runs whenever the evicting variants use admission
    assert on.variants() == [
        ("none", None, False, "step"),
        ("none", None, True, "step"),
        ("repack", "h2o", True, "step"),
    ]
    s = ServeBenchSetup(model="tiny-llama", modes=("none", "repack"), policies=("h2o",), admission=(True, False))
    assert s.variants() == [
        ("none", None, False, "step"),
        ("none", None, True, "step"),
        ("repack", "h2o", False, "step"),
        ("repack", "h2o", True, "step"),
    ]
    from vtoken.serve.replica.engine import engine_args

    stock = engine_args(variant_config(s, "none", None, False), "model")
    assert not {"scheduler_cls", "worker_cls", "additional_config"} & set(stock)
    with_admission = engine_args(variant_config(s, "none", None, True), "model")
    assert with_admission["scheduler_cls"] == "vtoken.vllm.scheduler.VTokenScheduler"


def test_each_server_gets_the_fixed_pool_its_mode_and_room_for_the_longest_request():
    s = ServeBenchSetup(
        model="tiny-llama",
        pool_blocks=40,
        input_len=100,
        output_len=20,
        dataset="chat",
        prefix_len=50,
        ttft_ms=9000,
        tpot_ms=250,
        extra=("router.stats_period_s=0.25",),
    )
    c = variant_config(s, "repack", "h2o", metrics_port=9999)
    assert (c.engine.kv_cache_blocks, c.vtoken.mode, c.metrics.port) == (40, "repack", 9999)
    assert (c.slo.ttft_ms, c.slo.tpot_ms) == (9000, 250)  # admission and vtoken:slo_met judge what the client does
    assert c.vtoken.policy == "h2o" and c.slo.admission is False
    assert variant_config(s, "repack", "h2o", True).slo.admission is True  # the variant's own setting
    assert c.engine.max_model_len == 39 * 32 and c.router.stats_period_s == 0.25
    assert variant_config(s, "none", None).vtoken.mode == "none"
    with pytest.raises(ValueError, match="--pool-blocks 4"):
        variant_config(ServeBenchSetup(model="tiny-llama", pool_blocks=4), "none", None)


def test_the_bench_evicts_over_every_token_unless_its_command_says_otherwise():
    """The bench names its own scope (all), so a committed command reproduces what it measured whatever the
    engine's default; ``--set vtoken.scope=generated`` (the parity runs) still overrides it."""
    from vtoken.core.config import Scope, VTokenConfig

    assert VTokenConfig().scope is Scope.GENERATED  # the engine's default is not the bench's
    s = ServeBenchSetup(model="tiny-llama", pool_blocks=40, input_len=100, output_len=20)
    assert variant_config(s, "repack", "h2o").vtoken.scope is Scope.ALL
    assert variant_config(s, "naive", "h2o").vtoken.scope is Scope.ALL
    told = ServeBenchSetup(
        model="tiny-llama", pool_blocks=40, input_len=100, output_len=20, extra=("vtoken.scope=generated",)
    )
    assert variant_config(told, "repack", "h2o").vtoken.scope is Scope.GENERATED


def test_a_hybrid_models_server_gets_the_longest_length_its_pool_holds_in_every_group():
    """The tiny Gemma 3's 4 KV cache groups (3 sliding of 64, 1 full; 2048 tokens in flight, read from vLLM's
    engine config): 80 blocks hold max_model_len 608 in every group (4 x 19 + 3 + 1 = 80), not the 79 x 32
    a one-group model gets — vLLM refused that engine, so the served bench could not run a hybrid model; a
    pool that cannot hold the longest request in every group is refused naming --pool-blocks."""
    from vtoken.bench.served.bench import pool_shape_of
    from vtoken.models.default import resolve_model
    from vtoken.vllm.scheduling.pool_need import FULL

    s = ServeBenchSetup(model="tiny-gemma3", pool_blocks=80, input_len=64, output_len=64)
    shape = pool_shape_of(s, str(resolve_model("tiny-gemma3")))
    assert sorted(shape.windows, key=str) == [64, 64, 64, FULL] and shape.in_flight_tokens == 2048
    c = variant_config(s, "repack", "h2o", shape=shape)
    assert c.engine.max_model_len == 608 and shape.need(608) == 80 < shape.need(609)
    assert variant_config(s, "none", None).engine.max_model_len == 79 * 32  # without the shape: one group
    with pytest.raises(ValueError, match="--pool-blocks 20 cannot hold the longest request"):
        variant_config(
            ServeBenchSetup(model="tiny-gemma3", pool_blocks=20, input_len=64, output_len=64), "none", None, shape=shape
        )


def test_chat_requests_fit_the_server_limits_at_the_widest_draw():
    """chat draws prompt and output lengths ±CHAT_RANGE_RATIO: the server must take the longest output
    (9 of 12 requests got 400 when limits.max_tokens was the mean output length)."""
    s = ServeBenchSetup(
        model="tiny-llama", pool_blocks=128, input_len=64, output_len=64, dataset="chat", prefix_len=256
    )
    c = variant_config(s, "repack", "h2o")
    widest_out = math.ceil(64 * (1 + CHAT_RANGE_RATIO))
    assert c.limits.max_tokens == widest_out == s.longest_output()
    assert c.engine.max_model_len >= 256 + math.ceil(64 * (1 + CHAT_RANGE_RATIO)) + widest_out
    plain = ServeBenchSetup(model="tiny-llama", input_len=64, output_len=64)
    assert variant_config(plain, "none", None).limits.max_tokens == 64
    ratio = client_command(s, "http://x", "/m", 1.0, "/tmp/r", "x.json")
    assert ratio[ratio.index("--random-range-ratio") + 1] == str(CHAT_RANGE_RATIO)


def test_client_command_states_the_slos_rate_and_dataset():
    s = ServeBenchSetup(model="tiny-llama", ttft_ms=2000, tpot_ms=150, dataset="chat", prefix_len=64)
    cmd = client_command(s, "http://127.0.0.1:1", "/m", 2.5, "/tmp/r", "x.json")
    text = " ".join(cmd)
    assert cmd[1:3] == ["bench", "serve"] and "--goodput ttft:2000 tpot:150" in text
    assert "--request-rate 2.5" in text and "--random-prefix-len 64" in text and "--ignore-eos" in text


def test_a_run_counts_failed_requests_as_missing_the_slo():
    s = ServeBenchSetup(num_prompts=10)
    result = {
        "duration": 8.0,
        "completed": 8,
        "request_throughput": 1.0,
        "request_goodput": 0.75,
        "output_throughput": 30.0,
        "median_ttft_ms": 120.0,
        "p99_ttft_ms": 900.0,
        "median_tpot_ms": 50.0,
        "p99_tpot_ms": 80.0,
    }
    run = run_summary(result, s, 1.25, peak=5)
    assert (run["completed"], run["failed"], run["slo_attainment"]) == (8, 2, 0.6)  # 6 of 10 sent met it
    assert (run["ttft_p50_ms"], run["tpot_p99_ms"], run["peak_running"]) == (120.0, 80.0, 5)
    errors = ["", "", "Bad Request: prompt too long", "", "timeout"]
    failed = run_summary({**result, "errors": errors}, s, 1.25, 5)
    assert failed["errors"] == ["Bad Request: prompt too long", "timeout"]  # why, once each


def test_max_rate_is_the_last_rate_before_the_first_miss():
    runs = [{"rate": r, "slo_attainment": a} for r, a in ((1, 1.0), (3, 0.5), (2, 0.95), (4, 0.99))]
    assert max_rate_meeting(runs) == 2  # 4 met it again, but 3 did not: not a sustained rate
    assert max_rate_meeting([{"rate": 1, "slo_attainment": 0.89}]) is None


def test_interpolated_rate_crosses_the_target_between_the_last_pass_and_the_first_miss():
    runs = [{"rate": r, "slo_attainment": a} for r, a in ((1, 1.0), (3, 0.5), (2, 0.95), (4, 0.99))]
    assert rate_at_target(runs) == pytest.approx(2 + 1 / 9, abs=1e-4)  # 0.95 at 2, 0.5 at 3: a ninth of the way
    assert rate_at_target(runs[:1]) == 1  # nothing above missed: the last rate run
    assert rate_at_target([{"rate": 1, "slo_attainment": 0.89}]) is None
    assert rate_at_target([{"rate": 1, "slo_attainment": 0.9}, {"rate": 2, "slo_attainment": 0.0}]) == 1


def test_a_sweep_stops_only_after_the_stated_misses_in_a_row():
    runs = [{"rate": r, "slo_attainment": a} for r, a in ((1, 1.0), (2, 0.5), (3, 0.95), (4, 0.8))]
    assert not sweep_done(runs[:2], 2) and not sweep_done(runs[:3], 2)  # a pass in between resets the count
    assert not sweep_done(runs, 2) and sweep_done(runs, 1) and sweep_done(runs[:2], 1)
    assert sweep_done([*runs, {"rate": 5, "slo_attainment": 0.89}], 2)
    assert not sweep_done([{"rate": 1, "slo_attainment": 0.0}] * 3, 0)  # 0: every rate runs


def test_replica_metrics_read_the_peak_batch_the_prefix_cache_growth_and_the_preemptions():
    scrapes = iter([(1, 100, 400), (4, 160, 500), (2, 356, 700)])
    last = (2, 356, 700)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            running, hits, queries = next(scrapes, last)
            body = (
                f'# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{model_name="m"}} '
                f"{running}\nvllm:num_requests_waiting 7\n"
                f'vtoken:admission_limit{{mode="repack"}} {9 - running}\n'
                f'vllm:prefix_cache_hits_total{{engine="0"}} {hits}\n'
                f'vllm:prefix_cache_queries_total{{engine="0"}} {queries}\n'
                f'vllm:num_preemptions_total{{engine="0"}} {3 + hits // 100}\n'  # 4, 4, 6
                f'vllm:num_preemptions_created{{engine="0"}} 1.7e9\n'
            ).encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with ReplicaMetrics(f"http://127.0.0.1:{server.server_port}/metrics", period=0.05) as seen:
            threading.Event().wait(0.6)
    finally:
        server.shutdown()
    assert seen.peak == 4  # the largest running value, never the waiting gauge's 7
    assert seen.limit_low == 5  # the lowest admission limit (9 - 4)
    assert (seen.prefix_hits, seen.prefix_queries) == (256, 300)  # growth since the first scrape
    assert seen.preemptions == 2  # the counter's growth (4 → 6), not its value, nor its _created sample
    # the gauges as they changed: (running, waiting, limit) 1/7/8, 4/7/5, then 2/7/7 for every later scrape
    assert [entry[1:] for entry in seen.timeline] == [[1, 7, 8], [4, 7, 5], [2, 7, 7]], seen.timeline
    times = [entry[0] for entry in seen.timeline]
    assert times == sorted(times) and 0 <= times[0] < 0.6
    result = {"duration": 1.0, "completed": 1, "request_goodput": 1.0}
    counters = (seen.prefix_hits, seen.prefix_queries)
    run = run_summary(
        result,
        ServeBenchSetup(num_prompts=1),
        1.0,
        seen.peak,
        counters,
        seen.limit_low,
        seen.preemptions,
        seen.timeline,
    )
    assert run["prefix_cache_hit_rate"] == round(256 / 300, 4) and run["admission_limit_min"] == 5
    assert run["timeline"] == seen.timeline
    assert run["preemptions"] == 2


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--modes", "bogus"], "bogus"),
        (["--policies", "nope"], "nope"),
        (["--rates", "0,1"], "--rates"),
        (["--dataset", "sharegpt"], "sharegpt"),
        (["--pool-blocks", "4"], "--pool-blocks 4"),
        (["--set", "engine.nope=1"], "engine.nope"),
        (["--admission", "maybe"], "--admission"),
        (["--stop-after-misses", "-1"], "--stop-after-misses"),
        (["--repeats", "0"], "--repeats"),
    ],
)
def test_bad_input_exits_2_naming_the_value_before_any_server_starts(args, named):
    out = subprocess.run(
        [*VTOKEN, "bench", "serve", "--model", "tiny-llama", *args], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and named in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stdout == ""


STAND_IN_SERVER = """
import os, sys, time
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(600)  # until the benchmark stops it (the test kills it if not)
"""


def test_sigterm_stops_the_server_it_started(tmp_path):
    """``kill``/``timeout`` on a running benchmark: its server goes down with it. The server is a stand-in
    (a sleeping process, never ready: the benchmark waits in ``wait_ready``); everything else is the real
    ``run_serve_bench``. Without ``sigterm_as_interrupt`` the benchmark died and the server lived on."""
    import os
    import signal
    import time

    pid_file = tmp_path / "server.pid"
    script = f"""
import sys
from vtoken.bench.served import bench as serve_bench
serve_bench.server_command = lambda config, port: [sys.executable, "-c", {STAND_IN_SERVER!r}, {str(pid_file)!r}]
serve_bench.run_serve_bench(serve_bench.ServeBenchSetup(model="tiny-llama", modes=("none",)))
"""
    bench = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not pid_file.exists() or not pid_file.read_text():
        assert bench.poll() is None and time.monotonic() < deadline, bench.communicate()[1][-2000:]
        time.sleep(0.2)
    server = int(pid_file.read_text())
    bench.send_signal(signal.SIGTERM)
    _, err = bench.communicate(timeout=90)
    assert bench.returncode != 0, err[-2000:]

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    gone = time.monotonic() + 10
    while alive(server) and time.monotonic() < gone:
        time.sleep(0.2)
    if alive(server):
        os.kill(server, signal.SIGKILL)
        pytest.fail("the benchmark exited on SIGTERM and left its server running")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_command_serves_one_mode_through_vllm_bench_serve_and_reports_json(tmp_path):
    out_file = tmp_path / "serve.json"
    cmd = [
        *VTOKEN,
        "bench",
        "serve",
        "--model",
        "tiny-llama",
        "--modes",
        "repack",
        "--policies",
        "random",
        "--budget",
        "0.5",
        "--pool-blocks",
        "40",
        "--rates",
        "2,1000",
        "--num-prompts",
        "6",
        "--input-len",
        "64",
        "--output-len",
        "256",
        "--ttft-ms",
        "120000",
        "--tpot-ms",
        "20000",
        "--json",
        "--out",
        str(out_file),
        "--plot",
        str(tmp_path / "serve.png"),
        "--admission",
        "on",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=880)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report == json.loads(out_file.read_text())
    assert report["command"].startswith("vtoken bench serve") and report["environment"]["cores"] >= 1
    (variant,) = report["variants"]
    assert (variant["mode"], variant["policy"], variant["admission"]) == ("repack", "random", True)
    assert [r["rate"] for r in variant["runs"]] == [2.0, 1000.0]
    for run in variant["runs"]:
        assert run["completed"] == 6 and run["failed"] == 0 and run["slo_attainment"] == 1.0, run
        assert run["ttft_p50_ms"] > 0 and run["tpot_p50_ms"] > 0  # at rate 2 a poll may see none running
        assert isinstance(run["preemptions"], int) and run["preemptions"] >= 0  # vLLM's counter was scraped
        # the replica's gauges as they changed: its running batch peaked where the peak says, under the limit
        assert max(e[1] for e in run["timeline"]) == run["peak_running"], run["timeline"]
        assert all(e[2] >= 0 and e[3] in (None, 16) for e in run["timeline"]), run["timeline"]
    # 6 requests at once (rate 1000) overlap: the replica ran more than one at a time. The gauge is polled
    # every 0.5 s: with 48 output tokens the whole burst once fitted between two polls (peak 0); 256 decode
    # steps of a batch of 6 last > 1 s here (6 · ⌈160 / 32⌉ = 30 blocks held at budget 0.5: no preemption)
    assert variant["runs"][1]["peak_running"] >= 2 and variant["max_rate_at_target"] == 1000.0
    assert variant["rate_at_target_interpolated"] == 1000.0  # nothing missed: the highest rate run
    # admission on: its limit reached the report through engine → SchedulerStats → replica → /metrics, and
    # with a loose TPOT (20 s, the server's slo.tpot_ms from --tpot-ms) it never went below max_num_seqs
    assert all(run["admission_limit_min"] == 16 for run in variant["runs"]), variant["runs"]
    assert (tmp_path / "serve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_command_serves_a_hybrid_model_on_a_pool_sized_per_group(tmp_path):
    """`vtoken bench serve` on the tiny Gemma 3 (4 KV cache groups): its server's max_model_len is what the
    pool holds in every group, so the engine starts and every request completes with H2O evicting (before,
    the server got 79 x 32 tokens and vLLM refused to start it)."""
    cmd = [
        *VTOKEN,
        "bench",
        "serve",
        "--model",
        "tiny-gemma3",
        "--modes",
        "repack",
        "--policies",
        "h2o",
        "--budget",
        "0.5",
        "--pool-blocks",
        "80",
        "--rates",
        "1000",
        "--num-prompts",
        "4",
        "--input-len",
        "64",
        "--output-len",
        "64",
        "--ttft-ms",
        "120000",
        "--tpot-ms",
        "20000",
        "--json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=880)
    assert out.returncode == 0, out.stderr[-3000:]
    (variant,) = json.loads(out.stdout)["variants"]
    (run,) = variant["runs"]
    assert run["completed"] == 4 and run["failed"] == 0 and run["slo_attainment"] == 1.0, run


def _variant(mode, policy, admission, rate, interpolated):
    return {
        "mode": mode,
        "policy": policy,
        "admission": admission,
        "max_rate_at_target": rate,
        "rate_at_target_interpolated": interpolated,
    }


def test_repeats_are_summarised_as_medians_of_ratios_computed_within_each_repeat():
    """Known answer: the docstring's example (bench/served/summary.py), plus a repeat where naive met no rate."""
    from vtoken.bench.served.summary import headline, summarize

    table = [(0.20, 0.15, 0.30), (0.25, 0.20, 0.30), (0.20, 0.20, 0.35), (0.20, None, 0.30), (0.2, 0.15, None)]
    repeats = [
        [
            _variant("none", None, False, n, n),
            _variant("naive", "h2o", False, v, v),
            _variant("repack", "h2o", False, r, r and r + 0.01),
        ]
        for n, v, r in table
    ]
    got = summarize(repeats)
    assert got["repeats"] == 5
    assert got["variants"]["none"]["max_rate_at_target"] == {
        "median": 0.2,
        "min": 0.2,
        "max": 0.25,
        "n": 5,
        "values": [0.2, 0.25, 0.2, 0.2, 0.2],
    }
    stock = got["ratios"]["repack/h2o / none"]
    # the last repeat: repack met no rate, a loss (0), not left out
    assert stock["baseline"] == "stock"
    assert stock["max_rate_at_target"]["values"] == [1.5, 1.2, 1.75, 1.5, 0.0]
    assert stock["max_rate_at_target"]["median"] == 1.5 and stock["max_rate_at_target"]["min"] == 0.0
    assert stock["rate_at_target_interpolated"]["values"] == [1.55, 1.24, 1.8, 1.55, 0.0]
    naive = got["ratios"]["repack/h2o / naive/h2o"]
    assert naive["max_rate_at_target"]["values"] == [2.0, 1.5, 1.75, None, 0.0]  # None: naive met no rate
    assert (naive["max_rate_at_target"]["median"], naive["max_rate_at_target"]["n"]) == (1.625, 4)
    assert "naive/h2o / none" in got["ratios"] and "none / none" not in got["ratios"]
    assert "repack/h2o / naive/h2o: 1.625× (min 0, max 2; 4 of 5 repeats)" in headline(got)


def test_a_variant_that_met_the_grid_top_makes_its_ratios_lower_bounds():
    """Repack met every rate up to the grid's top (0.6) in two repeats and missed 0.5 in a third: those two
    ratios are lower bounds, counted, and the headline says so; when every repeat is one it writes "≥"."""
    from vtoken.bench.served.summary import at_grid_top, headline, summarize

    def v(mode, rate, ran):
        runs = [{"rate": r} for r in ran]
        return {**_variant(mode, "h2o" if mode != "none" else None, mode != "none", rate, rate), "runs": runs}

    grid = [0.2, 0.25, 0.3, 0.4, 0.5, 0.6]
    table = [(0.25, 0.2, 0.6, grid), (0.25, 0.25, 0.6, grid), (0.2, 0.2, 0.4, grid[:5])]
    repeats = [[v("none", n, grid[:3]), v("naive", nv, grid[:3]), v("repack", r, ran)] for n, nv, r, ran in table]
    assert at_grid_top(repeats[0][2]) and not at_grid_top(repeats[2][2]) and not at_grid_top(repeats[0][0])
    assert not at_grid_top(_variant("none", None, False, 0.2, 0.2))  # no runs recorded: no claim
    got = summarize(repeats)
    stock = got["ratios"]["repack/h2o +admission / none"]
    assert stock["max_rate_at_target"]["values"] == [2.4, 2.4, 2.0] and stock["lower_bounds"] == 2
    assert (
        "repack/h2o +admission / none: 2.4× (min 2, max 2.4; 3 of 3 repeats; 2 a lower bound: met the "
        "grid's top)" in headline(got)
    )
    every = summarize(repeats[:2])
    assert "repack/h2o +admission / none: ≥ 2.4× (min 2.4, max 2.4; 2 of 2 repeats)" in headline(every)


def test_each_repeat_replays_another_workload_seed():
    s = ServeBenchSetup(model="tiny-llama", seed=7, repeats=3)
    seeds = [client_command(s, "http://x", "/m", 1.0, "/tmp/r", "x.json", i) for i in range(3)]
    drawn = [cmd[cmd.index("--seed") + 1] for cmd in seeds]
    assert drawn == ["7", "8", "9"]  # repeat 0 keeps --seed: a one-repeat run replays the older workload


def test_an_admission_variant_is_also_compared_with_stock_under_the_same_cap():
    from vtoken.bench.served.summary import summarize

    def v(mode, policy, admission, rate):
        return {
            "mode": mode,
            "policy": policy,
            "admission": admission,
            "max_rate_at_target": rate,
            "rate_at_target_interpolated": rate,
            "runs": [{"rate": 1.0}],
        }

    rep = [v("none", None, False, 0.5), v("none", None, True, 0.8), v("repack", "h2o", True, 1.0)]
    ratios = summarize([rep])["ratios"]
    control = [r for k, r in ratios.items() if r["baseline"] == "stock+admission"]
    assert len(control) == 1 and control[0]["max_rate_at_target"]["median"] == 1.25
    assert [r["max_rate_at_target"]["median"] for r in ratios.values() if r["baseline"] == "stock"] == [1.6, 2.0]


def test_bursts_and_mixed_lengths_reach_the_client_and_size_the_engine():
    plain = ServeBenchSetup(model="tiny-llama", input_len=100, output_len=50)
    cmd = client_command(plain, "http://x", "/m", 1.0, "/tmp/r", "x.json")
    assert "--burstiness" not in cmd and "--random-range-ratio" not in cmd  # Poisson, fixed lengths: as before
    bursty = ServeBenchSetup(model="tiny-llama", input_len=100, output_len=50, burstiness=0.25, range_ratio=0.9)
    cmd = client_command(bursty, "http://x", "/m", 1.0, "/tmp/r", "x.json")
    assert cmd[cmd.index("--burstiness") + 1] == "0.25" and cmd[cmd.index("--random-range-ratio") + 1] == "0.9"
    assert bursty.longest_output() == 95 and bursty.longest_request() > plain.longest_request() + 90


def test_bad_burst_settings_are_refused_by_name():
    from typer.testing import CliRunner

    from vtoken.cli import app

    for args, needle in (
        (["--burstiness", "0"], "--burstiness 0.0"),
        (["--range-ratio", "1.5"], "--range-ratio 1.5"),
        (["--dataset", "chat", "--range-ratio", "0.5"], "chat sets its own"),
    ):
        res = CliRunner().invoke(app, ["bench", "serve", "--model", "tiny-llama", *args])
        assert res.exit_code != 0 and needle in res.output, (args, res.output)


def test_pressure_variants_run_beside_the_fixed_budget_and_are_compared_with_it():
    """--triggers step,pressure: each evicting variant once per trigger; a pressure variant's server evicts
    only when short (its budget a floor), and the summary compares it with stock, stock + the same admission
    cap, Naive-Evict under pressure and the same mode with the fixed budget."""
    from vtoken.bench.served.plan import Variant
    from vtoken.bench.served.summary import baselines, summarize

    s = ServeBenchSetup(
        model="tiny-llama", modes=("none", "naive", "repack"), triggers=("step", "pressure"), admission=(True,)
    )
    assert s.variants() == [
        ("none", None, False, "step"),
        ("none", None, True, "step"),
        ("naive", "h2o", True, "step"),
        ("naive", "h2o", True, "pressure"),
        ("repack", "h2o", True, "step"),
        ("repack", "h2o", True, "pressure"),
    ]
    assert variant_config(s, "repack", "h2o", True, trigger="pressure").vtoken.trigger.value == "pressure"
    assert variant_config(s, "repack", "h2o", True).vtoken.trigger.value == "step"
    assert [name for name, _ in baselines(Variant("repack", "h2o", True, "pressure"))] == [
        "stock",
        "stock+admission",
        "naive",
        "fixed",
    ]
    assert baselines(Variant("repack", "h2o", True, "pressure"))[2][1] == ("naive", "h2o", True, "pressure")
    rows = [("none", None, False, 0.2), ("repack", "h2o", False, 0.3)]
    rep = [{**_variant(m, p, a, r, r), "trigger": "step"} for m, p, a, r in rows]
    rep.append({**_variant("repack", "h2o", False, 0.45, 0.45), "trigger": "pressure"})
    got = summarize([rep])
    assert got["ratios"]["repack/h2o@pressure / repack/h2o"]["baseline"] == "fixed"
    assert got["ratios"]["repack/h2o@pressure / repack/h2o"]["max_rate_at_target"]["values"] == [1.5]
    assert "repack/h2o@pressure" in got["variants"] and "repack/h2o" in got["variants"]


def test_replica_metrics_read_what_the_runs_requests_paid():
    """The cost histograms' growth between the first and the last scrape: requests finished, trimmed (above
    the le="0.0" bucket), the mean share lost, tokens and attention mass evicted, pressure rounds."""
    share, tokens, mass = (names.REQUEST_EVICTED_SHARE, names.REQUEST_EVICTED_TOKENS, names.REQUEST_EVICTED_MASS)

    def scrape(n, untrimmed, share_sum, tokens_sum, scored, mass_sum, rounds):
        lab = '{replica="r"}'
        return (
            f'{share.bucket}{{le="0.0",replica="r"}} {untrimmed}\n{share.bucket}{{le="0.5",replica="r"}} {n}\n'
            f"{share.count}{lab} {n}\n{share.sum}{lab} {share_sum}\n{tokens.sum}{lab} {tokens_sum}\n"
            f"{mass.count}{lab} {scored}\n{mass.sum}{lab} {mass_sum}\n{names.PRESSURE_ROUNDS.total}{lab} {rounds}\n"
        )

    seen = ReplicaMetrics("http://unused")
    seen.read(scrape(10, 8, 0.5, 40, 2, 0.02, 3))
    seen.read(scrape(20, 14, 2.3, 200, 6, 0.1, 9))  # 10 finished, 4 trimmed, shares summing to 1.8
    assert seen.cost == {
        "finished": 10,
        "trimmed": 4,
        "trimmed_share": 0.4,
        "evicted_share_mean": 0.18,
        "evicted_share_mean_trimmed": 0.45,
        "evicted_tokens": 160,
        "evicted_mass_mean": 0.02,
        "pressure_rounds": 6,
    }
    assert ReplicaMetrics("http://unused").cost is None  # a server without the histograms
