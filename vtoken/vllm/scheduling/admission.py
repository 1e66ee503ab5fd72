"""SLO-aware admission for ``VTokenScheduler`` (mixed in before vLLM's ``Scheduler``).

With ``admission_tpot_ms`` set, the scheduler fits step time against batch size (``vtoken/core/batch/admission.py``)
and, before every ``schedule()``, lowers vLLM's admission limit ``max_num_active_reqs`` to the batch size
predicted to meet the target. vLLM internals touched (listed in ``internals.py``): ``max_num_active_reqs``
(read once as the configured limit, then set before each step) and ``SchedulerOutput.num_scheduled_tokens``
/ ``total_num_scheduled_tokens``.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from vtoken.core.batch.admission import StepTimeModel
from vtoken.vllm.config import EngineSettings

logger = logging.getLogger("vtoken.vllm")


if TYPE_CHECKING:  # the type checker sees the scheduler this is mixed into; at run time a plain mixin
    from vllm.v1.core.sched.scheduler import Scheduler as _SchedulerBase
else:
    _SchedulerBase = object


class AdmissionMixin(_SchedulerBase):
    """State: ``_vt_steptime`` (``None``: admission off), ``_vt_max_active``, ``_vt_clock``, ``_vt_started``,
    ``_vt_last_update``. The scheduler calls ``_vt_init_admission`` in its constructor, ``_vt_admit`` /
    ``_vt_scheduled`` around each ``schedule()`` and ``_vt_time_step`` in ``update_from_output``."""

    def _vt_init_admission(self, settings: EngineSettings) -> None:
        """``admission_tpot_ms`` set: fit step time against batch size (vtoken/core/batch/admission.py) and, before
        every ``schedule()``, lower vLLM's admission limit ``max_num_active_reqs`` (checked before a waiting
        request enters RUNNING) to the batch size predicted to meet the target. Running requests are never
        preempted for it; the cap is ≥ 1, so with nothing running a request is always admitted. Works in
        every mode (also ``none``). ``_vt_clock`` is replaceable (tests)."""
        adm = settings.admission
        self._vt_steptime = StepTimeModel(adm) if adm is not None else None
        self._vt_max_active = self.max_num_active_reqs  # the configured limit (max_num_seqs / active seqs)
        self._vt_clock = time.perf_counter
        self._vt_started: dict[int, float] = {}  # id(SchedulerOutput) → when its schedule() began
        self._vt_last_update: float | None = None
        if adm is not None:
            logger.info(
                "vToken admission on: TPOT target %.1f ms, headroom %.2f, max active %d",
                adm.tpot_s * 1000,
                adm.headroom,
                self._vt_max_active,
            )

    def admission_cap(self) -> int | None:
        """The current SLO admission cap (``None``: admission off, or not enough steps measured yet)."""
        return None if self._vt_steptime is None else self._vt_steptime.cap(self._vt_max_active)

    def _vt_time_step(self, scheduler_output) -> None:
        """A step's duration: from when it was scheduled, or from the previous step's output if later (one
        step in flight under async scheduling; idle time before a schedule() is not counted), to its output.
        A decode step (one token per scheduled request) is a sample of the fit at its batch size and
        adds 0 overhead; a step that prefills adds its time beyond the fit's prediction as overhead
        (as a sample it would read as a slow small batch: in served runs the cap fell to 1 after each
        burst of arrivals when prefills were samples)."""
        now = self._vt_clock()
        start = self._vt_started.pop(id(scheduler_output), None)
        n = len(scheduler_output.num_scheduled_tokens)
        if start is not None:
            step_s = now - (start if self._vt_last_update is None else max(start, self._vt_last_update))
            model = self._vt_steptime
            assert model is not None, "_vt_time_step runs only with admission on"
            if scheduler_output.total_num_scheduled_tokens == n:
                model.observe(n, step_s)
                model.observe_overhead(0.0, n)
            elif (predicted := model.predict(n)) is not None:
                model.observe_overhead(step_s - predicted, n)
        self._vt_last_update = now

    def _vt_admit(self) -> float:
        """Before a ``schedule()``: set ``max_num_active_reqs`` to the cap (mutates it); returns the start time."""
        start = self._vt_clock()
        cap = self.admission_cap()
        self.max_num_active_reqs = self._vt_max_active if cap is None else min(self._vt_max_active, cap)
        return start

    def _vt_scheduled(self, out, start: float) -> None:
        """After a ``schedule()``: remember when a non-empty step began (bounded: outputs never fed back)."""
        if out.total_num_scheduled_tokens > 0:
            self._vt_started[id(out)] = start
            while len(self._vt_started) > 8:  # ordinarily 1 or 2 entries
                self._vt_started.pop(next(iter(self._vt_started)))
