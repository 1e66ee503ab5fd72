"""``vtoken bench fleet``: the JSON contract on a small fleet, and that its KV router and autoscaler are the
project's own code (same functions, same decisions), not re-implementations."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from vtoken.bench import fleet_model, fleet_sim
from vtoken.bench.fleet_model import KVAware, make_router
from vtoken.bench.fleet_sim import View
from vtoken.core.kvstats import KVSnapshot
from vtoken.serve.control import autoscaling, ranking
from vtoken.serve.telemetry.stats import routing_stats

ROOT = Path(__file__).resolve().parents[2]
STEPS = ROOT / "docs" / "results" / "fleet-steps.json"


def run_cli(*args: str):
    from vtoken.cli import app

    return CliRunner().invoke(app, ["bench", "fleet", *args])


@pytest.mark.timeout(300)
def test_small_fleet_json_contract(tmp_path):
    out = tmp_path / "fleet.json"
    r = run_cli("--replicas", "6", "--loads", "0.6,1.3", "--duration", "14", "--warmup", "4",
                "--decision-sizes", "8,32", "--steps", str(STEPS), "--json", "--out", str(out))
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
    from vtoken.bench.fleet_model import WORKLOAD, kv_profiles
    from vtoken.bench.fleet_sim import FleetSpec, simulate
    from vtoken.bench.fleet_steps import load_steps
    from vtoken.serve.telemetry.sla import SloTargets

    step, _ = load_steps(STEPS)
    profiles = kv_profiles(WORKLOAD, requests=4)["naive"]
    spec = FleetSpec(8, 64, 16, 32, step, WORKLOAD, profiles, SloTargets(2.0, 0.2), duration_s=60,
                     warmup_s=10,
                     autoscale=autoscaling.ScalingParams(), min_replicas=1, initial_replicas=1, startup_s=5,
                     upscale_delay_s=1)
    run = simulate(spec, make_router("kv"), rate=6.0)
    trace = run["replicas_trace_1s"]
    assert trace[0] == 1 and max(trace) > 1  # KV pressure on one replica made decide() add replicas
