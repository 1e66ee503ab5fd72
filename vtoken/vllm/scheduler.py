"""The scheduler side of vToken: token tables, the policy decision, repack plans, real block accounting.

``VTokenScheduler`` subclasses vLLM's V1 ``Scheduler`` (``scheduler_cls``). Every step::

    schedule():
      for each RUNNING request over its budget           (before vLLM schedules anything)
        decide_step(table, policy, cfg)                    vtoken.core.eviction: evict, [reuse] place 1,
                                                           plan, apply — the order every engine follows
        copy-on-write, moves, cut the row's tail           vtoken.vllm.scheduling.blocks → vLLM's BlockPool
      release the step's freed blocks (cached keep hashes)
      super().schedule()                                   vLLM admits/allocates with the freed blocks;
                                                           allocation counts come from the token table
      for each scheduled request: table.place(n)           new tokens' slots (append, or the hole above)
      attach StepPlan (moves, replacements, truncations,   → worker, same SchedulerOutput
                       offsets)
    update_from_output():
      fold the worker's SlotScores into the tables          vtoken.core.step_stats.observe

``num_computed_tokens`` stays *logical* (RoPE positions, stop checks, max_model_len are logical); only the
block arithmetic is physical (``vtoken.vllm.scheduling.blocks.install_block_sizing``).

Prefix caching stays on. A leading block another request shares (``ref_cnt > 1``) is declared shared in the
token table (``mark_shared``): its tokens are never evicted, so it is never a move source or destination.
A block this request is about to write (a move destination, the hole a new token takes, or any block at or
past the live frontier) that carries a prefix-cache hash or another request's reference is never written:
it gets a replacement block, its surviving live tokens are copied across, and it goes back to vLLM's pool
still cached (copy on write, ``blocks.rewrite_row``, vtoken/core/cow.py). Freed tail blocks keep their hash
when they have one: their content is untouched (they were only read).

Preemption: vLLM frees every block and later recomputes the request from its logical tokens; the table and
scores go with the blocks, and the policy evicts down to the budget again from fresh scores (traces record a
new epoch). Async scheduling (a step in flight while the next is scheduled): vtoken/vllm/scheduling/request_state.py.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import numpy as np
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from vtoken.core.eviction import decide_step, eviction_count
from vtoken.core.manager import request_salt
from vtoken.core.reporting.engine_kv import KVSnapshot, ReclaimCounters
from vtoken.core.reporting.request_cost import CostStats, RequestCost
from vtoken.core.step_stats import observe, window_queries
from vtoken.core.token_table import TokenTable
from vtoken.errors import ConfigError, IntegrityError
from vtoken.vllm.config import EngineSettings, request_settings
from vtoken.vllm.engine_setup import prepare_engine, refuse_under_full_graphs
from vtoken.vllm.gauges import cost_params, encode_admission, encode_stats
from vtoken.vllm.scheduling import blocks, invariants
from vtoken.vllm.scheduling.admission import AdmissionMixin
from vtoken.vllm.scheduling.pressure import PressureMixin
from vtoken.vllm.scheduling.request_state import RequestState, new_request_state, step_scores
from vtoken.vllm.scheduling.trace import RequestObserver, RequestTrace, TraceRecorder
from vtoken.vllm.supported_configs import check_supported
from vtoken.vllm.transport import RequestStep, StepPlan, attach_plan, plan_of, result_of

logger = logging.getLogger("vtoken.vllm")


@dataclass
class _StepWork:
    src: list[np.ndarray] = field(default_factory=list)
    dst: list[np.ndarray] = field(default_factory=list)
    truncate: dict[str, int] = field(default_factory=dict)
    replace: dict[str, dict[int, int]] = field(default_factory=dict)
    release: list = field(default_factory=list)  # freed once every decision is made (blocks.rewrite_row)


class VTokenScheduler(PressureMixin, AdmissionMixin, Scheduler):
    """vLLM's V1 scheduler with per-token eviction and repacking (see the module docstring). The one name to
    configure: with async scheduling on, constructing it builds ``VTokenAsyncScheduler`` (vLLM's
    ``AsyncScheduler`` with the same hooks, at the end of this file)."""

    def __new__(cls, vllm_config, *args, **kwargs):
        if cls is VTokenScheduler and vllm_config.scheduler_config.async_scheduling:
            return super().__new__(VTokenAsyncScheduler)
        return super().__new__(cls)

    def __init__(self, vllm_config, kv_cache_config, structured_output_manager, block_size, *args, **kwargs):
        from vtoken.vllm.internals import check_vllm_version

        check_vllm_version()
        settings = EngineSettings.from_additional_config(vllm_config.additional_config, block_size)
        self._vt_full_graphs = prepare_engine(vllm_config, settings)  # same choice as the workers'
        super().__init__(vllm_config, kv_cache_config, structured_output_manager, block_size, *args, **kwargs)
        self.vt = settings
        self._vt_reqs: dict[str, RequestState] = {}
        self._vt_counters = ReclaimCounters()
        self._vt_costs = CostStats()  # finished requests' costs (vtoken/core/reporting/request_cost.py)
        self._vt_step = 0  # StepPlan.step of the next step
        self._vt_unchecked = 0  # steps since the last KV invariant check
        self._vt_init_admission(settings)
        if not settings.enabled:
            return
        group = check_supported(vllm_config, kv_cache_config)  # the full-attention group (hybrid models)
        self._vt_init_pressure(vllm_config, kv_cache_config, settings.cfg.trigger)  # refuses what it cannot run
        self._vt_manager = self.kv_cache_manager.coordinator.single_type_managers[group]
        blocks.install_block_sizing(self.kv_cache_manager.coordinator, self._vt_manager, self._vt_table, block_size)
        keys = ("policy", "budget", "mode", "sinks", "recent", "prompt_tail", "scope", "trigger")
        logger.info(
            "vToken on: policy=%s budget=%s mode=%s sinks=%d recent=%d prompt_tail=%d scope=%s trigger=%s "
            "block_size=%d %s",
            *(getattr(settings.cfg, k) for k in keys),
            block_size,
            type(self).__name__,
        )

    def _vt_table(self, request_id: str) -> TokenTable | None:
        st = self._vt_reqs.get(request_id)
        return None if st is None else st.table

    # ------------------------------------------------------------------ request lifecycle
    def add_request(self, request: Request) -> None:
        if self.vt.enabled and request.request_id not in self._vt_reqs:
            try:
                rs = request_settings(self.vt, getattr(request.sampling_params, "extra_args", None))
                self._vt_check_pressure(rs.cfg)
                if self._vt_full_graphs:
                    refuse_under_full_graphs(rs.cfg, self.vt)
            except ConfigError as e:
                logger.error("vToken: request %s rejected: %s", request.request_id, e)
                super().add_request(request)
                # finished with an error (and an output to the client) at the next update, by vLLM's own
                # error path; it never gets vToken state, so until then it is plain vLLM
                self.grammar_compile_error_reqs.add(request.request_id)
                return
            self._vt_reqs[request.request_id] = self._vt_new_req(request, rs)
        super().add_request(request)

    def _vt_new_req(self, request: Request, rs) -> RequestState:
        observer = RequestObserver()
        if self.vt.trace_dir is not None:
            trace = RequestTrace(
                request_id=request.request_id,
                trace_id=rs.trace_id,
                policy=rs.cfg.policy,
                mode=rs.cfg.mode.value,
                budget=str(rs.cfg.budget),
                block_size=self.block_size,
                prompt_len=rs.prompt_len_of(request.num_prompt_tokens),
            )
            observer = TraceRecorder(trace, self.vt.trace_dir)
        salt = rs.salt if rs.salt is not None else request_salt(request.request_id)
        return new_request_state(rs, salt, observer, self.vt.scores)

    def _preempt_request(self, request: Request, timestamp: float, drop_stale_output: bool = False) -> None:
        super()._preempt_request(request, timestamp, drop_stale_output)
        st = self._vt_reqs.get(request.request_id)
        if st is not None and st.table is not None:
            st.drop_table()
            self._vt_counters = self._vt_counters.add(preemptions=1)

    def _free_request(self, request: Request, delay_free_blocks: bool = False):
        """vLLM's, plus what eviction cost the request (``RequestCost``, read off its table): folded into the
        engine's cost histograms and returned in ``kv_transfer_params["vtoken"]``, which vLLM hands to the
        request's last output (and the OpenAI response) unchanged. A finished request's state goes."""
        st = self._vt_reqs.pop(request.request_id, None)
        cost = None
        if st is not None:
            st.observer.finished()
            cost = RequestCost.of_table(st.table, with_mass=st.want_attention)
            self._vt_costs = self._vt_costs.add(cost)
        kv_params, ec_params = super()._free_request(request, delay_free_blocks)
        if not self.requests:  # the last request has gone: the engine is idle
            self._vt_check_invariants({}, idle=True)
        return (kv_params if cost is None else cost_params(kv_params, cost)), ec_params

    def _vt_check_invariants(self, scheduled, idle: bool = False) -> None:
        """The KV invariants (vtoken/vllm/scheduling/invariants.py) over the pool, and over the token tables of the
        ``scheduled`` requests; idle: no vToken request state may be left either. Counts the check, its
        time and its violations; a violation is logged with the requests it names (``invariants: fatal``
        raises ``IntegrityError``). Reads only."""
        if self.vt.invariants == "off":
            return
        start = time.perf_counter()
        rows = [
            (rid, row)
            for m in self.kv_cache_manager.coordinator.single_type_managers
            for rid, row in m.req_to_blocks.items()
        ]  # a request holds a row in every group
        found = invariants.pool_violations(
            self.kv_cache_manager.block_pool, rows, (b for _, b in getattr(self, "deferred_frees", ()))
        )
        tables = {
            rid: self._vt_reqs[rid].live_table()
            for rid in scheduled
            if rid in self._vt_reqs and self._vt_reqs[rid].table is not None
        }
        if tables:
            mine = self._vt_manager.req_to_blocks if self.vt.enabled else {}
            found += invariants.table_violations(mine, tables, {rid: self.requests[rid].block_hashes for rid in tables})
        if idle and self._vt_reqs:
            found.append(
                f"request state left for {sorted(self._vt_reqs)[: invariants.SHOWN]} with no request in the engine"
            )
        self._vt_unchecked = 0
        self._vt_counters = self._vt_counters.add(
            invariant_checks=1, invariant_violations=len(found), invariant_seconds=time.perf_counter() - start
        )
        if found:
            where = "idle" if idle else f"step {self._vt_step}"
            logger.error("vToken KV invariant violated (%s): %s", where, " | ".join(found))
            if self.vt.invariants == "fatal":
                raise IntegrityError("7: KV invariants", f"{where}: " + " | ".join(found))

    # ------------------------------------------------------------------ the step
    def schedule(self, throttle_prefills: bool = False):
        if self._vt_steptime is None:
            out = self._vt_schedule(throttle_prefills)
        else:
            start = self._vt_admit()
            out = self._vt_schedule(throttle_prefills)
            self._vt_scheduled(out, start)
        self._vt_unchecked += 1
        if self.vt.invariant_period and self._vt_unchecked >= self.vt.invariant_period:
            self._vt_check_invariants(out.num_scheduled_tokens)
        return out

    def _vt_schedule(self, throttle_prefills: bool = False):
        if not self.vt.enabled:
            return super().schedule(throttle_prefills)
        work = _StepWork()
        for request in self.running:
            st = self._vt_reqs.get(request.request_id)
            if st is not None and st.preplaced is not None:
                self._vt_counters = self._vt_counters.add(carried_reservations=1)
            if st is None or st.table is None or st.preplaced is not None or not st.settings.cfg.mode.evicts:
                continue
            if request.status == RequestStatus.RUNNING:
                self._vt_decide(request, st, work)
        blocks.release(self.kv_cache_manager.block_pool, work.release)
        self._vt_pressure(work)  # trigger: pressure (vtoken/vllm/scheduling/pressure.py); releases its own blocks
        out = super().schedule(throttle_prefills)
        return attach_plan(out, self._vt_place(out, work))

    def _vt_protect(self, request: Request, st: RequestState):
        """The request's config with the protection in force (tokens of steps still in flight, async
        scheduling, have no statistics yet: protected like the recent window), after marking its shared
        leading blocks in the table; ``None`` when it must not decide this step (a shared block past the
        prefix could not be replaced). Mutates the table's shared count."""
        t, cfg = st.live_table(), st.settings.cfg
        guard = st.inflight.unobserved(t.seen)
        if guard > cfg.recent:
            cfg = dataclasses.replace(cfg, recent=guard)
        row = self._vt_manager.req_to_blocks[request.request_id]
        n_shared = min(blocks.shared_prefix(row), t.seen // self.block_size)
        if n_shared != t.shared_blocks:
            t.mark_shared(n_shared)
        if not blocks.can_replace_shared(row, n_shared, self.kv_cache_manager.block_pool):
            return None
        return cfg

    def _vt_decide(self, request: Request, st: RequestState, work: _StepWork, victims=None, cfg=None) -> None:
        """Decide (core), then the block work (``blocks.rewrite_row``: copy-on-write of blocks it must not
        write, moves, the cut tail) before vLLM allocates this step (mutates the table, the row and the pool).
        ``victims`` (with the ``cfg`` ``_vt_protect`` gave): the tokens a pressure round took from this
        request (vtoken/vllm/scheduling/pressure.py), instead of its budget's choice."""
        t, rid = st.live_table(), request.request_id
        if victims is None:
            if eviction_count(t.live, t.seen, t.prompt_len, st.settings.cfg) == 0 and st.settings.cfg.keep_mass is None:
                return  # nothing due (with keep_mass the scores decide, in choose_victims)
            cfg = self._vt_protect(request, st)
            if cfg is None:
                return  # a shared block past the prefix could not be replaced: decide at a later step
        row = self._vt_manager.req_to_blocks[rid]
        # the step's new tokens; an async step's placeholder for the token still being sampled counts
        n_new = request.num_tokens_with_spec + request.num_output_placeholders - request.num_computed_tokens
        st.inflight.freeze(t)
        decision = decide_step(t, st.policy, cfg, st.salt, 1 if n_new == 1 else 0, victims=victims)
        if decision.victims.size == 0:
            st.observer.decided(decision.victims, 0, t.shared_blocks)
            return
        st.preplaced = decision.placed
        rw = blocks.rewrite_row(self.kv_cache_manager.block_pool, self._vt_manager, rid, decision)
        st.observer.decided(decision.victims, int(rw.src.size), t.shared_blocks, rw.cow.num_copies, len(rw.replace))
        work.src.append(rw.src)
        work.dst.append(rw.dst)
        work.release.extend(rw.release)
        if rw.replace:
            work.replace[rid] = rw.replace
        if rw.cut:
            work.truncate[rid] = len(row)
        self._vt_counters = self._vt_counters.add(
            evicted_tokens=int(decision.victims.size),
            repack_moves=int(rw.src.size),
            repack_plans=1,
            reclaimed_blocks=rw.freed,
            cow_blocks=len(rw.replace),
            cow_moves=rw.cow.num_copies,
            cow_fallbacks=rw.fallbacks,
        )

    def _vt_place(self, out, work: _StepWork) -> StepPlan:
        """Place this step's scheduled tokens in their tables; build the worker's StepPlan."""
        steps: dict[str, RequestStep] = {}
        step, self._vt_step = self._vt_step, self._vt_step + 1
        for rid, n in out.num_scheduled_tokens.items():
            st = self._vt_reqs.get(rid)
            if st is None:
                continue
            computed_before = self.requests[rid].num_computed_tokens - n  # _update_after_schedule advanced it
            slots = self._vt_place_one(rid, st, computed_before, n)
            t = st.live_table()
            offset = t.seen - t.live
            appended = int(slots[0]) == t.live - n and (n == 1 or int(slots[-1]) == t.live - 1)
            window = window_queries(t.prompt_len, computed_before, n) if st.want_window else 0  # SnapKV's, once
            back = st.norm_back(computed_before, n)  # KNorm: a fresh table's cache hits (request_state.py)
            first = st.first_scored()  # slots below it stay forever: never scored (core/scored_range.py)
            scored = (st.want_attention or window > 0) and first < t.live
            if offset or not appended or scored or st.want_key_norm:
                steps[rid] = RequestStep(
                    offset=offset,
                    slots=None if appended else slots,
                    scores=scored,
                    key_norm=st.want_key_norm,
                    window=window,
                    norm_back=back,
                    redundancy=st.want_redundancy,
                    score_layers=st.settings.cfg.score_layers,
                    first=first if scored else 0,
                )
            st.inflight.add(step, computed_before - back, t.live, scored=scored)
            held = len(self._vt_manager.req_to_blocks.get(rid, ()))
            if self.vt.check:
                t.check(dense=True)
                blocks.check_hashes(
                    rid, self._vt_manager.req_to_blocks.get(rid, []), t, self.requests[rid].block_hashes
                )
                if held != t.required_blocks():
                    need = t.required_blocks()
                    raise IntegrityError("2: block accounting", f"request {rid} holds {held} blocks, needs {need}")
            st.observer.stepped(held, t, self.current_step)
        src = np.concatenate(work.src) if work.src else np.zeros(0, np.int64)
        dst = np.concatenate(work.dst) if work.dst else np.zeros(0, np.int64)
        return StepPlan(src=src, dst=dst, truncate=work.truncate, replace=work.replace, requests=steps, step=step)

    def _vt_place_one(self, rid: str, st: RequestState, computed_before: int, n: int) -> np.ndarray:
        """The row slots of the ``n`` tokens this step computes (mutates the table; creates it first)."""
        if st.table is None:
            st.table = TokenTable(
                block_size=self.block_size,
                mode=st.settings.cfg.mode,
                prompt_len=st.settings.prompt_len_of(self.requests[rid].num_prompt_tokens),
            )
            st.observer.new_table(computed_before)
            if computed_before:  # prefix-cache hits: computed with full visibility
                st.table.place(computed_before)
        t = st.table
        if st.preplaced is not None:
            if n != 1 or t.seen != computed_before + 1:
                raise IntegrityError("4: logical positions", f"request {rid}: pre-placed token but {n} scheduled")
            slots, st.preplaced = st.preplaced, None
        else:
            if t.seen != computed_before:
                raise IntegrityError(
                    "4: logical positions", f"request {rid}: table saw {t.seen} tokens, vLLM computed {computed_before}"
                )
            slots = t.place(n)
        st.observer.placed(computed_before, n)
        return slots

    def update_from_output(self, scheduler_output, model_runner_output):
        """Fold the step's scores into the tables through the step's own records (request_state.py), then
        vLLM's update. Scores of a preempted or finished request are dropped."""
        if self._vt_steptime is not None:
            self._vt_time_step(scheduler_output)
        plan, res = plan_of(scheduler_output), result_of(model_runner_output)
        if plan is not None and res is not None and res.step != plan.step:
            raise IntegrityError("4: logical positions", f"worker result of step {res.step} for step {plan.step}")
        records = {}
        if plan is not None:
            for rid in scheduler_output.num_scheduled_tokens:
                st = self._vt_reqs.get(rid)
                if st is not None:
                    records[rid] = st.inflight.take(plan.step)
        if res is not None:
            self._vt_counters = self._vt_counters.add(repack_seconds=res.move_seconds)
            for rid, scores in res.scores.items():
                st, rec = self._vt_reqs.get(rid), records.get(rid)
                if st is not None and st.table is not None and rec is not None:
                    observe(st.table, step_scores(rid, rec, st.table, scores), st.settings.cfg.question_aware)
        return super().update_from_output(scheduler_output, model_runner_output)

    # ------------------------------------------------------------------ stats
    def make_stats(self, *args, **kwargs):
        stats = super().make_stats(*args, **kwargs)
        if stats is not None and self.vt.enabled:
            encode_stats(stats, self._vt_snapshot())
        if stats is not None and self._vt_steptime is not None:
            encode_admission(stats, self.max_num_active_reqs)  # the limit the latest schedule() ran with
        return stats

    def _vt_snapshot(self) -> KVSnapshot:
        tables = {rid: st.table for rid, st in self._vt_reqs.items() if st.table is not None}
        pool = self.kv_cache_manager.block_pool
        return KVSnapshot(
            live_tokens=sum(t.live for t in tables.values()),
            held_blocks=sum(len(self._vt_manager.req_to_blocks.get(rid, ())) for rid in tables),
            packing_bound_blocks=sum(t.packing_bound() for t in tables.values()),
            naive_blocks=sum(t.naive_blocks() for t in tables.values()),
            pool_blocks=pool.num_gpu_blocks - 1,  # without vLLM's null block
            block_size=self.block_size,
            num_requests=len(tables),
            window_blocks=self._vt_window_blocks(),
            counters=self._vt_counters,
            costs=self._vt_costs,
            policy=self.vt.cfg.policy,
            mode=self.vt.cfg.mode.value,
            source="vtoken",
        )

    def _vt_window_blocks(self) -> int:
        """Blocks the requests hold in the KV cache groups vToken does not manage (a hybrid model's
        sliding-window groups; vLLM's null block, which stands in a row for blocks left behind the window,
        not counted). 0 on a model with one group. Reads only."""
        managers = self.kv_cache_manager.coordinator.single_type_managers
        return sum(
            not blk.is_null
            for m in managers
            if m is not self._vt_manager
            for row in m.req_to_blocks.values()
            for blk in row
        )

    def vtoken_stats(self) -> KVSnapshot | None:
        """Current gauges and counters (in-process callers; served engines read them from SchedulerStats).
        ``None`` when vToken is off for this engine (mode 'none')."""
        return self._vt_snapshot() if self.vt.enabled else None


class VTokenAsyncScheduler(VTokenScheduler, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` (async scheduling, CUDA's default) with vToken's hooks; never named in a
    configuration: ``VTokenScheduler(...)`` builds it when ``scheduler_config.async_scheduling`` is on.

    ``AsyncScheduler`` schedules step N+1 while step N runs: a decode request gets a placeholder for the token
    N is still sampling (``num_output_placeholders``), and N's output is processed after N+1 was scheduled.
    The hooks are ``VTokenScheduler``'s (method resolution order ``VTokenScheduler`` → ``AsyncScheduler`` →
    ``Scheduler``); what async scheduling changes is handled there: the decision counts the placeholder as
    the step's new token (reuse+repack places it into a hole); tokens placed by a step in flight are not
    evicted until its statistics arrived; scores are matched to their step by number and mapped through that
    step's slot→token map (vtoken/vllm/scheduling/request_state.py); preemption or abort between the two
    steps drops the request's records and the late scores with them. Moves and truncations of step N+1 run
    on the worker before N+1's forward and after N's (one stream, in order), the ordering vLLM relies on
    when it hands a block freed in N+1 to another request."""
