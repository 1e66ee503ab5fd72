"""The scheduler side of vToken: token tables, the policy decision, repack plans, real block accounting.

``VTokenScheduler`` subclasses vLLM's V1 ``Scheduler`` (``scheduler_cls``). Every step::

    schedule():
      for each RUNNING request over its budget           (before vLLM schedules anything)
        victims = choose_victims(table, policy, cfg)       vtoken.core.eviction
        table.evict(victims)                               holes appear
        [reuse+repack, decode] table.place(1)              the new token takes the lowest hole
        plan = table.plan(); table.apply(plan)             minimal moves; row is dense again
        un-hash the blocks the plan or later appends write (prefix cache stays truthful)
        free the row's tail blocks (plan.keep_blocks..) → vLLM's BlockPool
      super().schedule()                                   vLLM admits/allocates with the freed blocks;
                                                           allocation counts come from the token table
      for each scheduled request: table.place(n)           new tokens' slots (append, or the hole above)
      attach StepPlan (moves, row truncations, offsets)    → worker, same SchedulerOutput
    update_from_output():
      fold the worker's per-token scores into the tables   vtoken.core.stats.observe

``num_computed_tokens`` stays *logical* (RoPE positions, stop checks, max_model_len are logical); only the
block arithmetic is physical: the coordinator's ``get_num_blocks_to_allocate`` / ``allocate_new_blocks``
are wrapped on this instance to size rows by ``TokenTable.required_blocks_after_place`` (the packing bound
for repack, the naive rule for naive), and ``cache_blocks`` stops publishing prefix-cache hashes for a
request after its first eviction (its later KV no longer matches the token-hash chain).

Prefix caching stays on. A leading block another request shares (``ref_cnt > 1``) is declared shared in the
token table (``mark_shared``): its tokens are never evicted, so it is never a move source or destination.
A block this request is about to write (a move destination, the hole a new token takes, or any block at or
past the live frontier) loses its hash first (``BlockPool.evict_blocks``). Freed tail blocks keep their
hash when they have one: their content is untouched (they were only read).

Preemption: vLLM frees every block and later recomputes the request from its logical tokens (prompt +
generated so far). The token table and scores are dropped with the blocks; the recomputation sees every
token (nothing is evicted while it runs, exactly like the first prefill), and the policy then evicts down to
the budget again from fresh scores. Generated tokens are not changed; tokens generated after the resume are
conditioned on the recomputed (un-evicted-then-re-evicted) cache. Traces record this as a new epoch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from vtoken.core.config import ConfigError, VTokenConfig
from vtoken.core.eviction import choose_victims, eviction_count
from vtoken.core.manager import physical_slots, request_salt
from vtoken.core.stats import StepScores, observe
from vtoken.core.token_table import IntegrityError, TokenTable
from vtoken.vllm.config import EngineSettings, RequestSettings, policy_needs, request_settings
from vtoken.vllm.stats import Counters, encode_stats
from vtoken.vllm.trace import RequestTrace
from vtoken.vllm.transport import RequestStep, StepPlan, attach_plan, result_of

logger = logging.getLogger("vtoken.vllm")


@dataclass
class _Req:
    """vToken state of one request (the scheduler owns it; mutated every step)."""

    settings: RequestSettings
    policy: object
    salt: int
    table: TokenTable | None = None
    preplaced: np.ndarray | None = None  # reuse+repack: slot given to the next token before vLLM scheduled it
    rounds: int = 0  # forward steps that computed tokens of this request, this epoch
    pending: tuple[int, int, int] | None = None  # (table version, first new logical, n new) of the step in flight
    trace: RequestTrace | None = None
    want_scores: bool = False
    want_key_norm: bool = False

    @property
    def cfg(self) -> VTokenConfig:
        return self.settings.cfg


@dataclass
class _StepWork:
    src: list[np.ndarray] = field(default_factory=list)
    dst: list[np.ndarray] = field(default_factory=list)
    truncate: dict[str, int] = field(default_factory=dict)


class VTokenScheduler(Scheduler):
    """vLLM's V1 scheduler with per-token eviction and repacking (see the module docstring)."""

    def __init__(self, vllm_config, kv_cache_config, structured_output_manager, block_size, *args, **kwargs):
        from vtoken.vllm.internals import check_vllm_version

        check_vllm_version()
        settings = EngineSettings.from_additional_config(vllm_config.additional_config, block_size)
        super().__init__(vllm_config, kv_cache_config, structured_output_manager, block_size, *args, **kwargs)
        self.vt = settings
        self._vt_reqs: dict[str, _Req] = {}
        self._vt_counters = Counters()
        if not settings.enabled:
            return
        _check_supported(vllm_config, kv_cache_config)
        self._vt_manager = self.kv_cache_manager.coordinator.single_type_managers[0]
        self._vt_install_shims()
        logger.info(
            "vToken on: policy=%s budget=%s mode=%s sinks=%d recent=%d trigger=%s block_size=%d",
            settings.cfg.policy, settings.cfg.budget, settings.cfg.mode.value, settings.cfg.sinks,
            settings.cfg.recent, settings.cfg.trigger.value, block_size,
        )

    # ------------------------------------------------------------------ shims (this instance only)
    def _vt_install_shims(self) -> None:
        coord = self.kv_cache_manager.coordinator
        reqs = self._vt_reqs
        B = self.block_size
        orig_count = coord.get_num_blocks_to_allocate
        orig_alloc = coord.allocate_new_blocks
        orig_cache = coord.cache_blocks

        def physical_tokens(request_id: str, num_tokens: int) -> int:
            st = reqs.get(request_id)
            if st is None or st.table is None:
                return num_tokens
            t = st.table
            return t.required_blocks_after_place(max(num_tokens - t.seen, 0)) * B

        def get_num_blocks_to_allocate(request_id, num_tokens, *args, **kwargs):
            return orig_count(request_id, physical_tokens(request_id, num_tokens), *args, **kwargs)

        def allocate_new_blocks(request_id, num_tokens, *args, **kwargs):
            return orig_alloc(request_id, physical_tokens(request_id, num_tokens), *args, **kwargs)

        def cache_blocks(request, num_computed_tokens):
            st = reqs.get(request.request_id)
            if st is not None and st.table is not None and st.table.evicted_total > 0:
                return None  # its KV no longer matches the hash chain of its tokens
            return orig_cache(request, num_computed_tokens)

        coord.get_num_blocks_to_allocate = get_num_blocks_to_allocate
        coord.allocate_new_blocks = allocate_new_blocks
        coord.cache_blocks = cache_blocks

    # ------------------------------------------------------------------ request lifecycle
    def add_request(self, request: Request) -> None:
        if self.vt.enabled and request.request_id not in self._vt_reqs:
            try:
                rs = request_settings(self.vt, getattr(request.sampling_params, "extra_args", None))
            except ConfigError as e:
                logger.error("vToken: request %s rejected: %s", request.request_id, e)
                super().add_request(request)
                # finished with an error (and an output to the client) at the next update, by vLLM's own
                # error path; it never gets vToken state, so until then it is plain vLLM
                self.grammar_compile_error_reqs.add(request.request_id)
                return
            policy = rs.cfg.make_policy()
            uses_attention, uses_key_norm = policy_needs(rs.cfg.policy)
            evicts = rs.cfg.mode.evicts
            self._vt_reqs[request.request_id] = _Req(
                settings=rs,
                policy=policy,
                salt=rs.salt if rs.salt is not None else request_salt(request.request_id),
                want_scores=(self.vt.scores == "always") or (evicts and uses_attention and self.vt.scores == "auto"),
                want_key_norm=(self.vt.scores == "always") or (evicts and uses_key_norm),
            )
        super().add_request(request)

    def _preempt_request(self, request: Request, timestamp: float, drop_stale_output: bool = False) -> None:
        super()._preempt_request(request, timestamp, drop_stale_output)
        st = self._vt_reqs.get(request.request_id)
        if st is not None and st.table is not None:
            st.table = None
            st.preplaced = None
            st.pending = None
            self._vt_counters.preemptions += 1

    def _free_request(self, request: Request, delay_free_blocks: bool = False):
        st = self._vt_reqs.pop(request.request_id, None)
        if st is not None and st.trace is not None and self.vt.trace_dir:
            try:
                st.trace.write(self.vt.trace_dir)
            except OSError as e:  # a trace must never take the engine down
                logger.warning("vToken: could not write trace of %s: %s", request.request_id, e)
        return super()._free_request(request, delay_free_blocks)

    # ------------------------------------------------------------------ the step
    def schedule(self, throttle_prefills: bool = False):
        if not self.vt.enabled:
            return super().schedule(throttle_prefills)
        work = _StepWork()
        for request in self.running:
            st = self._vt_reqs.get(request.request_id)
            if st is not None and st.preplaced is not None:
                self._vt_counters.carried_reservations += 1
            if st is None or st.table is None or st.preplaced is not None or not st.cfg.mode.evicts:
                continue
            if request.status != RequestStatus.RUNNING:
                continue
            self._vt_decide(request, st, work)
        out = super().schedule(throttle_prefills)
        plan = self._vt_place(out, work)
        return attach_plan(out, plan)

    def _vt_decide(self, request: Request, st: _Req, work: _StepWork) -> None:
        """Evict, plan, apply, free the tail — before vLLM allocates this step (mutates table and row)."""
        t, cfg = st.table, st.cfg
        if eviction_count(t.live, t.seen, cfg) == 0:
            return
        rid = request.request_id
        blocks = self._vt_manager.req_to_blocks[rid]
        n_shared = 0
        while n_shared < len(blocks) and blocks[n_shared].ref_cnt > 1:
            n_shared += 1
        if n_shared != t.shared_blocks:
            t.mark_shared(min(n_shared, t.seen // self.block_size))
            if st.trace is not None:
                st.trace.shared_blocks_max = max(st.trace.shared_blocks_max, t.shared_blocks)
        victims = choose_victims(t, st.policy, cfg, st.salt)
        if victims.size == 0:
            return
        t.evict(victims, cfg.sinks, cfg.recent)
        self._vt_counters.evicted_tokens += int(victims.size)
        if st.trace is not None:
            st.trace.epochs[-1].evict(victims, st.rounds)
            st.trace.evicted += int(victims.size)
        decode = request.num_tokens - request.num_computed_tokens == 1 and not request.spec_token_ids
        if cfg.mode.reuses_holes and decode:
            st.preplaced = t.place(1)
        sp = t.plan()
        B = self.block_size
        row = np.fromiter((b.block_id for b in blocks), dtype=np.int64, count=len(blocks))
        # Un-hash every block this plan, the pre-placed token or later appends will write.
        first_written = t.live // B
        if sp.num_moves:
            first_written = min(first_written, int(sp.moves[:, 1].min()) // B)
        if st.preplaced is not None:
            first_written = min(first_written, int(st.preplaced.min()) // B)
        keep = min(sp.keep_blocks, len(blocks))
        written = blocks[first_written:keep]
        for b in written:
            if b.ref_cnt != 1 or b.is_null:
                raise IntegrityError(
                    "6: shared blocks untouched",
                    f"request {rid} would write block {b.block_id} (ref_cnt={b.ref_cnt})",
                )
        hashed = {b.block_id for b in written if b.block_hash is not None}
        if hashed:
            self.kv_cache_manager.evict_blocks(hashed)
        t.apply(sp)
        if sp.num_moves:
            phys = physical_slots(row, sp.moves.reshape(-1), B).reshape(-1, 2)
            work.src.append(phys[:, 0])
            work.dst.append(phys[:, 1])
            self._vt_counters.moves += sp.num_moves
            if st.trace is not None:
                st.trace.moves += sp.num_moves
        self._vt_counters.plans += 1
        if keep < len(blocks):
            tail = blocks[keep:]
            del blocks[keep:]
            cached = self._vt_manager.num_cached_block
            if rid in cached:
                cached[rid] = min(cached[rid], keep)
            self.kv_cache_manager.block_pool.free_blocks(reversed(tail))
            work.truncate[rid] = keep
            self._vt_counters.reclaimed_blocks += len(tail)

    def _vt_place(self, out, work: _StepWork) -> StepPlan:
        """Place this step's scheduled tokens in their tables; build the worker's StepPlan."""
        steps: dict[str, RequestStep] = {}
        for rid, n in out.num_scheduled_tokens.items():
            st = self._vt_reqs.get(rid)
            if st is None:
                continue
            request = self.requests[rid]
            computed_before = request.num_computed_tokens - n  # already advanced by _update_after_schedule
            if st.table is None:
                st.table = TokenTable(block_size=self.block_size, mode=st.cfg.mode)
                st.rounds = 0
                if st.trace is None and self.vt.trace_dir is not None:
                    st.trace = RequestTrace(
                        request_id=rid, trace_id=st.settings.trace_id, policy=st.cfg.policy,
                        mode=st.cfg.mode.value, budget=str(st.cfg.budget), block_size=self.block_size,
                        prompt_len=request.num_prompt_tokens,
                    )
                if st.trace is not None:
                    prev = st.trace.epochs
                    start = 0 if not prev else len(prev[-1].placed_round)
                    st.trace.new_epoch(start)
                if computed_before:  # prefix-cache hits: computed with full visibility
                    st.table.place(computed_before)
                    if st.trace is not None:
                        st.trace.epochs[-1].place(0, computed_before, 0)
                        st.trace.epochs[-1].hits = computed_before
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
            if st.trace is not None:
                st.trace.epochs[-1].place(computed_before, n, st.rounds)
            st.rounds += 1
            st.pending = (t.version, computed_before, n)
            offset = t.seen - t.live
            append_start = t.live - n
            override = None if int(slots[0]) == append_start and (n == 1 or int(slots[-1]) == t.live - 1) else slots
            if offset or override is not None or st.want_scores or st.want_key_norm:
                steps[rid] = RequestStep(offset=offset, slots=override, scores=st.want_scores, key_norm=st.want_key_norm)
            if st.trace is not None or self.vt.check:
                held = len(self._vt_manager.req_to_blocks.get(rid, ()))
                if self.vt.check:
                    t.check(dense=True)
                    if held != t.required_blocks():
                        raise IntegrityError("2: block accounting", f"request {rid} holds {held} blocks, table needs {t.required_blocks()}")
                if st.trace is not None:
                    st.trace.held_blocks.append(held)
                    st.trace.packing_bound.append(t.packing_bound())
                    st.trace.naive_blocks.append(t.naive_blocks())
                    st.trace.live_tokens.append(t.live)
                    st.trace.engine_steps.append(self.current_step)
        src = np.concatenate(work.src) if work.src else np.zeros(0, np.int64)
        dst = np.concatenate(work.dst) if work.dst else np.zeros(0, np.int64)
        return StepPlan(src=src, dst=dst, truncate=work.truncate, requests=steps)

    def update_from_output(self, scheduler_output, model_runner_output):
        res = result_of(model_runner_output)
        if res is not None:
            self._vt_counters.move_seconds += res.move_seconds
            for rid, item in res.scores.items():
                st = self._vt_reqs.get(rid)
                if st is None or st.table is None or st.pending is None:
                    continue
                self._vt_observe(st, item)
        return super().update_from_output(scheduler_output, model_runner_output)

    def _vt_observe(self, st: _Req, item: dict) -> None:
        t = st.table
        version, first, n = st.pending
        if t.version != version:  # the table changed since the step was planned (async scheduling)
            return
        norms = item.get("key_norm")
        if "attn_sum" in item:
            seq_len = int(item["seq_len"])
            logicals = t.token_at[:seq_len].copy()
            ok = logicals >= 0
            scores = StepScores(
                logicals=logicals[ok],
                attn_sum=np.asarray(item["attn_sum"])[ok],
                attn_last=np.asarray(item["attn_last"])[ok],
                unimportant_bits=np.asarray(item["bits"], dtype=np.uint64)[ok],
                n_queries=int(item["n_q"]),
                key_norm_logicals=np.arange(first, first + n, dtype=np.int64) if norms is not None else None,
                key_norm=norms,
            )
        elif norms is not None:
            empty = np.zeros(0, np.int64)
            scores = StepScores(
                logicals=empty, attn_sum=np.zeros(0), attn_last=np.zeros(0),
                unimportant_bits=np.zeros(0, np.uint64), n_queries=int(item["n_q"]),
                key_norm_logicals=np.arange(first, first + n, dtype=np.int64), key_norm=norms,
            )
        else:
            return
        observe(t, scores)

    # ------------------------------------------------------------------ stats
    def make_stats(self, *args, **kwargs):
        stats = super().make_stats(*args, **kwargs)
        if stats is not None and self.vt.enabled:
            encode_stats(stats, self._vt_snapshot())
        return stats

    def _vt_snapshot(self):
        from vtoken.vllm.stats import VTokenStats

        live = held = bound = naive = n = 0
        for rid, st in self._vt_reqs.items():
            if st.table is None:
                continue
            n += 1
            live += st.table.live
            bound += st.table.packing_bound()
            naive += st.table.naive_blocks()
            held += len(self._vt_manager.req_to_blocks.get(rid, ()))
        c = self._vt_counters
        return VTokenStats(
            live_tokens=live,
            held_blocks=held,
            packing_bound_blocks=bound,
            naive_blocks=naive,
            pool_blocks=self.kv_cache_manager.block_pool.num_gpu_blocks - 1,
            free_blocks=self.kv_cache_manager.block_pool.get_num_free_blocks(),
            block_size=self.block_size,
            num_requests=n,
            evicted_tokens_total=c.evicted_tokens,
            reclaimed_blocks_total=c.reclaimed_blocks,
            repack_moves_total=c.moves,
            repack_seconds_total=c.move_seconds,
            num_plans=c.plans,
            preemptions_total=c.preemptions,
            policy=self.vt.cfg.policy,
            mode=self.vt.cfg.mode.value,
        )

    def vtoken_stats(self):
        """Current gauges and counters (in-process callers; served engines read them from SchedulerStats).
        ``None`` when vToken is off for this engine (mode 'none')."""
        return self._vt_snapshot() if self.vt.enabled else None


def _check_supported(vllm_config, kv_cache_config) -> None:
    """Refuse configurations vToken cannot keep exact (raises ConfigError at start-up)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec) or isinstance(
        groups[0].kv_cache_spec, SlidingWindowSpec
    ):
        raise ConfigError("vToken supports models with one full-attention KV cache group only")
    if vllm_config.speculative_config is not None:
        raise ConfigError("vToken does not support speculative decoding (drafters compute logical slots)")
    pc = vllm_config.parallel_config
    if pc.tensor_parallel_size > 1 or pc.pipeline_parallel_size > 1:
        raise ConfigError("vToken runs with tensor/pipeline parallel size 1 only (scores are not all-reduced yet)")
    if vllm_config.kv_transfer_config is not None:
        raise ConfigError("vToken does not support KV connectors (they assume append-only block rows)")
    from vtoken.vllm.internals import is_vtoken_worker

    if not is_vtoken_worker(vllm_config.parallel_config.worker_cls):
        raise ConfigError(
            f"vToken's scheduler needs vToken's worker, got worker_cls={vllm_config.parallel_config.worker_cls!r}; "
            "pass worker_cls='vtoken.vllm.worker.VTokenWorker' (see vtoken.vllm.engine_kwargs)"
        )
