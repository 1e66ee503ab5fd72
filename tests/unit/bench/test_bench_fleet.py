"""``vtoken bench fleet``: the JSON contract on a small fleet, and that its KV router and autoscaler are the
project's own code (same functions, same decisions), not re-implementations."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import numpy as np
import pytest
from support.paths import ROOT
from typer.testing import CliRunner

from vtoken.bench.fleet import model as fleet_model
from vtoken.bench.fleet import sim as fleet_sim
from vtoken.bench.fleet.model import KVAware, make_router
from vtoken.bench.fleet.sim import View
from vtoken.core.reporting.engine_kv import KVSnapshot
from vtoken.serve.control import autoscaling, ranking
from vtoken.serve.telemetry.stat_logger import routing_stats

STEPS = ROOT / "docs" / "results" / "fleet-steps.json"


def run_cli(*args: str):
    from vtoken.cli import app

    return CliRunner().invoke(app, ["bench", "fleet", *args])


@pytest.mark.timeout(300)
def test_small_fleet_json_contract(tmp_path):
    out = tmp_path / "fleet.json"
    r = run_cli(
        "--replicas",
        "6",
        "--loads",
        "0.6,1.3",
        "--duration",
        "14",
        "--warmup",
        "4",
        "--decision-sizes",
        "8,32",
        "--steps",
        str(STEPS),
        "--json",
        "--out",
        str(out),
    )
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report == json.loads(out.read_text())
    assert report["bench"] == "fleet" and report["replicas"] == 6 and report["environment"]["cores"]
    assert report["service_times"]["source"] == "measured engine steps on this machine"
    assert report["service_times"]["fit"]["per_seq_ms"] >= 0 and report["service_times"]["decode_step_ms"]
    assert report["project_code"]["kv_router"].startswith("vtoken.serve.control.ranking")
    assert len(report["runs"]) == 4 * 2 * 2  # routers × modes × loads
    for run in report["runs"]:
        assert 0.0 <= run["slo_attainment"] <= 1.0 and run["goodput_req_s"] >= 0 and run["requests"] > 0
        assert run["decision_us"] > 0 and run["router"] in fleet_model.ROUTERS
    naive = {r["load"]: r for r in report["runs"] if r["mode"] == "naive" and r["router"] == "round_robin"}
    assert naive[1.3]["mean_kv_utilization"] > naive[0.6]["mean_kv_utilization"]  # load fills the pools
    blocks = report["kv_per_request_blocks_mean"]
    assert all(r < n for r, n in zip(blocks["repack"], blocks["naive"], strict=True))  # vToken's core
    for mode in ("naive", "repack"):
        need = report["replicas_needed"][mode]
        assert 1 <= need["min_fixed_replicas_meeting_slo"] <= 12  # searched up to twice the fleet
        assert 1 <= need["autoscaler"]["replicas_mean"] <= 12
    assert set(report["decision_cost_us"]) == {"8", "32"}
    assert set(report["decision_cost_us"]["32"]) == set(fleet_model.ROUTERS)


def test_bad_input_is_refused():
    r = run_cli("--routers", "kv,random", "--steps", str(STEPS))
    assert r.exit_code == 2 and "--routers" in r.output


def view_with(stats: list[dict], queue: list[int]) -> View:
    v = View(len(stats))
    for i, s in enumerate(stats):
        v.set_stats(i, s)
    v.queue[:] = queue
    return v


def test_kv_router_decides_as_the_projects_ranking():
    """Free KV alone, fragmentation, and queued requests each change the winner here: a router that
    dropped or re-weighted any term of ``effective_free_tokens`` would pick another replica."""
    assert fleet_model.effective_free_tokens is ranking.effective_free_tokens
    assert fleet_model.rank_by_kv is ranking.rank_by_kv
    now = 100.0
    snaps = [  # (held blocks, live tokens, running) on 128-block pools of 32-token blocks
        KVSnapshot(live_tokens=40 * 32, held_blocks=40, pool_blocks=128, num_running=2, at=now),  # dense
        KVSnapshot(live_tokens=10 * 32, held_blocks=36, pool_blocks=128, num_running=2, at=now),  # holes
        KVSnapshot(live_tokens=30 * 32, held_blocks=30, pool_blocks=128, num_running=2, at=now),  # queued
        KVSnapshot(live_tokens=60 * 32, held_blocks=60, pool_blocks=128, num_running=2, at=now),
    ]
    stats = [routing_stats(s, now) for s in snaps]
    queue = [2, 2, 5, 2]
    params = ranking.RouterParams()
    scores = [(r, ranking.effective_free_tokens(stats[r], queue[r], params, now)) for r in range(4)]
    expected = ranking.rank_by_kv(scores, params.tie_tokens, random.Random(0))
    router = KVAware(seed=0)
    assert router.ranks(stats, queue, list(range(4)), now) == expected
    assert router.choose(view_with(stats, queue), np.arange(4), now) == expected[0][0] == 0
    # the fragmentation term: replica 1 holds fewer blocks (more free KV) but wastes 26 of its 36 blocks
    assert snaps[1].free_kv_tokens > snaps[0].free_kv_tokens
    # the queue term: replica 2 has the most free KV, but 3 requests wait there
    assert snaps[2].free_kv_tokens == max(s.free_kv_tokens for s in snaps)
    # stale stats go last, none at all → power of two
    stale = [dict(s, polled_at=now - 60) for s in stats]
    assert router.choose(view_with(stale[:1] + stats[1:], queue), np.arange(4), now) != 0
    empty = KVAware(seed=0)
    empty.choose(view_with([None] * 4, queue), np.arange(4), now)
    assert empty.fallbacks == 1


def test_autoscaling_in_the_simulation_is_the_projects_decide():
    assert fleet_sim.decide is autoscaling.decide
    from vtoken.bench.fleet.model import WORKLOAD, kv_profiles
    from vtoken.bench.fleet.sim import FleetSpec, simulate
    from vtoken.bench.fleet.steps import load_steps
    from vtoken.serve.telemetry.sla import SloTargets

    step, _ = load_steps(STEPS)
    profiles = kv_profiles(WORKLOAD, requests=4)["naive"]
    spec = FleetSpec(
        8,
        64,
        16,
        32,
        step,
        WORKLOAD,
        profiles,
        SloTargets(2.0, 0.2),
        duration_s=60,
        warmup_s=10,
        autoscale=autoscaling.ScalingParams(),
        min_replicas=1,
        initial_replicas=1,
        startup_s=5,
        upscale_delay_s=1,
    )
    run = simulate(spec, make_router("kv"), rate=6.0)
    trace = run["replicas_trace_1s"]
    assert trace[0] == 1 and max(trace) > 1  # KV pressure on one replica made decide() add replicas


# ------------------------------------------------------------------ known answers, derived by hand
# Every scenario below uses one step model with round numbers (``StepModel.seconds(n_decode, prefill)``):
#   a decode step of n requests   0.010 + 0.015·n s   (1 request: 0.025 s, 2 requests: 0.040 s)
#   each prompt token prefilled   0.0001 s            (200 tokens: 0.020 s, 1300 tokens: 0.130 s)
# and ticks of 0.1 s. The simulation's time model, per tick and replica: 0.1 s of credit, less the debt
# of last tick's prefills; a prompt admitted in the tick charges its tokens' time; what is left is decode
# steps of the running batch (fractions carry). A request's first token comes with the step holding its
# prefill; gen − 1 decode steps follow; TPOT = (done − first token) / (gen − 1). Arrivals sit on tick
# boundaries (see test_a_mid_tick_arrival_is_admitted_at_the_tick_start for why).
SHORT = fleet_model.RequestClass(prompt=200, gen=11, weight=1.0)  # 10 decode steps after the first token
LONG = fleet_model.RequestClass(prompt=200, gen=21, weight=1.0)  # 20 decode steps
BIG_PROMPT = fleet_model.RequestClass(prompt=1300, gen=11, weight=1.0)  # its prefill outlasts a tick


def kat_spec(schedule, classes, replicas=1, max_seqs=4, slo=(1.0, 1.0), duration_s=1.0, warmup_s=0.0, drain_s=5.0):
    """A fleet serving ``schedule`` ((arrival s, class index), ...) with flat KV use: 8 blocks of a
    64-block pool per request, so no preemption and no admission short of blocks."""
    from vtoken.bench.fleet.model import KVProfile
    from vtoken.bench.fleet.sim import FleetSpec
    from vtoken.bench.fleet.steps import StepModel
    from vtoken.serve.telemetry.sla import SloTargets

    step = StepModel(base_s=0.010, per_seq_s=0.015, per_token_s=0.0001)
    profiles = [KVProfile(-(-c.prompt // 32), np.full(c.gen, 8.0), np.full(c.gen, 100.0)) for c in classes]
    return FleetSpec(
        replicas,
        64,
        max_seqs,
        32,
        step,
        tuple(classes),
        profiles,
        SloTargets(*slo),
        duration_s=duration_s,
        warmup_s=warmup_s,
        drain_s=drain_s,
        tick_s=0.1,
        schedule=tuple(schedule),
    )


def kat_run(spec, router: str = "round_robin", **slo) -> dict:
    """``simulate`` once; ``ttft_s=…, tpot_s=…`` replace the spec's SLO for this run."""
    from vtoken.serve.telemetry.sla import SloTargets

    if slo:
        spec = replace(spec, slo=SloTargets(slo.get("ttft_s", spec.slo.ttft_s), slo.get("tpot_s", spec.slo.tpot_s)))
    return fleet_sim.simulate(spec, make_router(router), rate=1.0)


def test_one_request_ttft_tpot_and_the_tick_budget():
    """One SHORT request arriving at 0.0 on one replica:

    tick 0 (t=0.0)  credit 0.1; admitted; first token at 0 + 0.010 + 200·0.0001 = 0.030 → TTFT 0.030.
                    The prompt charges 0.020 → 0.080 left = 0.080 / 0.025 = 3.2 decode steps.
    tick 1 (t=0.1)  credit 0.1 = 4 steps → 7.2 of 10.
    tick 2 (t=0.2)  2.8 more steps = 0.070 s → done at 0.270.
    TPOT (0.270 − 0.030) / 10 = 0.024; finished 1 of 1; goodput 1 request / 1 s."""
    spec = kat_spec([(0.0, 0)], [SHORT], slo=(0.031, 0.025))
    run = kat_run(spec)
    assert (run["requests"], run["finished"], run["preemptions"]) == (1, 1, 0)
    assert run["ttft_p50_s"] == run["ttft_p99_s"] == 0.030
    assert run["tpot_p50_s"] == run["tpot_p99_s"] == 0.024
    assert (run["slo_attainment"], run["goodput_req_s"]) == (1.0, 1.0)
    # the SLO is the replicas' rule on these figures: 1 ms under either one and the request misses it
    assert kat_run(spec, ttft_s=0.029)["slo_attainment"] == 0.0
    assert kat_run(spec, tpot_s=0.023)["slo_attainment"] == 0.0


def test_a_full_replica_queues_the_next_request_until_a_slot_frees():
    """Two SHORT requests at 0.0 on one replica with one sequence slot (max_seqs=1).

    The first runs as in the test above: first token 0.030, done 0.270. The second waits; the slot
    frees inside tick 2 and admission runs at a tick's start, so it is admitted at t=0.3: first token
    0.3 + 0.030 = 0.330 (TTFT 0.330), done 0.3 + 0.270 = 0.570 (TPOT 0.024).
    TTFTs {0.030, 0.330}: p50 0.180, p99 0.030 + 0.99·0.300 = 0.327. TTFT SLO 0.1 s: 1 of 2 met."""
    run = kat_run(kat_spec([(0.0, 0), (0.0, 0)], [SHORT], max_seqs=1, slo=(0.1, 0.025)))
    assert (run["requests"], run["finished"]) == (2, 2)
    assert run["ttft_p50_s"] == pytest.approx(0.180, abs=1e-9)
    assert run["ttft_p99_s"] == pytest.approx(0.327, abs=1e-9)
    assert run["tpot_p50_s"] == run["tpot_p99_s"] == 0.024
    assert (run["slo_attainment"], run["goodput_req_s"]) == (0.5, 1.0)


def test_prompts_admitted_in_one_tick_share_one_prefill_step():
    """Two SHORT requests at 0.0 on one replica with two slots: both prompts go into tick 0's steps.

    The first's first token: 0.010 + 200·0.0001 = 0.030. The second's comes with the step holding both
    prompts beside the first (decoding): 0.010 + 0.015·1 + 400·0.0001 = 0.065. The 400 tokens charge
    0.040 → 0.060 left = 0.060 / 0.040 = 1.5 steps of the batch of two; then 2.5 per tick: 4.0, 6.5, 9.0
    after ticks 1–3; tick 4 needs 1.0 step = 0.040 s → both done at 0.440.
    TTFT {0.030, 0.065}; TPOT {(0.440 − 0.030)/10 = 0.041, (0.440 − 0.065)/10 = 0.0375}."""
    spec = kat_spec([(0.0, 0), (0.0, 0)], [SHORT], max_seqs=2)
    run = kat_run(spec)
    assert (run["requests"], run["finished"]) == (2, 2)
    assert run["ttft_p99_s"] == pytest.approx(0.030 + 0.99 * 0.035, abs=6e-4)
    assert run["tpot_p99_s"] == pytest.approx(0.0375 + 0.99 * 0.0035, abs=6e-5)
    assert kat_run(spec, ttft_s=0.07, tpot_s=0.042)["slo_attainment"] == 1.0
    assert kat_run(spec, ttft_s=0.06, tpot_s=0.042)["slo_attainment"] == 0.5  # the second's 0.065
    assert kat_run(spec, ttft_s=0.029, tpot_s=0.042)["slo_attainment"] == 0.0
    assert kat_run(spec, ttft_s=0.07, tpot_s=0.040)["slo_attainment"] == 0.5  # the first's 0.041
    assert kat_run(spec, ttft_s=0.07, tpot_s=0.037)["slo_attainment"] == 0.0


def test_a_prefill_longer_than_a_tick_carries_its_debt_into_the_next_tick():
    """One BIG_PROMPT request at 0.0: first token 0.010 + 1300·0.0001 = 0.140 (TTFT 0.140); its 0.130 s
    of prompt overdraws tick 0's 0.1 s by 0.030: no decode step in tick 0. Tick 1: 0.1 − 0.030 = 0.070
    s = 2.8 steps; tick 2: 6.8; tick 3: 3.2 steps = 0.080 s → done 0.380; TPOT (0.380 − 0.140)/10 = 0.024."""
    run = kat_run(kat_spec([(0.0, 0)], [BIG_PROMPT]))
    assert (run["finished"], run["ttft_p50_s"], run["tpot_p50_s"]) == (1, 0.140, 0.024)


def test_a_prompt_admitted_behind_a_prefill_waits_for_it_and_shares_the_steps():
    """BIG_PROMPT at 0.0 (as above), then a SHORT request at 0.1 on the same replica.

    tick 1 (t=0.1)  credit 0.070: the replica is busy 0.030 s finishing the first prefill, then the
                    SHORT prompt goes into a step beside 1 decoding request: first token
                    0.1 + 0.030 + (0.010 + 0.015·1 + 200·0.0001) = 0.175 (TTFT 0.075). Its prompt
                    charges 0.020 → 0.050 left = 0.050 / 0.040 = 1.25 steps of the batch of two.
    ticks 2–4       0.1 / 0.040 = 2.5 steps each: 3.75, 6.25, 8.75.
    tick 5 (t=0.5)  1.25 steps = 0.050 s → both done at 0.550.
    BIG_PROMPT: TTFT 0.140, TPOT (0.550 − 0.140)/10 = 0.041; SHORT: TTFT 0.075, TPOT (0.550 − 0.175)/10
    = 0.0375. TTFT p50 0.1075, p99 0.075 + 0.99·0.065 = 0.13935; TPOT p50 0.03925, p99 0.040965."""
    spec = kat_spec([(0.0, 0), (0.1, 1)], [BIG_PROMPT, SHORT])
    run = kat_run(spec)
    assert (run["requests"], run["finished"]) == (2, 2)
    assert run["ttft_p50_s"] == pytest.approx(0.1075, abs=6e-4)  # reported to 3 decimals (±half a unit)
    assert run["ttft_p99_s"] == pytest.approx(0.13935, abs=6e-4)
    assert run["tpot_p50_s"] == pytest.approx(0.03925, abs=6e-5)  # reported to 4 decimals
    assert run["tpot_p99_s"] == pytest.approx(0.040965, abs=6e-5)
    # each request's own figures, through the SLO (met iff TTFT ≤ ttft_s and TPOT ≤ tpot_s):
    # SHORT (0.075, 0.0375), BIG_PROMPT (0.140, 0.041)
    assert kat_run(spec, ttft_s=0.15, tpot_s=0.042)["slo_attainment"] == 1.0
    assert kat_run(spec, ttft_s=0.08, tpot_s=0.042)["slo_attainment"] == 0.5  # BIG_PROMPT's TTFT misses
    assert kat_run(spec, ttft_s=0.07, tpot_s=0.042)["slo_attainment"] == 0.0  # SHORT's misses too
    assert kat_run(spec, ttft_s=0.15, tpot_s=0.040)["slo_attainment"] == 0.5  # BIG_PROMPT's TPOT misses
    assert kat_run(spec, ttft_s=0.15, tpot_s=0.037)["slo_attainment"] == 0.0  # SHORT's misses too


def test_the_measured_window_and_unfinished_requests():
    """Arrivals at 0.0 (SHORT), 0.5 (SHORT) and 0.9 (LONG), warm-up 0.5 s, arrivals until 1.0 s, drain
    0.25 s (last tick starts at 1.2). The 0.0 request is before the window: not counted. The 0.5 one
    runs as in the first test, 0.5 + 0.030 → 0.5 + 0.270. The LONG one needs 20 decode steps: 3.2 in
    tick 0.9, then 4 per tick in ticks 1.0, 1.1, 1.2 → 15.2 at the end: unfinished. In the window:
    2 requests, 1 finished (TTFT 0.030, TPOT 0.024); attainment 1/2 (an unfinished request misses);
    goodput 1 request / (1.0 − 0.5) s = 2.0/s."""
    run = kat_run(kat_spec([(0.0, 0), (0.5, 0), (0.9, 1)], [SHORT, LONG], warmup_s=0.5, drain_s=0.25))
    assert (run["requests"], run["finished"]) == (2, 1)
    assert (run["ttft_p50_s"], run["tpot_p50_s"]) == (0.030, 0.024)
    assert (run["slo_attainment"], run["goodput_req_s"]) == (0.5, 2.0)


def test_a_mid_tick_arrival_gets_its_first_token_a_prefill_after_it_arrived():
    """A SHORT request arriving at 0.05 is routed and admitted in tick 0 (arrivals before t + tick_s); its
    prefill step starts when it arrived, not at the tick's start: first token at 0.05 + 0.030, TTFT 0.030
    (before the fix: put at 0 + 0.030, TTFT −0.020)."""
    run = kat_run(kat_spec([(0.05, 0)], [SHORT]))
    assert abs(run["ttft_p50_s"] - 0.030) <= 0.0005


def test_replicas_needed_is_the_smallest_fleet_that_serves_a_burst_without_queueing():
    """A burst of 5 SHORT requests at 0.5 s; one sequence slot per replica; SLO TTFT 0.1 s.

    Stats were polled at 0.0 (all idle). The KV router charges each request routed to a replica
    (``tokens_per_queued_request`` = 256 > ``tie_tokens`` = 64) until the next poll, and picks the
    shortest queue within a rank: the burst spreads, at most ⌈5/N⌉ per replica. A replica's first
    request has TTFT 0.030 (as in the first test); its second waits for the slot: TTFT 0.330 > 0.1. So N
    ≤ 5 replicas meet the SLO for N of the 5 requests: attainment N/5. The search (fleet of 3:
    probes up to 6, bisection from (0, 6]): 6 → 1.0; 3 → 0.6; 4 → 0.8; 5 → 1.0 → answer 5.
    The autoscaler run (300 s from max(1, 3 // 4) = 1 replica, min 1): the 5 requests run one by one
    (admitted 0.5, 0.8, …, 1.7); at 1 s, 3 wait (5 s mean 3 ≥ 2 per replica: up), at 2 s none (mean
    1.5: hold), so the up decision lapses before its 5 s delay; no arrivals after: 1 replica at the end."""
    from vtoken.bench.fleet.bench import replicas_needed

    spec = kat_spec([(0.5, 0)] * 5, [SHORT], replicas=3, max_seqs=1, slo=(0.1, 0.05), drain_s=3.0)
    assert [kat_run(replace(spec, replicas=n), "kv")["slo_attainment"] for n in (2, 3, 4, 5, 6)] == [
        0.4,
        0.6,
        0.8,
        1.0,
        1.0,
    ]  # 2 replicas: 2 first, 2 second, 1 third in line (TTFT 0.630)
    need = replicas_needed(spec, 1.0, 0.99, echo=lambda _: None)
    assert need["min_fixed_replicas_meeting_slo"] == 5
    assert need["slo_probes"] == {"3": 0.6, "4": 0.8, "5": 1.0, "6": 1.0}
    assert need["autoscaler"]["replicas_at_end_of_arrivals"] == 1
    # a burst of 7 is more than twice the fleet's 3 can serve at this SLO: no fixed fleet found
    assert (
        replicas_needed(replace(spec, schedule=((0.5, 0),) * 7), 1.0, 0.99, echo=lambda _: None)[
            "min_fixed_replicas_meeting_slo"
        ]
        is None
    )
