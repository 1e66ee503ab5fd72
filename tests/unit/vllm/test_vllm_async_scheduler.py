"""The vToken scheduler under vLLM's async scheduling, in-process and without model weights.

Built the way vLLM's own scheduler tests build theirs: a ``VllmConfig`` and a ``KVCacheConfig`` by hand,
``ModelRunnerOutput``s fed by hand. ``FakeWorker`` stands in for vLLM's V1 runner + ``VTokenRunnerMixin``: it
keeps each request's block row as vLLM's runner does (new rows, appended blocks, the plan's truncations,
resumed rows), a "KV cache" whose every physical slot holds the (request, logical position) written there,
runs each plan's moves (gather all, scatter all) before the step's writes, and executes steps in schedule
order — the order the GPU stream gives them. Its scores say which token they were measured on: a slot's
attention is ``1000 + logical`` of the token the step read there, a new key's norm ``1000 + logical``. The
engine loop is vLLM's ``step_with_batch_queue``: schedule, and process the oldest output only when two steps
are in flight (or nothing else can be scheduled).
"""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
from support.scheduler import VOCAB, make_request, make_scheduler


class FakeWorker:
    """vLLM's V1 runner + the vToken mixin, reduced to block rows and slot contents (see the module doc)."""

    def __init__(self, block_size: int) -> None:
        self.B = block_size
        self.kv: dict[int, tuple[str, int]] = {}
        self.rows: dict[str, list[int]] = {}
        self.prompts: dict[str, list[int]] = {}  # prefix-cache hits read slots another request wrote
        self.steps_run = 0

    def phys(self, row: list[int], slot: int) -> int:
        return row[slot // self.B] * self.B + slot % self.B

    def execute(self, so, sched, live_at_schedule: dict[str, set[int]]):
        from vllm.v1.outputs import ModelRunnerOutput

        from vtoken.core.step_stats import SlotScores
        from vtoken.vllm.transport import StepResult, attach_result, plan_of

        plan = plan_of(so)
        if plan is not None and plan.num_moves:
            assert not set(plan.src.tolist()) & set(plan.dst.tolist())
            values = [self.kv.get(int(s)) for s in plan.src]
            for d, v in zip(plan.dst.tolist(), values):
                self.kv[d] = v
        for rid, blocks in (plan.replace if plan is not None else {}).items():
            for index, block_id in blocks.items():
                self.rows[rid][index] = block_id
        for rid, keep in (plan.truncate if plan is not None else {}).items():
            del self.rows[rid][keep:]
        for rid in so.finished_req_ids:
            self.rows.pop(rid, None)
        first = {}
        for nr in so.scheduled_new_reqs:
            self.rows[nr.req_id], first[nr.req_id] = list(nr.block_ids[0]), nr.num_computed_tokens
            self.prompts[nr.req_id] = list(nr.prompt_token_ids)
        cd = so.scheduled_cached_reqs
        for i, rid in enumerate(cd.req_ids):
            ids = cd.new_block_ids[i]
            if rid in cd.resumed_req_ids:
                self.rows[rid] = list(ids[0]) if ids else []
            elif ids:
                self.rows[rid].extend(ids[0])
            first[rid] = cd.num_computed_tokens[i]
        rows = [self.rows[rid] for rid in so.num_scheduled_tokens]  # (a preempted row here is stale)
        for b in {d // self.B for d in (plan.dst.tolist() if plan is not None else [])}:
            # prefix sharing puts a block in several rows: vToken's moves never write one of those (the
            # forward may: vLLM shares a block whose tokens a request computes in this very step)
            assert sum(b in row for row in rows) <= 1, f"a move writes block {b}, which is shared"
        scores, sampled = {}, []
        for rid, n in so.num_scheduled_tokens.items():
            rs = plan.requests.get(rid) if plan is not None else None
            f, off, row = first[rid], (rs.offset if rs is not None else 0), self.rows[rid]
            slots = rs.slots if rs is not None and rs.slots is not None else np.arange(f - off, f + n - off)
            for s, logical in zip(slots.tolist(), range(f, f + n)):
                self.kv[self.phys(row, s)] = (rid, logical)
            seq_len = f + n - off
            read = [self.kv.get(self.phys(row, s)) for s in range(seq_len)]
            mine = self.prompts[rid]
            assert all(
                t is not None
                and (t[0] == rid or (t[1] < len(mine) and self.prompts[t[0]][: t[1] + 1] == mine[: t[1] + 1]))
                for t in read
            ), f"{rid} reads a slot that holds another token"
            read = [(rid, t[1]) for t in read]
            assert {t[1] for t in read} == live_at_schedule[rid], f"{rid}: attention reads non-live tokens"
            if rs is not None and (rs.scores or rs.key_norm):
                val = np.array([1000.0 + t[1] for t in read])
                att = (
                    {"accumulated": val, "last": val.copy(), "unimportant": np.zeros(seq_len, np.uint64)}
                    if rs.scores
                    else {}
                )
                kn = np.arange(f, f + n) + 1000.0 if rs.key_norm else None
                scores[rid] = SlotScores(n_queries=n, seq_len=seq_len, key_norm=kn, **att)
            sampled.append([] if sched.requests[rid].is_prefill_chunk else [(f + n) % VOCAB + 1])
        self.steps_run += 1
        ids = list(so.num_scheduled_tokens)
        out = ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled
        )
        return attach_result(out, StepResult(scores=scores, step=plan.step)) if plan is not None else out


def check_attribution(sched) -> None:
    """Every statistic a table holds was measured on that token (1000 + its logical position)."""
    for st in sched._vt_reqs.values():
        t = st.table
        if t is None:
            continue
        lg = np.arange(t.seen)
        for name in ("last", "key_norm"):
            arr = getattr(t, name)[: t.seen]
            hit = arr != 0
            assert np.array_equal(arr[hit], 1000.0 + lg[hit]), f"{name} misattributed"
        acc = t.accumulated[: t.seen]
        ratio = acc / (1000.0 + lg)
        assert np.allclose(ratio, np.round(ratio)), "accumulated attention misattributed"


def run(sched, requests, *, max_iters=400, between=None, worker=None):
    """vLLM's batch-queue engine loop (2 steps in flight with async scheduling). ``between(sched, it)`` runs
    after each schedule(), before the oldest output is processed (aborts, checks); ``worker``: the
    ``FakeWorker`` of an earlier run (its cache holds what later prefix-cache hits read). Returns observations."""
    worker = worker if worker is not None else FakeWorker(sched.block_size)
    queue, seen = deque(), {"two_in_flight_evictions": 0, "reused": 0}
    for r in requests:
        sched.add_request(r)
    for it in range(max_iters):
        if not sched.has_requests() and not queue:
            break
        if sched.has_requests():
            evicted_before = sched._vt_counters.evicted_tokens
            so = sched.schedule()
            tables = {rid: st.table for rid, st in sched._vt_reqs.items() if st.table is not None}
            live = {rid: set(tables[rid].live_logicals().tolist()) for rid in so.num_scheduled_tokens if rid in tables}
            for rid, st in sched._vt_reqs.items():
                assert st.table is not None or not st.inflight.steps, f"{rid}: records outlived its table"
                if st.table is not None and st.inflight.steps:  # in-flight tokens are never evicted
                    lo = min(r.first for r in st.inflight.steps.values())
                    assert np.all(st.table.slot_of[lo : st.table.seen] >= 0), f"{rid}: in-flight token evicted"
                if len(st.inflight.steps) == 2 and sched._vt_counters.evicted_tokens > evicted_before:
                    seen["two_in_flight_evictions"] += 1
            plan = so.vtoken
            seen["reused"] += sum(rs.slots is not None for rs in plan.requests.values())
            queue.append((so, worker.execute(so, sched, live)))
            if between is not None:
                between(sched, it)
            if len(queue) < 2 and so.total_num_scheduled_tokens > 0 and sched.has_requests():
                continue
        if queue:
            so, out = queue.popleft()
            sched.update_from_output(so, out)
            check_attribution(sched)
    assert not queue and not sched.has_requests(), "did not finish"
    return seen


def test_async_variant_is_selected_by_vllms_setting():
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from vtoken.vllm.scheduler import VTokenAsyncScheduler, VTokenScheduler

    s = make_scheduler(async_scheduling=True)
    assert type(s) is VTokenAsyncScheduler
    assert isinstance(s, AsyncScheduler) and isinstance(s, VTokenScheduler)
    assert type(make_scheduler(async_scheduling=False)) is VTokenScheduler


@pytest.mark.parametrize("mode", ["repack", "reuse+repack", "naive"])
def test_two_steps_in_flight_evict_repack_and_attribute_scores(mode):
    """Decode steps of one request overlap; decisions taken while a step runs never evict its tokens, never
    let attention read a wrong slot, and its late scores land on the tokens they were measured on."""
    sched = make_scheduler(vtoken={"mode": mode})
    reqs = [
        make_request("a", 40, 24),
        make_request("b", 21, 30, policy="knorm"),
        make_request("c", 9, 20, policy="random", budget=0.3),
    ]
    seen = run(sched, reqs)
    assert seen["two_in_flight_evictions"] > 0  # decisions happened with two steps of a request in flight
    c = sched.vtoken_stats().counters
    assert c.evicted_tokens > 0 and c.repack_moves > 0
    if mode == "reuse+repack":
        assert seen["reused"] > 0  # an async decode step (a placeholder) still takes a hole
    if mode != "naive":
        assert c.reclaimed_blocks > 0


def test_preemption_and_abort_between_steps_drop_late_scores():
    """A tiny pool forces preemptions while steps are in flight; one request is aborted with a step in
    flight. Their late scores are dropped (tables restart from zero statistics), the rest stay exact."""
    aborted = []

    def between(sched, it):
        st = sched._vt_reqs.get("b")
        if not aborted and st is not None and st.inflight.steps and it > 6:
            from vllm.v1.request import RequestStatus

            sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
            aborted.append(it)

    sched = make_scheduler(num_blocks=14, max_batched=48)
    free0 = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    reqs = [make_request(r, 30, 40, budget=0.6) for r in "abcd"]
    run(sched, reqs, between=between)
    c = sched.vtoken_stats().counters
    assert aborted and c.preemptions > 0 and c.evicted_tokens > 0
    assert not sched._vt_reqs and sched.kv_cache_manager.block_pool.get_num_free_blocks() == free0


def test_scores_for_a_replaced_table_or_a_wrong_step_are_not_misattributed():
    """Records are per step: a result naming another step, or scores over another row length, fail loudly
    instead of landing on the wrong tokens."""
    from vtoken.core.step_stats import SlotScores
    from vtoken.errors import IntegrityError
    from vtoken.vllm.transport import StepResult, attach_result, result_of

    sched = make_scheduler(async_scheduling=True)
    sched.add_request(make_request("a", 16, 8))
    worker = FakeWorker(sched.block_size)
    so = sched.schedule()
    live = {"a": set(sched._vt_reqs["a"].table.live_logicals().tolist())}
    out = worker.execute(so, sched, live)
    bad = attach_result(out, StepResult(scores={}, step=so.vtoken.step + 1))
    with pytest.raises(IntegrityError, match="step"):
        sched.update_from_output(so, bad)
    res = result_of(out)
    res.step = so.vtoken.step
    res.scores = {
        "a": SlotScores(
            n_queries=16, seq_len=15, accumulated=np.ones(15), last=np.ones(15), unimportant=np.zeros(15, np.uint64)
        )
    }
    sched._vt_reqs["a"].inflight.add(so.vtoken.step, 0, 16, True)
    with pytest.raises(IntegrityError, match="15 slots"):
        sched.update_from_output(so, out)


def test_full_cuda_graph_engines_refuse_attention_policies_per_request():
    """An engine kept on FULL CUDA graphs (query-free policy) finishes a request that asks for an attention
    policy with an error instead of running it without statistics; an attention engine runs PIECEWISE."""
    from vllm.config.compilation import CUDAGraphMode

    sched = make_scheduler(vtoken={"policy": "random"}, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    assert sched.vllm_config.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    sched.add_request(make_request("att", 16, 4, policy="h2o"))
    sched.add_request(make_request("qf", 16, 4, policy="knorm"))
    assert "att" in sched.grammar_compile_error_reqs
    assert "att" not in sched._vt_reqs and "qf" in sched._vt_reqs
    sched = make_scheduler(
        vtoken={"policy": "h2o", "score_layers": None}, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE
    )
    assert sched.vllm_config.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    assert not sched.vllm_config.use_v2_model_runner


def test_layer_subset_engines_keep_full_graphs_and_refuse_other_layers_per_request():
    """An attention engine scoring a subset of the layers (``score_layers`` 1 of the tiny model's 2, the
    default) keeps FULL_AND_PIECEWISE (queries buffered inside the graphs, vtoken/vllm/runner/score_capture.py);
    a request asking other layers finishes with an error, one with the engine's layers runs (issue 41)."""
    from vllm.config.compilation import CUDAGraphMode

    sched = make_scheduler(vtoken={"policy": "h2o"}, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    assert sched.vllm_config.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    sched.add_request(make_request("same", 16, 4, policy="tova"))
    sched.add_request(make_request("all", 16, 4, score_layers=None))
    sched.add_request(make_request("qf", 16, 4, policy="knorm", score_layers=None))
    assert sched.grammar_compile_error_reqs == {"all"}
    assert {"same", "qf"} <= set(sched._vt_reqs) and "all" not in sched._vt_reqs
    # a query-free engine with ``scores: always`` buffers its queries too: an attention request is served
    always = make_scheduler(
        vtoken={"policy": "random", "scores": "always"}, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE
    )
    always.add_request(make_request("h2o", 16, 4, policy="h2o"))
    assert not always.grammar_compile_error_reqs and "h2o" in always._vt_reqs


def test_prefix_cached_blocks_are_copied_not_rewritten_under_async_scheduling():
    """Prefix caching on, two steps in flight: requests sharing a 32-token prefix (4 blocks of 8) arrive while
    earlier ones run and after they finished. No block in two rows is ever written, attention reads only live
    tokens with the right content, every later request hits the whole prefix (the evicting requests replaced
    the cached blocks they would have written and released the originals cached), ``check: true``
    (hash checks) on at every step."""
    prefix = np.random.default_rng(7).integers(10, VOCAB, 32).tolist()
    sched = make_scheduler(prefix_caching=True, vtoken={"budget": 0.4, "recent": 2})
    reqs = {f"p{i}": make_request(f"p{i}", 44, 20, prefix=prefix) for i in range(5)}

    def between(sched, it):
        if it == 6:
            sched.add_request(reqs["p1"])  # arrives while p0 runs: shares its prefix blocks

    hits, schedule = {}, sched.schedule

    def schedule_and_record_hits(*args, **kwargs):
        so = schedule(*args, **kwargs)
        for nr in so.scheduled_new_reqs:
            hits[nr.req_id] = nr.num_computed_tokens  # prefix-cache hits of its first step
        return so

    sched.schedule = schedule_and_record_hits
    worker = FakeWorker(sched.block_size)
    run(sched, [reqs["p0"]], between=between, worker=worker)
    run(sched, [reqs["p2"], reqs["p3"]], worker=worker)  # after both finished, together
    run(sched, [reqs["p4"]], worker=worker)
    assert hits == {"p0": 0, "p1": 32, "p2": 32, "p3": 32, "p4": 32}, hits
    c = sched.vtoken_stats().counters
    assert c.evicted_tokens > 0 and c.cow_blocks > 0 and c.cow_moves > 0 and c.cow_fallbacks == 0
