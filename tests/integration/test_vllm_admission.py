"""SLO-aware admission in the vToken scheduler, in-process and without model weights (as
tests/support/scheduler.py builds it for test_vllm_async_scheduler.py; ``ModelRunnerOutput``s fed by hand).

The "GPU" is a fake clock: a decode step running ``n`` requests takes ``A + B·n`` seconds, a step that
prefills ``P`` more per prompt token. With a TPOT target that only ``DECODE_CAP`` requests would meet if
steps were decode only, admission also charges the prefills of the requests it admits (the overhead
term) and holds the running batch at ``CAP`` < ``DECODE_CAP`` while the rest wait: every request admitted
under the cap meets the target (at ``DECODE_CAP`` they would not), nothing is preempted, every request
finishes. With admission off the same workload runs ``max_num_seqs`` at once.
"""

from __future__ import annotations

import pytest
from support.scheduler import drive_scheduler, make_request, make_scheduler

from vtoken.core.batch.admission import HEADROOM, cap_for
from vtoken.vllm.gauges import admission_limit_from

A, B = 0.010, 0.010  # decode step = 10 ms + 10 ms per running request
P = 0.010  # + 10 ms per prefill token: a 16-token prompt makes its step 160 ms slower (not a batch-size cost)
TPOT_MS = 60.0  # 0.9·60 = 54 ms ⇒ decode only: 10 + 10·n ≤ 54 ⇒ n ≤ 4
# at a batch of 4, a request shares its steps with the prefills (150 ms each) of the requests admitted as
# others finish: measured up to 65 ms per token > 60. The overhead term (≈ 7 ms per step, averaged over all
# steps) makes the cap 3: ≤ 50 ms. Lengths differ so that admissions interleave with decoding.
DECODE_CAP, CAP, MAX_SEQS, N_REQ = 4, 3, 8, 32
GENS = [24 + (i * 7) % 33 for i in range(N_REQ)]  # 24 … 56 output tokens


def step_time(so) -> float:
    """The fake GPU: ``A + B·n`` seconds for a step running ``n`` requests, ``P`` more per prefill token."""
    n = len(so.num_scheduled_tokens)
    return A + B * n + P * (so.total_num_scheduled_tokens - n)


def drive(sched, requests, in_flight):
    return drive_scheduler(sched, requests, in_flight, step_time)


def workload():
    return [make_request(f"r{i}", 16, gen) for i, gen in enumerate(GENS)]


def finished_all(generated) -> bool:
    return [len(generated[f"r{i}"]) for i in range(N_REQ)] == GENS


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("mode", ["repack", "none"])
def test_tight_tpot_holds_the_batch_at_the_cap(async_scheduling, mode):
    sched = make_scheduler(
        async_scheduling=async_scheduling,
        max_num_seqs=MAX_SEQS,
        num_blocks=256,
        vtoken={"mode": mode, "admission_tpot_ms": TPOT_MS},
    )
    log, generated = drive(sched, workload(), 2 if async_scheduling else 1)
    assert finished_all(generated)  # everyone finished, nothing starved
    capped = [(run, wait, cap, adm) for run, wait, cap, adm in log if cap is not None]
    assert capped and all(cap == CAP for _, _, cap, _ in capped[len(capped) // 2 :])  # the fit found it
    a, b = sched._vt_steptime.fit()
    assert a == pytest.approx(A) and b == pytest.approx(B)  # decode steps only: prefills are not samples
    assert cap_for(a, b, TPOT_MS / 1000 * HEADROOM, MAX_SEQS) == DECODE_CAP  # the fit alone would allow 4
    # every request admitted once the first (uncapped) batch of MAX_SEQS had finished met its TPOT
    settled = max(generated[f"r{i}"][-1] for i in range(MAX_SEQS))
    tpots = [(t[-1] - t[0]) / (len(t) - 1) for t in generated.values() if t[0] > settled]
    assert len(tpots) >= N_REQ // 2 and max(tpots) <= TPOT_MS / 1000, tpots
    assert all(run <= cap for run, _, cap, adm in capped if adm)  # no admission above the cap ...
    assert any(run == cap and wait > 0 for run, wait, cap, _ in capped)  # ... and others waited at it
    assert sched.max_num_active_reqs == CAP and sched.max_num_running_reqs == MAX_SEQS
    assert admission_limit_from(sched.make_stats()) == CAP  # exported (vtoken:admission_limit), any mode
    assert max(run for run, *_ in log) == MAX_SEQS  # before warm-up: no cap; never preempted to reach it
    if mode != "none":
        assert sched.vtoken_stats().counters.preemptions == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_admission_off_runs_max_num_seqs_and_a_loose_target_costs_nothing(async_scheduling):
    in_flight = 2 if async_scheduling else 1
    off = make_scheduler(async_scheduling=async_scheduling, max_num_seqs=MAX_SEQS, num_blocks=256)
    log_off, gen = drive(off, workload(), in_flight)
    assert finished_all(gen)
    assert off.admission_cap() is None and all(cap is None for _, _, cap, _ in log_off)
    assert admission_limit_from(off.make_stats()) is None  # off: no vtoken:admission_limit series
    assert max(run for run, *_ in log_off) == MAX_SEQS
    loose = make_scheduler(
        async_scheduling=async_scheduling, max_num_seqs=MAX_SEQS, num_blocks=256, vtoken={"admission_tpot_ms": 10_000.0}
    )
    log_loose, _ = drive(loose, workload(), in_flight)
    assert loose.admission_cap() == MAX_SEQS
    assert [run for run, *_ in log_loose] == [run for run, *_ in log_off]  # the same schedule, step for step


def test_admission_trace_script_records_every_step_of_a_real_engine(tmp_path):
    """``scripts/admission_trace.py`` (the in-process diagnostic in docs/serving.md) on the tiny model: one
    entry per engine step with the limit in force and the model behind it, every request's TTFT/TPOT, the
    command; a bad rate or policy exits 2 naming it."""
    import json
    import subprocess
    import sys

    from support.paths import ROOT

    script, out = str(ROOT / "scripts" / "admission_trace.py"), tmp_path / "trace.json"
    args = [
        "--model",
        "tiny-llama",
        "--pool-blocks",
        "12",
        "--rate",
        "50",
        "--num-prompts",
        "6",
        "--input-len",
        "40",
        "--output-len",
        "24",
        "--tpot-ms",
        "10000",
        "--out",
        str(out),
    ]
    proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["command"].startswith("python ") and "--rate 50" in report["command"]
    assert len(report["requests"]) == 6 and report["summary"]["slo_attainment"] == 1.0  # a 10 s TPOT target
    steps = report["steps"]
    assert len(steps) >= 24 and all(1 <= s[4] <= 16 for s in steps)  # ≥ one step per generated token
    assert max(s[2] for s in steps) >= 2 and steps[-1][8] >= 8 and steps[-1][5] is not None  # fitted
    assert [s[0] for s in steps] == sorted(s[0] for s in steps)
    bad = subprocess.run(
        [sys.executable, script, "--rate", "0", "--out", str(out)], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "--rate" in bad.stderr and "Traceback" not in bad.stderr
    bad = subprocess.run(
        [sys.executable, script, "--policy", "lru", "--out", str(out)], capture_output=True, text=True, timeout=120
    )  # the variant's config is validated before vLLM loads
    assert bad.returncode == 2 and "unknown policy 'lru'" in bad.stderr and "Traceback" not in bad.stderr
