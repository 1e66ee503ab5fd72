"""``trigger: pressure`` inside vLLM's scheduler: evict from the running batch instead of preempting.

``PressureMixin`` is mixed into ``VTokenScheduler``. Every ``schedule()``, after the per-request decisions
and before vLLM schedules, ``_vt_pressure`` estimates the blocks vLLM's own loop is about to ask the pool
for (``_vt_step_tokens``: the running requests it will reach, their tokens under the token budget and the
long-prefill cap; the queue's head and its first chunk), and only when the free blocks do not cover them
hands the batch to ``vtoken.core.batch.pressure.plan_pressure``: victims in one policy order across the batch,
none below a request's floor (its ``budget``), until the step fits plus ``pressure_margin`` blocks (engine
setting, 1 by default) per running request. Each request's victims go through the scheduler's usual block
work (``_vt_decide``: evict, repack, copy on write, cut the tail), and its freed blocks go back to the pool
before vLLM allocates, so vLLM preempts only when every request is at its floor. Requests with another
trigger, or whose shared blocks cannot be replaced this step, count as fixed demand.

Supported on one KV cache group, one rank and synchronous scheduling; anything else is refused when the
engine is constructed (``pressure_refusal``, a ``ConfigError`` naming the option), and a per-request
``trigger: pressure`` on such an engine fails that request, as every invalid override does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.v1.request import RequestStatus

from vtoken.core.batch import pressure
from vtoken.core.config import Trigger
from vtoken.errors import ConfigError
from vtoken.vllm.scheduling import blocks


def pressure_refusal(vllm_config, groups: int) -> str | None:
    """Why ``trigger: pressure`` cannot run on this engine (the option named), or ``None``. Pure.
    Tensor parallelism and async scheduling are untested (with async scheduling a step in flight holds
    blocks the estimate does not see); on a hybrid model the sliding-window groups draw on the same pool,
    which the estimate does not count."""
    pc, sc = vllm_config.parallel_config, vllm_config.scheduler_config
    if pc.tensor_parallel_size > 1:
        return f"tensor_parallel_size={pc.tensor_parallel_size} (tensor parallelism)"
    if sc.async_scheduling:
        return "async_scheduling=True (pass --no-async-scheduling)"
    if groups > 1:
        return f"a hybrid model ({groups} KV cache groups)"
    return None


def refuse_pressure(why: str) -> ConfigError:
    return ConfigError(
        f"trigger 'pressure' is not supported with {why}: eviction under pressure runs on one "
        "KV cache group, one rank and synchronous scheduling; use trigger 'step' or 'block'"
    )


if TYPE_CHECKING:  # the type checker sees the scheduler this is mixed into; at run time a plain mixin
    from vllm.v1.core.sched.scheduler import Scheduler as _SchedulerBase

    from vtoken.core.reporting.engine_kv import ReclaimCounters
    from vtoken.vllm.config import EngineSettings
    from vtoken.vllm.scheduling.request_state import RequestState
else:
    _SchedulerBase = object


class PressureMixin(_SchedulerBase):
    """The pressure round of ``VTokenScheduler`` (see the module docstring). Needs the scheduler's
    ``_vt_reqs``, ``_vt_manager``, ``_vt_protect`` and ``_vt_decide``."""

    vt: EngineSettings
    _vt_reqs: dict[str, RequestState]
    _vt_manager: Any  # the SingleTypeKVCacheManager of the group vToken manages
    _vt_counters: ReclaimCounters
    if TYPE_CHECKING:

        def _vt_protect(self, request, st: RequestState) -> Any: ...

        def _vt_decide(self, request, st: RequestState, work, victims=None, cfg=None) -> None: ...

    def _vt_init_pressure(self, vllm_config, kv_cache_config, engine_trigger: Trigger) -> None:
        """Decide whether pressure can run here; refuse an engine whose own trigger is ``pressure`` where it
        cannot (raises ``ConfigError`` at construction, before any request). Sets the pressure state."""
        self._vt_pressure_why = pressure_refusal(vllm_config, len(kv_cache_config.kv_cache_groups))
        if engine_trigger is Trigger.PRESSURE and self._vt_pressure_why is not None:
            raise refuse_pressure(self._vt_pressure_why)

    def _vt_check_pressure(self, cfg) -> None:
        """Refuse a request asking for ``trigger: pressure`` on an engine that cannot run it (``ConfigError``)."""
        if cfg.trigger is Trigger.PRESSURE and self._vt_pressure_why is not None:
            raise refuse_pressure(self._vt_pressure_why)

    def _vt_step_tokens(self) -> tuple[list, int]:
        """``([(request, n)], left)``: the running requests vLLM's ``schedule()`` will reach this step with
        the tokens it will schedule for each (its loop's arithmetic: the token budget in queue order, the
        long-prefill cap when more than one request is eligible, max_model_len), and the budget left for the
        queue. Reads only."""
        budget = self.max_num_scheduled_tokens
        cap = self.scheduler_config.long_prefill_token_threshold
        running, waiting = self.get_request_counts()
        eligible = running + waiting
        cap = cap if eligible > 1 else 0
        if cap > 0 and self.adaptive_long_prefill_threshold:
            cap = max(cap, self.scheduler_config.max_num_batched_tokens // eligible)
        out = []
        for request in self.running:
            if budget <= 0:
                break
            n = request.num_tokens_with_spec + request.num_output_placeholders - request.num_computed_tokens
            n = min(cap if 0 < cap < n else n, budget, self.max_model_len - request.num_computed_tokens)
            if n > 0:
                out.append((request, n))
                budget -= n
        return out, budget

    def _vt_admit_need(self, left: int) -> int:
        """Blocks the queue's head needs for its first chunk (0: none waits or none can be admitted now;
        prefix-cache hits are not subtracted, so this errs towards evicting). Reads only."""
        if not self.waiting or left <= 0 or len(self.running) >= self.max_num_active_reqs:
            return 0
        head = self.waiting.peek_request()
        first = min(head.num_tokens - head.num_computed_tokens, left)
        return pressure.blocks_for(first, self.block_size) + self.kv_cache_manager.watermark_blocks

    def _vt_pressure(self, work) -> None:
        """One pressure round (vtoken/core/batch/pressure.py) if the pool is short; the chosen requests' block work
        is added to ``work`` and their freed blocks returned to the pool now. Mutates tables, rows, the pool
        and the counters; does nothing while the step fits."""
        B, pool = self.block_size, self.kv_cache_manager.block_pool
        steps, left = self._vt_step_tokens()
        fixed, ready = 0, []
        for request, n in steps:
            rid = request.request_id
            st = self._vt_reqs.get(rid)
            held = len(self._vt_manager.req_to_blocks.get(rid, ()))
            if st is None or st.table is None:
                fixed += max(pressure.blocks_for(request.num_computed_tokens + n, B) - held, 0)
            elif (
                st.settings.cfg.trigger is not Trigger.PRESSURE
                or st.preplaced is not None
                or request.status != RequestStatus.RUNNING
                or not st.settings.cfg.mode.evicts
            ):
                fixed += max(st.table.required_blocks_after_place(n) - held, 0)
            else:
                ready.append((request, st, n, held))
        if not ready:
            return  # no pressure request runs: nothing to decide (every other engine pays only this loop)
        admit = self._vt_admit_need(left)
        free = pool.get_num_free_blocks()
        need = fixed + sum(max(st.live_table().required_blocks_after_place(n) - held, 0) for _, st, n, held in ready)
        if need + admit <= free:
            return  # nothing is short: nothing is evicted
        cands, chosen = [], {}
        for request, st, n, held in ready:
            cfg = self._vt_protect(request, st)
            if cfg is None:
                fixed += max(st.live_table().required_blocks_after_place(n) - held, 0)
                continue
            chosen[request.request_id] = (request, st, cfg)
            cands.append(pressure.candidate(request.request_id, st.live_table(), st.policy, cfg, st.salt, held, n))
        margin = self.vt.pressure_margin * len(self.running)
        decision = pressure.plan_pressure(cands, free, fixed, margin=margin, admit=admit)
        if not decision.fired:
            return  # short only for a head that no eviction could admit: it waits, as in vLLM
        self._vt_counters = self._vt_counters.add(
            pressure_rounds=1, pressure_evicted_tokens=decision.evicted, pressure_at_floor=int(decision.slack < 0)
        )
        start = len(work.release)
        for rid, victims in decision.victims.items():
            request, st, cfg = chosen[rid]
            self._vt_decide(request, st, work, victims=victims, cfg=cfg)
        blocks.release(pool, work.release[start:])
