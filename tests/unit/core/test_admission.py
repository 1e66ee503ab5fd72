"""SLO-aware admission's pure model (vtoken/core/batch/admission.py): the online fit, the cap and its invariants,
and the ``admission_tpot_ms`` setting's validation (engine and serving config)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from vtoken.core.batch.admission import HEADROOM, AdmissionConfig, StepTimeModel, cap_for, cap_with_overhead
from vtoken.errors import ConfigError


def fitted(a, b, ns, tpot_s=0.1, noise=0.0, seed=0, **kw):
    m = StepTimeModel(AdmissionConfig(tpot_s=tpot_s, **kw))
    rng = np.random.default_rng(seed)
    for n in ns:
        m.observe(int(n), a + b * n + noise * rng.standard_normal())
    return m


def test_fit_recovers_intercept_and_slope():
    ns = np.random.default_rng(1).integers(1, 17, 200)
    a, b = fitted(0.020, 0.005, ns).fit()
    assert a == pytest.approx(0.020, abs=1e-9) and b == pytest.approx(0.005, abs=1e-9)
    a, b = fitted(0.020, 0.005, ns, noise=0.001).fit()
    assert a == pytest.approx(0.020, abs=2e-3) and b == pytest.approx(0.005, abs=3e-4)


def test_cap_is_the_largest_batch_that_meets_the_target():
    ns = list(range(1, 17)) * 4
    m = fitted(0.020, 0.005, ns, tpot_s=0.05)  # 0.9·50 ms = 45 ms: 20 + 5·n ≤ 45 ⇒ n ≤ 5
    assert m.cap(16) == 5
    assert m.predict(5) <= 0.05 * HEADROOM < m.predict(6)


def test_no_cap_before_warm_up_and_clamped_to_one_and_max():
    m = StepTimeModel(AdmissionConfig(tpot_s=0.05, min_samples=8))
    for i in range(7):
        m.observe(1 + i % 3, 1.0)
        assert m.cap(16) is None
    m.observe(2, 1.0)
    assert m.cap(16) == 1  # far too slow even for one request: still one (never 0)
    assert fitted(0.001, 0.0001, range(1, 9), tpot_s=1.0).cap(16) == 16  # loose: the configured max (the
    # fit ×2 meets the target at 16 too: no slow start)
    assert fitted(0.020, 0.005, [1, 2, 3] * 4, tpot_s=0.05).cap(16) == 4  # the fit says 5, but near the limit:
    # one above the largest batch measured (3), the fit ×2 (40 + 10·n ms) meets 45 ms nowhere
    assert cap_for(0.0, 0.0, 1.0, 0) == 1


def test_ignored_samples_and_a_single_batch_size():
    m = StepTimeModel(AdmissionConfig(tpot_s=0.05, min_samples=2))
    m.observe(0, 1.0)
    m.observe(3, 0.0)
    m.observe(3, float("nan"))
    assert m.samples == 0
    for _ in range(4):
        m.observe(8, 0.08)  # always 8 running, 10 ms per request: proportional model
    assert m.fit() == (0.0, pytest.approx(0.01))
    assert m.cap(8) == 4  # 10·n ≤ 45


def test_a_slope_that_is_not_positive_falls_back_to_proportional():
    m = fitted(0.040, -0.002, range(1, 9), tpot_s=0.1)
    ratios = [(0.040 - 0.002 * n) / n for n in range(1, 9)]
    assert m.fit() == (0.0, pytest.approx(np.mean(ratios), rel=0.05))  # weights decay slightly
    c = m.cap(8)
    assert m.predict(c) <= 0.1 * HEADROOM < m.predict(c + 1) and c == 7
    assert fitted(0.080, 0.0, range(1, 9), tpot_s=0.05).cap(8) == 1  # flat 80 ms: ≈ 27 ms per request ⇒ 1


def test_a_batch_that_meets_the_target_is_probed_not_locked_in():
    """Served, requests arrive one at a time: the first samples all have one request running, and the
    proportional model of a step that is mostly intercept (159 ms at 1, 294 ms at 16) would cap at 1 for
    ever (159·n ≤ 270). The probe admits a second request, the samples at 2 fit the line, and the cap
    climbs one batch size at a time to the true limit, 150 + 9·n ≤ 270 ⇒ 13."""
    single = fitted(0.150, 0.009, [1] * 20, tpot_s=0.3)
    assert single.fit() == (0.0, pytest.approx(0.159)) and single.cap(16) == 2
    assert fitted(0.150, 0.009, [1] * 20, tpot_s=0.3).cap(1) == 1  # never above the configured max
    single.observe_overhead(0.2, 1)  # measured 159 ms + 200 ms overhead > 270 ms: no probe
    assert single.cap(16) == 1
    rng = np.random.default_rng(0)
    m, caps = StepTimeModel(AdmissionConfig(tpot_s=0.3)), []
    for step in range(400):
        waiting = 1 if step < 30 else 16  # one request alone, then a queue
        cap = m.cap(16)
        n = min(waiting, 16 if cap is None else cap)
        m.observe(n, 0.150 + 0.009 * n + 0.002 * rng.standard_normal())
        caps.append(cap)
    assert abs(m.cap(16) - 13) <= 1, caps[-20:]
    ramp = [c for c in caps if c is not None]
    assert ramp[0] == 2 and all(b <= a + 1 for a, b in zip(ramp, ramp[1:])), caps[:60]  # one at a time
    assert max(ramp) <= 14, caps[:60]  # a line through 1 and 2 alone said 16 (module docstring)


def test_prefill_overhead_is_charged_per_step_and_lowers_the_cap():
    m = fitted(0.020, 0.005, list(range(1, 17)) * 4, tpot_s=0.05)  # decode only: 20 + 5·n ≤ 45 ⇒ 5
    assert m.overhead == 0.0 and m.cap(16) == 5
    for i in range(40):  # batch 2; one step in 4 prefills, 40 ms beyond the fit: 10 ms per step on average
        m.observe_overhead(0.040 if i % 4 == 0 else 0.0, 2)
    assert m.overhead == pytest.approx(0.010, rel=0.1) and m.overhead_batch == pytest.approx(2.0)
    assert m.cap(16) == 3  # above the measured batch as measured: 20 + 10 + 5·n ≤ 45 ⇒ n ≤ 3
    assert m.predict(3) == pytest.approx(0.035)  # the decode fit itself is unchanged
    before = m.overhead
    m.observe_overhead(float("nan"), 2)
    m.observe_overhead(0.5, 0)
    assert m.overhead == before  # both ignored
    m.observe_overhead(-1.0, 2)  # a prefill step faster than the fit: counts as 0, not as a credit
    assert 0 < m.overhead < before


def test_overhead_shrinks_below_the_measured_batch_and_is_not_scaled_up_above_it():
    limit = 0.27
    # measured at 6 running: 100 + 5·6 + 170 = 300 ms > 270. Constant: nothing fits ⇒ 1; per request below 6
    # (28.3 ms each): 100 + 33.3·n ≤ 270 ⇒ 5
    assert cap_for(0.100 + 0.170, 0.005, limit, 16) == 1
    assert cap_with_overhead(0.100, 0.005, 0.170, 6.0, limit, 16) == 5
    # a fresh server, measured at 1.5 running: 80 + 15 + 50 = 145 ms meets it; above 1.5 as measured:
    # 130 + 10·n ≤ 270 ⇒ 14 (slow start then raises the cap one batch at a time); scaled up it would be 4
    assert cap_with_overhead(0.080, 0.010, 0.050, 1.5, limit, 16) == 14
    assert cap_for(0.080, 0.010 + 0.050 / 1.5, limit, 16) == 4
    assert cap_with_overhead(0.080, 0.010, 0.0, 1.5, limit, 16) == cap_for(0.080, 0.010, limit, 16)


@settings(max_examples=200, deadline=None)
@given(
    a=st.floats(0.0, 0.2),
    b=st.floats(0.0, 0.05),
    o=st.floats(0.0, 0.3),
    batch=st.floats(1.0, 32.0),
    limit=st.floats(0.01, 0.5),
    max_n=st.integers(1, 64),
)
@example(a=0.125, b=9.711415346016531e-239, o=9.711415346016531e-239, batch=2.0, limit=0.125, max_n=2)  # CI
def test_overhead_cap_lies_between_the_constant_and_the_per_request_charge(a, b, o, batch, limit, max_n):
    cap = cap_with_overhead(a, b, o, batch, limit, max_n)
    assert 1 <= cap <= max_n
    assert cap_for(a + o, b, limit, max_n) <= cap <= cap_for(a, b, limit, max_n)
    if cap > 1:  # what it admits meets the limit
        assert a + b * cap + o * min(1.0, cap / batch) <= limit * (1 + 1e-9)
    if cap < max_n:  # and one more would not
        n = cap + 1
        assert a + b * n + o * min(1.0, n / batch) > limit * (1 - 1e-9)


def test_a_burst_of_prefills_lowers_the_cap_to_a_batch_that_meets_the_target_not_to_one():
    """In-process, SmolLM2 at 0.9 req/s (the fit and overhead read from the scheduler): decode 102.5 ms +
    4.9 ms per request, and the first arrivals' prefills 160 ms per step at batches of ≈ 4. Charged per
    step as a constant, 102.5 + 160 + 4.9 > 270 ms already at one request: the cap fell to 1 with 5 running.
    Below the batch it was measured at, per running request (40 ms each): 102.5 + 44.9·n ≤ 270 ⇒ 3."""
    m = fitted(0.1025, 0.0049, list(range(1, 9)) * 2, tpot_s=0.3)
    for i in range(8):  # every other step prefilled, 320 ms beyond the fit, at a batch of 4
        m.observe_overhead(0.320 if i % 2 == 0 else 0.0, 4)
    assert m.overhead == pytest.approx(0.160, rel=0.05)
    assert m.cap(16) == 3
    assert cap_for(m.fit()[0] + m.overhead, m.fit()[1], 0.3 * HEADROOM, 16) == 1  # the constant charge


@settings(max_examples=60, deadline=None)
@given(
    a=st.floats(0.001, 0.1),
    b=st.floats(0.0, 0.02),
    t1=st.floats(0.001, 0.5),
    t2=st.floats(0.001, 0.5),
    max_n=st.integers(1, 64),
    o1=st.floats(0.0, 0.1),
    o2=st.floats(0.0, 0.1),
)
def test_cap_monotone_in_target_and_overhead_and_within_bounds(a, b, t1, t2, max_n, o1, o2):
    lo, hi = sorted((t1, t2))
    ns = list(range(1, 13))
    c_lo, c_hi = fitted(a, b, ns, tpot_s=lo).cap(max_n), fitted(a, b, ns, tpot_s=hi).cap(max_n)
    assert 1 <= c_lo <= c_hi <= max_n
    less, more = sorted((o1, o2))
    caps = []
    for overhead in (less, more):
        m = fitted(a, b, ns, tpot_s=hi)
        m.observe_overhead(overhead, 4)
        caps.append(m.cap(max_n))
    assert 1 <= caps[1] <= caps[0] <= c_hi  # more overhead never admits more


@pytest.mark.parametrize("bad", [0, -5, float("nan"), float("inf"), "50", True])
def test_bad_targets_are_refused_naming_the_value(bad):
    from vtoken.core.config import VTokenConfig
    from vtoken.vllm.config import EngineSettings

    with pytest.raises(ConfigError, match="admission_tpot_ms"):
        AdmissionConfig.from_ms(bad)
    with pytest.raises(ConfigError, match="admission_tpot_ms"):
        EngineSettings(cfg=VTokenConfig(block_size=32), admission_tpot_ms=bad)
    with pytest.raises(ConfigError, match="admission"):
        EngineSettings.from_additional_config({"vtoken": {"admission_tpot_ms": bad}}, 32)


def test_setting_flows_through_additional_config_and_the_serving_config():
    from vtoken.core.config import VTokenConfig
    from vtoken.serve.config import ServeAppConfig
    from vtoken.serve.replica.engine import engine_args
    from vtoken.vllm import SCHEDULER_CLS, engine_kwargs
    from vtoken.vllm.config import EngineSettings

    s = EngineSettings.from_additional_config({"vtoken": {"admission_tpot_ms": 150}}, 32)
    assert s.admission == AdmissionConfig(tpot_s=0.15)
    assert EngineSettings.from_additional_config({}, 32).admission is None  # off by default
    kw = engine_kwargs(VTokenConfig(block_size=32, mode="none"), admission_tpot_ms=150)
    assert kw["scheduler_cls"] == SCHEDULER_CLS and "worker_cls" not in kw  # vanilla vLLM + admission
    assert kw["additional_config"]["vtoken"]["admission_tpot_ms"] == 150
    assert engine_kwargs(VTokenConfig(block_size=32, mode="none")) == {"block_size": 32}
    on = ServeAppConfig.model_validate({"slo": {"tpot_ms": 120, "admission": True}})
    off = ServeAppConfig.model_validate({"slo": {"tpot_ms": 120}})
    assert engine_args(on, "/m")["additional_config"]["vtoken"]["admission_tpot_ms"] == 120
    assert "admission_tpot_ms" not in engine_args(off, "/m")["additional_config"]["vtoken"]
