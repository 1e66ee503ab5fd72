"""The simulator: the batched engine equals the core-driven one; the CLI keeps its contract."""

import json
import math
from dataclasses import replace

import numpy as np
import pytest
from typer.testing import CliRunner

from vtoken.cli import app
from vtoken.core.config import Mode
from vtoken.core.manager import CacheManager
from vtoken.core.step_stats import StepScores
from vtoken.errors import ConfigError
from vtoken.policies import get_policy_class, policy_names
from vtoken.sim.exact import request_name, simulate_exact
from vtoken.sim.fast import simulate_fast
from vtoken.sim.run import SimConfig, run_simulation
from vtoken.sim.source import UNSIMULATED, SyntheticConfig, SyntheticSource, TraceSource

runner = CliRunner()
# every registered policy the simulator runs; the others read a statistic no source has and are refused
# (test_policies_reading_the_keys_are_refused_by_name)
SIMULATED = [p for p in policy_names() if not get_policy_class(p).needs & UNSIMULATED]


def tallies_equal(a, b):
    assert a.requests == b.requests
    np.testing.assert_array_equal(a.packing_per_step_sum, b.packing_per_step_sum)
    for m in a.modes:
        np.testing.assert_array_equal(a.modes[m].per_step_sum, b.modes[m].per_step_sum, err_msg=m)
        np.testing.assert_array_equal(np.concatenate(a.modes[m].peaks), np.concatenate(b.modes[m].peaks))
        assert (a.modes[m].moves, a.modes[m].moves_lower_bound) == (b.modes[m].moves, b.modes[m].moves_lower_bound)


@pytest.mark.parametrize("trigger", ["step", "block"])
@pytest.mark.parametrize("policy", SIMULATED)
def test_fast_engine_equals_exact_engine(policy, trigger):
    cfg = SimConfig.of(
        policy=policy,
        budget="0.3",
        block_size=8,
        prompt_len=150,
        gen_len=40,
        requests=3,
        sinks=2,
        recent=8,
        trigger=trigger,
    ).vtoken
    source = SyntheticSource(SyntheticConfig(), 3, 190, seed=11, first=5)
    exact = simulate_exact(cfg, source, 150, 40, first_request=5, check=True)
    fast = simulate_fast(cfg, source, 150, 40, first_request=5)
    tallies_equal(exact, fast)
    assert fast.modes["repack"].moves > fast.modes["reuse+repack"].moves  # holes reused for decode tokens


@pytest.mark.parametrize(
    "protection",
    [{"prompt_tail": 40}, {"scope": "generated"}, {"prompt_scores": "window"}],
    ids=["tail", "generated", "question-aware"],
)
@pytest.mark.parametrize("policy", ["h2o", "snapkv", "random"])
def test_fast_engine_equals_exact_engine_with_a_protected_prompt(policy, protection):
    cfg = replace(
        SimConfig.of(
            policy=policy, budget="0.3", block_size=8, prompt_len=150, gen_len=60, requests=3, sinks=2, recent=8
        ).vtoken,
        **protection,
    )
    source = SyntheticSource(SyntheticConfig(), 3, 210, seed=11, first=5)
    exact = simulate_exact(cfg, source, 150, 60, first_request=5, check=True)
    fast = simulate_fast(cfg, source, 150, 60, first_request=5)
    tallies_equal(exact, fast)
    if "prompt_scores" not in protection:
        plain = simulate_fast(replace(cfg, prompt_tail=0, scope="all"), source, 150, 60, first_request=5)
        assert fast.modes["repack"].per_step_sum.sum() > plain.modes["repack"].per_step_sum.sum()  # keeps more


def test_policies_reading_the_keys_are_refused_by_name():
    """R-KV's redundancy is measured from the keys, which no source holds: every entry point refuses it with a
    ConfigError naming the policy and the statistic, never a run on zeros."""
    refused = sorted(set(policy_names()) - set(SIMULATED))
    assert refused == ["rkv"]
    source = SyntheticSource(SyntheticConfig(), 1, 40, seed=1)
    for policy in refused:
        cfg = SimConfig.of(policy="h2o", budget="0.3", block_size=8, prompt_len=30, gen_len=10, requests=1).vtoken
        cfg = replace(cfg, policy=policy)
        for call in (
            lambda policy=policy: SimConfig.of(policy=policy, budget="0.3"),
            lambda cfg=cfg: simulate_exact(cfg, source, 30, 10),
            lambda cfg=cfg: simulate_fast(cfg, source, 30, 10),
        ):
            with pytest.raises(ConfigError, match=rf"policy '{policy}' cannot be simulated: it reads redundancy"):
                call()
    res = runner.invoke(app, ["simulate", "--policy", "rkv", "--requests", "1", "--json"])
    assert res.exit_code != 0 and "cannot be simulated" in res.output


def test_requests_do_not_depend_on_their_batch():
    a = SyntheticSource(SyntheticConfig(), 70, 64, seed=3, first=60)
    b = SyntheticSource(SyntheticConfig(), 10, 64, seed=3, first=100)
    np.testing.assert_array_equal(a.w[40:50], b.w)
    np.testing.assert_allclose(a.Z[40:50], b.Z, rtol=1e-12)


def test_recorded_trace_source_replays_like_the_formula():
    """A trace materialised from the synthetic formula gives the same blocks as the formula itself."""
    P, M = 120, 30
    syn = SyntheticSource(SyntheticConfig(hh_sigma=2.5), 2, P + M, seed=2)
    s_idx = np.arange(P + M)
    attn = np.stack([np.tril(np.stack([syn.attention_row(r, s, s_idx) for s in s_idx])) for r in range(2)])
    trace = TraceSource(attn, syn.key_norm)
    cfg = SimConfig.of(
        policy="h2o", budget="0.25", block_size=8, prompt_len=P, gen_len=M, requests=2, sinks=2, recent=8
    ).vtoken
    a, b = simulate_fast(cfg, syn, P, M), simulate_fast(cfg, trace, P, M)
    for m in a.modes:
        np.testing.assert_allclose(a.modes[m].per_step_sum, b.modes[m].per_step_sum, atol=1.0, err_msg=m)


def held_by_the_rule(mode: str, live: np.ndarray, seen: int, B: int) -> int:
    """Blocks a request must hold, from its live set alone (docs/core.md's table): ⌈seen/B⌉ without
    eviction; ⌈live/B⌉ when repacked; naive: the original blocks (logical // B) that still hold a live
    token, plus the partly filled last block, never below ⌈live/B⌉."""
    if mode == "none":
        return math.ceil(seen / B)
    packed = math.ceil(live.size / B)
    if mode != "naive":
        return packed
    blocks = set((live // B).tolist())
    partial = int(seen % B != 0 and seen // B not in blocks)
    return max(packed, len(blocks) + partial)


@pytest.mark.parametrize("trigger", ["step", "block"])
@pytest.mark.parametrize("policy", SIMULATED)
def test_blocks_taken_from_the_pool_follow_the_live_set(policy, trigger):
    """The retained-block figures, measured: one ``CacheManager`` per mode drives 2 requests through its
    real ``BlockPool``; after every decode step the blocks taken from the pool must equal what the live
    sets require, and the fast engine's per-step series (every headline number) must equal those counts."""
    P, M, R, B = 100, 30, 2, 8
    cfg = SimConfig.of(
        policy=policy,
        budget="0.3",
        block_size=B,
        prompt_len=P,
        gen_len=M,
        requests=R,
        sinks=2,
        recent=8,
        trigger=trigger,
    ).vtoken
    source = SyntheticSource(SyntheticConfig(), R, P + M, seed=4)
    total, last, bits, window = source.prefill(P, True, True)
    managers = {m.value: CacheManager(replace(cfg, mode=m), num_blocks=R * math.ceil((P + M) / B)) for m in Mode}
    for mode, m in managers.items():
        for r in range(R):
            m.add_request(request_name(r))
            m.place(request_name(r), P, source.key_norm[r, :P])
            if mode != "none":
                m.observe(request_name(r), StepScores(np.arange(P), P, total[r], last[r], bits[r], window=window[r]))
    held = {mode: np.zeros(M) for mode in managers}
    for d in range(M):
        n = P + d  # the decode token of this step
        for r in range(R):
            for mode, m in managers.items():
                m.step(request_name(r), 1, source.key_norm[r, n : n + 1])
                if mode != "none":
                    live = m.tables[request_name(r)].live_logicals()
                    a = source.attention_row(r, n, live)
                    m.observe(request_name(r), StepScores(live, 1, a, a, (a < 1 / (n + 1)).astype(np.uint64)))
        for mode, m in managers.items():
            held[mode][d] = m.pool.num_blocks - m.pool.num_free
            rule = sum(held_by_the_rule(mode, m.tables[request_name(r)].live_logicals(), n + 1, B) for r in range(R))
            assert held[mode][d] == rule, (mode, d)
    assert held["naive"].sum() > held["repack"].sum()  # measured: eviction leaves scattered survivors
    fast = simulate_fast(cfg, source, P, M)
    for mode in managers:
        np.testing.assert_array_equal(fast.modes[mode].per_step_sum, held[mode], err_msg=mode)


def test_contract_and_orderings():
    args = {
        "policy": "h2o",
        "budget": "0.2",
        "block_size": 16,
        "prompt_len": 256,
        "gen_len": 32,
        "requests": 8,
        "seed": 1,
    }
    res = runner.invoke(
        app,
        [
            "simulate",
            "--policy",
            "h2o",
            "--budget",
            "0.2",
            "--block-size",
            "16",
            "--prompt-len",
            "256",
            "--gen-len",
            "32",
            "--requests",
            "8",
            "--seed",
            "1",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert {"policy", "budget", "block_size", "requests", "packing_bound_mean", "modes"} <= out.keys()
    assert (out["policy"], out["budget"], out["block_size"], out["requests"]) == ("h2o", 0.2, 16, 8)
    modes = out["modes"]
    assert set(modes) == {"none", "naive", "repack", "reuse+repack"}
    for m in modes.values():
        assert {"retained_blocks_mean", "peak_blocks"} <= m.keys()
    direct, _ = run_simulation(SimConfig.of(**args))  # the CLI reports the run its flags describe
    assert modes == direct["modes"] and out["packing_bound_mean"] == direct["packing_bound_mean"]
    for m in ("repack", "reuse+repack"):
        assert modes[m]["moves_total"] == modes[m]["moves_lower_bound"] > 0
    # measured orderings (the block counts themselves: test_blocks_taken_from_the_pool_follow_the_live_set)
    assert modes["reuse+repack"]["moves_total"] < modes["repack"]["moves_total"]
    assert modes["naive"]["retained_blocks_mean"] > modes["repack"]["retained_blocks_mean"]


def test_table_and_plot(tmp_path):
    png = tmp_path / "blocks.png"
    res = runner.invoke(
        app, ["simulate", "--requests", "4", "--prompt-len", "128", "--gen-len", "16", "--plot", str(png)]
    )
    assert res.exit_code == 0, res.output
    assert "reuse+repack" in res.stdout and "packing bound" in res.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--policy", "lru"], "unknown policy 'lru'"),
        (["--budget", "1.5"], "invalid budget '1.5'"),
        (["--budget", "-2"], "'-2'"),
        (["--budget", "lots"], "'lots'"),
        (["--block-size", "24"], "got 24"),
        (["--block-size", "0"], "got 0"),
        (["--prompt-len", "0"], "prompt-len must be a positive integer, got 0"),
        (["--gen-len", "-1"], "gen-len must be a positive integer, got -1"),
        (["--requests", "0"], "requests must be a positive integer, got 0"),
        (["--trigger", "often"], "unknown repack trigger 'often'"),
        (["--engine", "gpu"], "unknown engine 'gpu'"),
        (["--traces", "/nonexistent.npz"], "/nonexistent.npz"),
    ],
)
def test_bad_input_exits_2_naming_the_value(args, needle):
    res = runner.invoke(app, ["simulate", "--json", "--requests", "2", "--prompt-len", "64", "--gen-len", "4", *args])
    assert res.exit_code == 2, res.output
    assert needle in res.output
    assert "Traceback" not in res.output


def test_workers_give_the_same_answer():
    base = dict(policy="random", budget="0.5", block_size=16, prompt_len=200, gen_len=20, requests=12, chunk=4)
    one, _ = run_simulation(SimConfig.of(**base))
    two, _ = run_simulation(SimConfig.of(**base, workers=2))
    assert one["modes"] == two["modes"]


def test_simulator_leaves_no_llvmlite_behind():
    """vLLM 0.32's CPU kernel registration scans every module namespace and crashes on llvmlite's
    ``ffi.lib`` object, so the simulator must not import numba/llvmlite into a process that may also
    start an in-process vLLM engine (the test session itself does)."""
    import subprocess
    import sys

    code = (
        "import sys; from vtoken.sim.run import SimConfig, run_simulation; "
        "run_simulation(SimConfig.of(requests=2, prompt_len=64, gen_len=4)); "
        "print('llvmlite' in sys.modules or 'numba' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------------------------ hybrid models: whole pool
def test_window_blocks_known_answers():
    """vLLM's sliding-window row after ``seen`` tokens (B = 4, window 6): the next token attends the last 5,
    whole blocks before them went back to the pool."""
    from vtoken.sim.result import window_blocks

    seen = np.array([1, 4, 5, 8, 9, 12, 13, 14, 100])
    # skipped tokens max(seen - 5, 0) -> whole blocks skipped 0 0 0 0 1 1 2 2 23; rows ceil(seen / 4)
    assert window_blocks(seen, 6, 4).tolist() == [1, 1, 2, 2, 2, 2, 2, 2, 2]
    assert window_blocks(np.array([10]), 1000, 4).tolist() == [3]  # window longer than the context: all


def test_whole_pool_adds_the_same_sliding_blocks_to_every_mode():
    """A hybrid shape (window 64, 3 sliding-window groups): every mode's pool = its full-group blocks + the
    sliding groups' mean (the same in every mode); repack's saving is smaller on the whole pool than on the
    full group alone, and both are reported."""
    from vtoken.sim.result import window_blocks

    cfg = SimConfig.of(
        policy="h2o", budget=0.2, block_size=16, prompt_len=256, gen_len=64, requests=8, window=64, window_groups=3
    )
    out, _ = run_simulation(cfg)
    pool = out["pool"]
    sliding = 3 * window_blocks(256 + np.arange(1, 65), 64, 16).mean()
    assert pool["sliding_blocks_mean"] == pytest.approx(sliding) and sliding > 0
    for m, e in out["modes"].items():
        assert pool["modes"][m]["pool_blocks_mean"] == pytest.approx(e["retained_blocks_mean"] + sliding)
    assert out["modes"]["repack"]["vs_naive_pct"] < pool["modes"]["repack"]["vs_naive_pct"] < 0
    from vtoken.sim.run import HYBRID_KEYS, RESULT_KEYS

    plain, _ = run_simulation(replace(cfg, window=None, window_groups=0))
    assert set(out) == RESULT_KEYS | HYBRID_KEYS and set(plain) == RESULT_KEYS
    assert plain["modes"] == out["modes"]


@pytest.mark.parametrize("window,groups", [(64, 0), (None, 2), (0, 2), (64, -1)])
def test_window_and_groups_go_together(window, groups):
    r = CliRunner().invoke(
        app,
        ["simulate", "--requests", "2"]
        + (["--window", str(window)] if window is not None else [])
        + ["--window-groups", str(groups)],
    )
    assert r.exit_code == 2 and "window and window-groups go together" in r.stderr, r.output


def test_keep_mass_runs_on_the_exact_engine_and_saves_blocks_without_a_fixed_budget():
    """``keep_mass`` (the adaptive budget) with budget 1.0: the exact engine evicts by the attention mass
    alone (repack holds fewer blocks than no eviction, at most naive's); the fast engine, whose requests share
    one live count, refuses it by name."""
    base = dict(policy="h2o", budget=1.0, keep_mass=0.9, block_size=16, prompt_len=128, gen_len=32, requests=4)
    out, _ = run_simulation(SimConfig.of(**base, engine="exact"))
    modes = out["modes"]
    assert modes["repack"]["retained_blocks_mean"] < modes["none"]["retained_blocks_mean"]
    assert modes["repack"]["retained_blocks_mean"] <= modes["naive"]["retained_blocks_mean"]
    assert out["live_tokens_mean"] < 128 + 16
    r = CliRunner().invoke(app, ["simulate", "--budget", "1.0", "--requests", "2", "--keep-mass", "0.9"])
    assert r.exit_code == 2 and "keep_mass runs on the exact engine only" in r.stderr, r.output
