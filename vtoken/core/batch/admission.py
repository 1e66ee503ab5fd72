"""SLO-aware admission: how many requests may run at once so that a decode step still meets a TPOT target.

A pure model of step time against the running batch size, fitted online from measured steps::

    step_s(n)   ≈ a + b·n        (exponentially weighted least squares over decode steps (n, step_s))
    O, n̄                        the mean over all steps of the time beyond that fit (a step that also
                                 prefilled: its excess; a decode-only step: 0) and of their batch sizes
    overhead(n) ≈ O·min(1, n/n̄)  what other requests' prefills add to every token
    cap         = largest n in [1, max_n] with step_s(n) + overhead(n) ≤ headroom · tpot_s

A running request's TPOT is the mean of the steps it is in: decode steps of its batch plus the prefill
steps of the requests admitted while it runs. The fit alone sees only the first; the overhead term
charges the second (measured: without it the served TPOT p50 sat at the target with the cap never
binding). Below the batch it was measured at, the overhead shrinks with the batch: while requests queue,
the prefills come from those admitted as others finish, ∝ ``n`` per step (Little's law). Charged there as a
constant, a burst of arrivals read as a cost no batch size could meet and, with a nearly flat decode fit,
put the cap at 1 with 5–7 running (in-process, SmolLM2 at 0.9 req/s: cap 1 between caps of 4–8 within a
second; served at 0.45 req/s on 24 blocks: the limit at 1–4 for ≈ 45 s, up to 12 waiting, 0 % attainment).
Above it the overhead is not scaled up: arrivals, not the cap, set how many prefills come while the queue
is short, and slow start guards the rest (charged ∝ ``n`` above too, a fresh server's cap stayed at 2 for
20 s while requests queued: 52 % attainment at 0.35 req/s where the constant charge had 90 %).

The scheduler (vtoken/vllm/scheduler.py) sets vLLM's admission limit (``max_num_active_reqs``) to
``min(configured max, cap)`` before every step. The cap only stops *admission*: running requests are never
preempted for it, so a batch already above the cap drains by requests finishing.

Invariants (tested in tests/unit/core/test_admission.py):

* ``cap(max_n)`` is ``None`` (no cap) until ``min_samples`` steps have been observed;
* otherwise ``1 ≤ cap(max_n) ≤ max_n``: at least one request always runs (no starvation, no deadlock:
  with nothing running, vLLM's check ``num_running >= cap`` is false, so a waiting request is admitted);
* ``cap`` is non-decreasing in ``tpot_s`` (a looser target never admits fewer);
* with overhead, the cap lies between the constant charge's ``cap_for(a + O, b)`` and the decode fit's
  alone, meets the target where it admits more than one, and one more would not (``cap_with_overhead``);
* the fitted slope is positive: when every sample has the same batch size (no slope can be fitted) or the
  fit's slope is ≤ 0 (noise, or one slow step at a small batch), the model is proportional,
  ``a = 0, b = mean(step_s / n)``, which is conservative: the cap then moves the batch size, and the next
  samples fit a real line;
* the cap never locks a batch size in: a proportional model cannot see the intercept (on these CPUs one
  request's decode step is ≈ 60 % of sixteen's), so from samples at one batch size n̄ alone it would cap at
  n̄ forever (served: the limit sat at 1 for the first 20 requests, TTFT up to 28 s at 0.3 req/s). When
  the measured steps there meet the target (mean step + overhead ≤ headroom · tpot), the cap is at least
  ⌊n̄⌋ + 1 — a probe; the samples at the new size then fit a real line;
* beyond the largest batch size measured, the fit is trusted only where twice its prediction still meets
  the target; past that the cap rises one above the largest measured at a time (slow start). A line
  through batch sizes close together can be far off (in a simulated ramp, one noisy sample at 2 beside
  twenty at 1 put the cap at 16, and a cap admits requests that then run to the end); a loose target
  (the fit ×2 meets it at ``max_n``) is not slowed.

Nothing here reads a clock or knows vLLM: the caller measures and feeds ``observe``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vtoken.errors import ConfigError

HEADROOM = 0.9  # predicted step ≤ 90 % of the TPOT target: steps vary, and TPOT also carries prefill steps
CAP_SLACK = 1e-9  # requests: a batch that meets the target to rounding still counts as meeting it


def _positive_number(value: object) -> bool:
    """A finite number > 0 (not a bool)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@dataclass(frozen=True)
class AdmissionConfig:
    """``tpot_s``: the TPOT target (seconds per output token); ``headroom``: the fraction of it a predicted
    step may use; ``min_samples``: steps observed before any cap; ``half_life``: steps after which a
    sample's weight halves (old batch sizes fade as the machine's speed changes)."""

    tpot_s: float
    headroom: float = HEADROOM
    min_samples: int = 8
    half_life: float = 64.0

    def __post_init__(self) -> None:
        if not _positive_number(self.tpot_s):
            raise ConfigError(f"admission TPOT target must be a positive number of seconds, got {self.tpot_s!r}")
        if not 0 < self.headroom <= 1:
            raise ConfigError(f"admission headroom must be in (0, 1], got {self.headroom!r}")
        if isinstance(self.min_samples, bool) or not isinstance(self.min_samples, int) or self.min_samples < 2:
            raise ConfigError(f"admission min_samples must be an integer >= 2, got {self.min_samples!r}")
        if not self.half_life > 0:
            raise ConfigError(f"admission half_life must be positive, got {self.half_life!r}")

    @classmethod
    def from_ms(cls, tpot_ms: float) -> AdmissionConfig:
        """From a target in milliseconds (``admission_tpot_ms``); ``ConfigError`` names a bad value."""
        if not _positive_number(tpot_ms):
            raise ConfigError(f"admission_tpot_ms must be a positive number of milliseconds, got {tpot_ms!r}")
        return cls(tpot_s=tpot_ms / 1000.0)


class StepTimeModel:
    """Online fit of ``step_s ≈ a + b·n`` (see the module docstring). Mutable: ``observe`` adds a sample."""

    def __init__(self, cfg: AdmissionConfig) -> None:
        self.cfg = cfg
        self._decay = 0.5 ** (1.0 / cfg.half_life)
        self._w = self._wn = self._wnn = self._wy = self._wny = self._wr = 0.0
        self._ow = self._oy = self._on = 0.0  # overhead: decayed steps, excess seconds and batch sizes
        self.samples = 0
        self.largest_batch = 0  # the largest n observed (slow start, module docstring)

    def observe(self, n: int, step_s: float) -> None:
        """One step that ran ``n ≥ 1`` requests in ``step_s`` seconds (others are ignored)."""
        if n < 1 or not (step_s > 0 and math.isfinite(step_s)):
            return
        d = self._decay
        self._w = self._w * d + 1.0
        self._wn = self._wn * d + n
        self._wnn = self._wnn * d + n * n
        self._wy = self._wy * d + step_s
        self._wny = self._wny * d + n * step_s
        self._wr = self._wr * d + step_s / n
        self.samples += 1
        self.largest_batch = max(self.largest_batch, n)

    def observe_overhead(self, excess_s: float, n: int) -> None:
        """Every step once, with the ``n ≥ 1`` requests it ran: its time beyond the decode fit (0 for a
        decode-only step; negatives count 0; a non-finite value or ``n < 1`` is ignored)."""
        if n < 1 or not math.isfinite(excess_s):
            return
        d = self._decay
        self._ow = self._ow * d + 1.0
        self._oy = self._oy * d + max(0.0, excess_s)
        self._on = self._on * d + n

    @property
    def overhead(self) -> float:
        """Mean seconds per step beyond the decode fit, at the batches that ran (0 before any step)."""
        return self._oy / self._ow if self._ow else 0.0

    @property
    def overhead_batch(self) -> float:
        """``n̄``: the mean batch size of the steps ``overhead`` was measured over (0 before any step)."""
        return self._on / self._ow if self._ow else 0.0

    def fit(self) -> tuple[float, float] | None:
        """``(a, b)`` in seconds, or ``None`` before ``min_samples`` steps."""
        line = self._line()
        return None if line is None else line[:2]

    def _line(self) -> tuple[float, float, bool] | None:
        """``(a, b, proportional)``: the fit and whether it is the proportional fallback."""
        if self.samples < self.cfg.min_samples:
            return None
        mean_n, mean_y = self._wn / self._w, self._wy / self._w
        var = self._wnn / self._w - mean_n * mean_n
        if var <= 1e-9 * max(1.0, mean_n * mean_n):
            return 0.0, self._wr / self._w, True  # one batch size only: proportional (module docstring)
        b = (self._wny / self._w - mean_n * mean_y) / var
        if b <= 0:
            return 0.0, self._wr / self._w, True  # not explained by batch size: proportional (docstring)
        return mean_y - b * mean_n, b, False

    def predict(self, n: int) -> float | None:
        """Predicted decode step with ``n`` running (the fit only, without ``overhead``)."""
        ab = self.fit()
        return None if ab is None else ab[0] + ab[1] * n

    def cap(self, max_n: int) -> int | None:
        """The largest batch size in ``[1, max_n]`` whose predicted step plus ``overhead(n)`` meets the target,
        or one above a proportional model's measured batch that meets it (the probe); past the largest batch
        measured, only where twice the prediction meets it, else one above (slow start). ``None``: no cap yet."""
        line = self._line()
        if line is None:
            return None
        a, b, proportional = line
        max_n, limit_s = max(1, int(max_n)), self.cfg.tpot_s * self.cfg.headroom
        overhead, batch = self.overhead, self.overhead_batch
        cap = cap_with_overhead(a, b, overhead, batch, limit_s, max_n)
        if proportional and self._wy / self._w + overhead <= limit_s:  # the probe (module docstring)
            cap = max(cap, min(max_n, math.floor(self._wn / self._w + 1e-9) + 1))
        trusted = cap_with_overhead(2 * a, 2 * b, 2 * overhead, batch, limit_s, max_n)  # the fit ×2 meets it
        return min(cap, max(trusted, self.largest_batch + 1))  # slow start (module docstring)


def cap_with_overhead(a: float, b: float, overhead: float, batch: float, limit_s: float, max_n: int) -> int:
    """Largest ``n`` in ``[1, max_n]`` with ``a + b·n + overhead·min(1, n/batch) ≤ limit_s`` (1 when none
    does): below ``batch`` the overhead is charged per request, at and above it as measured."""
    if overhead <= 0 or batch <= 0:
        return cap_for(a, b, limit_s, max_n)
    if not fits(a + overhead, b, batch, limit_s):  # the crossing is below the measured batch
        return min(cap_for(a, b + overhead / batch, limit_s, max_n), max(1, math.floor(batch)))
    return max(min(max_n, math.floor(batch)), cap_for(a + overhead, b, limit_s, max_n))  # ≥ the batch met


def fits(a: float, b: float, n: float, limit_s: float) -> bool:
    """``a + b·n ≤ limit_s`` computed as ``cap_for`` computes it (the quotient, the same slack): the sum
    would round a tiny ``b·n`` away where the quotient does not, and the two caps would disagree
    (hypothesis found ``a = limit_s``, ``b ≈ 1e-238``)."""
    if b <= 0:
        return a <= limit_s
    return (limit_s - a) / b + CAP_SLACK >= n


def cap_for(a: float, b: float, limit_s: float, max_n: int) -> int:
    """Largest ``n`` in ``[1, max_n]`` with ``a + b·n ≤ limit_s`` (1 when none does; ``b`` clamped ≥ 0)."""
    max_n = max(1, int(max_n))
    if b <= 0:
        return max_n if a <= limit_s else 1
    n = (limit_s - a) / b + CAP_SLACK  # ±inf for a slope so small that the quotient overflows
    if n >= max_n:
        return max_n
    return 1 if n < 1 else math.floor(n)
