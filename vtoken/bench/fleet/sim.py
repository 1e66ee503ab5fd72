"""The fleet simulation: N replicas, each a vLLM-like engine with a KV pool, in ticks of ``tick_s``.

Per tick: requests arriving in it are routed one by one (``fleet.model`` routers, stats as last polled,
live queue lengths); every replica admits waiting requests FIFO while it has a sequence slot and the
prompt's blocks free (+1 watermark), spends ``per_token`` time per admitted prompt token (chunked into its
steps, as vLLM batches prefills with decodes), then runs as many decode steps of its running batch as
the rest of the tick allows (``StepModel``: measured steps, fitted). A request's blocks follow its class's
``KVProfile`` (vToken's core under the mode); a replica whose requests outgrow its pool preempts the
newest (recompute: back to the head of its queue). Stats are polled every ``stats_period_s``
(``routing_stats`` of a ``KVSnapshot``, as a replica answers). With ``autoscale`` the project's
``decide`` runs every second on look-back means, behind Serve's upscale/downscale delays; new replicas
serve ``startup_s`` after being requested; removed ones drain. Pure apart from its seeded generators.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from vtoken.core.reporting.engine_kv import KVSnapshot
from vtoken.serve.control.autoscaling import ScalingParams, decide
from vtoken.serve.telemetry.sla import RequestLatency, SloTargets, meets_slo
from vtoken.serve.telemetry.stat_logger import KV_UTILIZATION, routing_stats

QUEUED, RUNNING, DONE = 1, 2, 3


@dataclass(frozen=True)
class FleetSpec:
    replicas: int  # fixed size, or the autoscaler's max
    pool_blocks: int
    max_seqs: int
    block_size: int
    step: object  # fleet.steps.StepModel
    classes: tuple
    profiles: list  # [KVProfile] per class, for one mode
    slo: SloTargets
    duration_s: float = 60.0
    warmup_s: float = 15.0
    drain_s: float = 30.0
    tick_s: float = 0.1
    stats_period_s: float = 1.0
    autoscale: ScalingParams | None = None
    min_replicas: int = 1
    initial_replicas: int | None = None
    startup_s: float = 30.0
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 30.0
    look_back_s: float = 5.0
    seed: int = 0
    schedule: tuple | None = None  # ((arrival s, class index), ...) in place of Poisson arrivals (tests)


def arrivals(spec: FleetSpec, rate: float) -> tuple[np.ndarray, np.ndarray]:
    """Poisson arrival times over ``duration_s`` and each request's class index (seeded), or
    ``spec.schedule``'s arrivals before ``duration_s`` (sorted by time; ``rate`` unused)."""
    if spec.schedule is not None:
        fixed = sorted((float(a), int(c)) for a, c in spec.schedule if a < spec.duration_s)
        return np.array([a for a, _ in fixed]), np.array([c for _, c in fixed], np.int64)
    rng = np.random.default_rng(spec.seed)
    n = int(rate * spec.duration_s * 1.2) + 16
    times = np.cumsum(rng.exponential(1.0 / rate, n))
    times = times[times < spec.duration_s]
    weights = np.array([c.weight for c in spec.classes])
    return times, rng.choice(len(spec.classes), len(times), p=weights / weights.sum())


def simulate(spec: FleetSpec, router, rate: float) -> dict:
    """Run the fleet at ``rate`` requests/s; returns the run's measurements (JSON-able)."""
    times, cls = arrivals(spec, rate)
    n_max, B, pool = spec.replicas, spec.block_size, spec.pool_blocks
    gen = np.array([c.gen for c in spec.classes])[cls]
    prompt = np.array([c.prompt for c in spec.classes])[cls]
    prefill_blocks = np.array([p.prefill_blocks for p in spec.profiles])[cls]
    offsets = np.cumsum([0] + [c.gen for c in spec.classes])[:-1]
    held_flat = np.concatenate([p.held for p in spec.profiles])
    live_flat = np.concatenate([p.live for p in spec.profiles])
    R = len(times)
    state, replica = np.zeros(R, np.int8), np.full(R, -1)
    progress, t_first, t_done = np.zeros(R), np.full(R, np.nan), np.full(R, np.nan)
    admitted = np.zeros(R, np.int64)
    start_n = spec.initial_replicas or (spec.min_replicas if spec.autoscale else n_max)
    ready_at = np.full(n_max, np.inf)
    ready_at[:start_n] = 0.0
    draining = np.zeros(n_max, bool)
    waiting = [deque() for _ in range(n_max)]
    fleet = View(n_max)
    held, credit = np.zeros(n_max), np.zeros(n_max)
    target, pending = start_n, {"up": None, "down": None}
    samples: deque = deque()
    preemptions, seq, next_arrival, next_poll, next_scale = 0, 0, 0, 0.0, 1.0
    decision_s, decisions, replica_trace, kv_trace = 0.0, 0, [], []
    end = spec.duration_s + spec.drain_s
    ticks = int(math.ceil(end / spec.tick_s))
    for k in range(ticks):
        t = k * spec.tick_s
        live_mask = ready_at <= t
        routable = np.flatnonzero(live_mask & ~draining)
        while next_arrival < R and times[next_arrival] < t + spec.tick_s:
            i = next_arrival
            t0 = time.perf_counter()
            r = router.choose(fleet, routable, times[i])
            decision_s += time.perf_counter() - t0
            decisions += 1
            replica[i], state[i] = r, QUEUED
            waiting[r].append(i)
            fleet.queue[r] += 1
            next_arrival += 1
        running = np.flatnonzero(state == RUNNING)
        n_run = np.bincount(replica[running], minlength=n_max)
        credit = np.where(live_mask, np.minimum(credit, 0.0) + spec.tick_s, 0.0)
        for r in np.flatnonzero(live_mask):
            q = waiting[r]
            prefill_tokens, busy = 0, max(0.0, spec.tick_s - credit[r])  # debt from last tick's prefills
            while q and n_run[r] < spec.max_seqs and pool - held[r] >= prefill_blocks[q[0]] + 1:
                i = q.popleft()
                state[i], progress[i], admitted[i] = RUNNING, 0.0, seq
                seq += 1
                held[r] += prefill_blocks[i]
                prefill_tokens += prompt[i]
                # the prefill step that emits its first token starts no sooner than the request arrived
                t_first[i] = max(t + busy, times[i]) + spec.step.seconds(n_run[r], prefill_tokens)
                n_run[r] += 1
            credit[r] -= spec.step.seconds(0, prefill_tokens) - spec.step.seconds(0, 0)
        running = np.flatnonzero(state == RUNNING)
        reps = replica[running]
        step_s = spec.step.seconds(np.maximum(n_run, 1))
        steps_per = np.where(n_run > 0, np.maximum(credit, 0.0) / step_s, 0.0)
        progress[running] += steps_per[reps]
        over = progress[running] >= gen[running] - 1
        for i in running[over]:
            r = replica[i]
            extra = (progress[i] - (gen[i] - 1)) / steps_per[r] if steps_per[r] > 0 else 0.0
            t_done[i], state[i] = t + spec.tick_s * (1.0 - min(1.0, extra)), DONE
            fleet.queue[r] -= 1
        running = running[~over]
        idx = offsets[cls[running]] + np.minimum(progress[running].astype(np.int64), gen[running] - 1)
        held = np.bincount(replica[running], weights=held_flat[idx], minlength=n_max)
        for r in np.flatnonzero(held > pool):  # preempt the newest until the pool holds the rest
            mine = sorted(running[replica[running] == r], key=lambda i: -admitted[i])
            for i in mine:
                if held[r] <= pool:
                    break
                held[r] -= held_flat[offsets[cls[i]] + min(int(progress[i]), gen[i] - 1)]
                state[i], progress[i], t_first[i] = QUEUED, 0.0, np.nan
                waiting[r].appendleft(i)
                preemptions += 1
        if t >= next_poll:
            running = np.flatnonzero(state == RUNNING)
            idx = offsets[cls[running]] + np.minimum(progress[running].astype(np.int64), gen[running] - 1)
            live = np.bincount(replica[running], weights=live_flat[idx], minlength=n_max)
            n_run = np.bincount(replica[running], minlength=n_max)
            for r in range(n_max):
                fleet.set_stats(r, _poll(r, t, live_mask, held, live, n_run, waiting, pool, B))
            next_poll += spec.stats_period_s
            kv_trace.append(float(np.mean(held[live_mask & ~draining] / pool)) if routable.size else 0.0)
        draining_done = draining & (fleet.queue == 0) & live_mask
        ready_at[draining_done], draining[draining_done] = np.inf, False
        if spec.autoscale is not None and t >= next_scale:
            target = _autoscale(spec, t, target, pending, samples, fleet, ready_at, draining, held, waiting)
            next_scale += 1.0
        replica_trace.append(int(np.sum(live_mask & ~draining)))
    return _measure(
        spec, times, t_first, t_done, gen, rate, preemptions, decision_s, decisions, replica_trace, kv_trace, router
    )


class View:
    """What a router sees: ``stats[r]`` (last polled dict, or None), ``kv_util[r]`` (its
    ``kv_utilization``, inf when none) and ``queue[r]`` (live: Serve's queue-length cache)."""

    def __init__(self, n: int) -> None:
        self.stats: list[dict | None] = [None] * n
        self.kv_util = np.full(n, np.inf)
        self.queue = np.zeros(n, np.int64)

    def set_stats(self, r: int, stats: dict | None) -> None:
        self.stats[r] = stats
        self.kv_util[r] = stats[KV_UTILIZATION] if stats else np.inf


def _poll(r, t, live_mask, held, live, n_run, waiting, pool, B) -> dict | None:
    if not live_mask[r]:
        return None
    h, n = int(math.ceil(held[r] - 1e-9)), int(n_run[r])
    snap = KVSnapshot(
        live_tokens=int(live[r]),
        held_blocks=h,
        naive_blocks=h,
        packing_bound_blocks=int(math.ceil(live[r] / B)),
        pool_blocks=pool,
        block_size=B,
        num_requests=n,
        num_running=n,
        num_waiting=len(waiting[r]),
        at=t,
    )
    return routing_stats(snap, t)


def _autoscale(spec, t, target, pending, samples, fleet, ready_at, draining, held, waiting) -> int:
    """One control-loop tick: ``decide`` on look-back means, Serve's delays, start/drain replicas."""
    running = np.flatnonzero((ready_at <= t) & ~draining)
    samples.append(
        (
            t,
            {int(r): float(held[r] / spec.pool_blocks) for r in running},
            {int(r): float(len(waiting[r])) for r in running},
        )
    )
    while samples and samples[0][0] < t - spec.look_back_s:
        samples.popleft()
    kv = {r: float(np.mean([s[1][r] for s in samples if r in s[1]])) for r in running.tolist()}
    wait = {r: float(np.mean([s[2][r] for s in samples if r in s[2]])) for r in running.tolist()}
    d = decide(len(running), kv, wait, spec.autoscale, spec.min_replicas, spec.replicas, target)
    direction = "up" if d.desired > target else "down" if d.desired < target else None
    for key in ("up", "down"):
        pending[key] = (pending[key] or t) if key == direction else None
    delay = spec.upscale_delay_s if direction == "up" else spec.downscale_delay_s
    if direction is None or t - pending[direction] < delay:
        return target
    pending[direction] = None
    if d.desired > target:
        idle = np.flatnonzero(np.isinf(ready_at))[: d.desired - target]
        ready_at[idle] = t + spec.startup_s
    else:
        order = sorted(running.tolist(), key=lambda r: fleet.queue[r])[: target - d.desired]
        draining[order] = True
    return d.desired


def _measure(
    spec, times, t_first, t_done, gen, rate, preemptions, decision_s, decisions, replica_trace, kv_trace, router
) -> dict:
    window = (times >= spec.warmup_s) & (times < spec.duration_s)
    done = window & ~np.isnan(t_done)
    ttft = t_first[done] - times[done]
    tpot = (t_done[done] - t_first[done]) / np.maximum(gen[done] - 1, 1)
    e2e = t_done[done] - times[done]
    met = sum(
        meets_slo(RequestLatency(float(a), float(b), float(e), int(g), "length"), spec.slo)
        for a, b, e, g in zip(ttft, tpot, e2e, gen[done])
    )  # the replicas' own SLO rule
    seconds = spec.duration_s - spec.warmup_s
    steady = replica_trace[int(spec.warmup_s / spec.tick_s) : int(spec.duration_s / spec.tick_s)]
    return {
        "router": router.name,
        "rate_req_s": round(rate, 2),
        "requests": int(window.sum()),
        "finished": int(done.sum()),
        "slo_attainment": round(met / max(1, int(window.sum())), 4),
        "goodput_req_s": round(met / seconds, 2),
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
        "tpot_p50_s": _pct(tpot, 50, 4),
        "tpot_p99_s": _pct(tpot, 99, 4),
        "preemptions": preemptions,
        "mean_kv_utilization": round(float(np.mean(kv_trace[int(spec.warmup_s / spec.stats_period_s) :] or [0.0])), 3),
        "replicas_mean": round(float(np.mean(steady)), 1) if steady else 0.0,
        "replicas_trace_1s": replica_trace[:: int(round(1 / spec.tick_s))],
        "decision_us": round(1e6 * decision_s / max(1, decisions), 2),
        "kv_fallbacks": getattr(router, "fallbacks", None),
    }


def _pct(x: np.ndarray, q: float, nd: int = 3) -> float | None:
    return round(float(np.percentile(x, q)), nd) if len(x) else None
