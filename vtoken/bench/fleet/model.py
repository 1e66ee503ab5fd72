"""``vtoken bench fleet``'s pieces: the workload, per-request KV use from vToken's core, and the routers.

* ``kv_profiles``: for each request class and mode, the mean KV blocks a request holds (and its live
  tokens) at each decode step — measured by running the class through ``vtoken.sim`` (the core's token
  tables, eviction policy and reclamation mode; synthetic attention), not a formula.
* Routers choose a replica for one request from the replicas' last polled routing stats (the dicts a
  replica's ``record_routing_stats`` returns, built by the project's own ``routing_stats``) and their live
  queue lengths (Serve's queue-length cache):

  ``kv``          ``KVAwareRouter``'s ranking — ``effective_free_tokens`` and ``rank_by_kv`` imported from
                  ``vtoken.serve.control.ranking`` — then the shortest queue in the first rank, as Serve
                  picks inside a rank; no fresh stats → power of two (the router's fallback)
  ``p2c``         Serve's default: two random replicas, the shorter queue
  ``least_kv``    llm-d's KV-cache-utilization scorer: the lowest polled ``kv_utilization``
  ``round_robin`` in turn

Pure apart from each router's own random generator and counter.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from vtoken.bench.settings import EVICTING
from vtoken.core.config import Mode, VTokenConfig
from vtoken.serve.control.ranking import RouterParams, effective_free_tokens, rank_by_kv, stats_as_of
from vtoken.serve.telemetry.stat_logger import POLLED_AT

MODES = ("naive", "repack")
ROUTERS = ("kv", "p2c", "least_kv", "round_robin")
# the replicas' config, declared once (``kv_profiles``, ``fleet.steps.measure_steps``): every token may be
# evicted (scope all); the mode is the bench's own (``--modes``: every replica of a run in one mode)
BASE = EVICTING
OWN = {"mode": "--modes picks the modes"}


@dataclass(frozen=True)
class RequestClass:
    prompt: int
    gen: int
    weight: float


# A chat-like mix (prompt, output tokens, share of requests); docs/results names it with the results.
WORKLOAD = (RequestClass(256, 128, 0.5), RequestClass(512, 256, 0.3), RequestClass(1024, 256, 0.2))


@dataclass(frozen=True)
class KVProfile:
    """One request class under one mode: blocks held and live tokens at each decode step (means)."""

    prefill_blocks: int  # the prompt's blocks, allocated at admission (before the first eviction)
    held: np.ndarray  # [gen] float
    live: np.ndarray  # [gen] float


def kv_profiles(classes=WORKLOAD, vtoken: VTokenConfig = BASE, requests: int = 16) -> dict[str, list[KVProfile]]:
    """``{mode: [KVProfile per class]}`` for ``MODES`` under ``vtoken``'s settings (its seed also seeds the
    synthetic attention), from ``vtoken.sim.run_simulation`` (the fast engine, checked equal to the core's
    exact replay by tests/integration/test_sim.py)."""
    from dataclasses import replace

    from vtoken.sim.run import SimConfig, run_simulation

    block_size = vtoken.block_size
    out: dict[str, list[KVProfile]] = {m: [] for m in MODES}
    for c in classes:
        cfg = SimConfig(vtoken=replace(vtoken, mode=Mode.REPACK), prompt_len=c.prompt, gen_len=c.gen, requests=requests)
        _, tally = run_simulation(cfg)
        series = tally.mean_series()
        live = tally.live_per_step_sum / tally.requests
        for m in MODES:
            out[m].append(KVProfile(-(-c.prompt // block_size), np.asarray(series[m], float), live))
    return out


class Router:
    """Base: ``choose(fleet, candidates, now)`` → a replica index from ``candidates`` (int array)."""

    name = "?"

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def choose(self, fleet, candidates: np.ndarray, now: float) -> int:
        raise NotImplementedError


class RoundRobin(Router):
    name = "round_robin"

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.next = 0

    def choose(self, fleet, candidates, now):
        self.next += 1
        return int(candidates[(self.next - 1) % len(candidates)])


class PowerOfTwo(Router):
    name = "p2c"

    def choose(self, fleet, candidates, now):
        if len(candidates) == 1:
            return int(candidates[0])
        a, b = self.rng.sample(range(len(candidates)), 2)
        ra, rb = int(candidates[a]), int(candidates[b])
        qa, qb = fleet.queue[ra], fleet.queue[rb]
        return ra if qa < qb or (qa == qb and self.rng.random() < 0.5) else rb


class LeastKV(Router):
    name = "least_kv"

    def choose(self, fleet, candidates, now):
        util = fleet.kv_util[candidates]  # the polled stats' kv_utilization; inf where none
        best = np.flatnonzero(util == util.min())
        return int(candidates[best[self.rng.randrange(len(best))]])


class KVAware(Router):
    """The project's KV-aware ranking (see the module docstring).

    ``memo``: a replica's score is recomputed (with ``effective_free_tokens``) only when its stats dict
    (a new poll), its queue length or its staleness (as of ``stats_as_of`` over the candidates) changed —
    same function, same inputs, same score; ``rank_by_kv`` still runs over every replica for every
    request. The runs' ``decision_us`` is this memoized cost; ``decision_cost`` measures the router's full
    per-request work.
    """

    name = "kv"

    def __init__(self, seed: int = 0, params: RouterParams | None = None, memo: bool = True) -> None:
        super().__init__(seed)
        self.params = params or RouterParams()
        self.fallback = PowerOfTwo(seed + 1)
        self.fallbacks = 0
        self.memo: dict[int, tuple[object, int, bool, float | None]] | None = {} if memo else None

    def score(self, r: int, stats: dict | None, queue: int, as_of: float) -> float | None:
        fresh = stats is not None and as_of - stats[POLLED_AT] <= self.params.stale_after_s
        if self.memo is not None:
            hit = self.memo.get(r)
            if hit is not None and hit[0] is stats and hit[1] == queue and hit[2] == fresh:
                return hit[3]
        value = effective_free_tokens(stats or {}, queue, self.params, as_of)
        if self.memo is not None:
            self.memo[r] = (stats, queue, fresh, value)
        return value

    def ranks(self, stats: list, queue: list[int], replicas: list[int], now: float):
        """``rank_by_kv`` of ``replicas`` scored by ``effective_free_tokens`` (None: no fresh stats)."""
        as_of = stats_as_of(stats, now)
        scores = [(r, self.score(r, s, q, as_of)) for r, s, q in zip(replicas, stats, queue, strict=True)]
        return rank_by_kv(scores, self.params.tie_tokens, self.rng)

    def choose(self, fleet, candidates, now):
        replicas = candidates.tolist()
        queue = fleet.queue[candidates].tolist()
        ranks = self.ranks([fleet.stats[r] for r in replicas], queue, replicas, now)
        if ranks is None:
            self.fallbacks += 1
            return self.fallback.choose(fleet, candidates, now)
        first = ranks[0]
        shortest = min(fleet.queue[r] for r in first)
        return next(r for r in first if fleet.queue[r] == shortest)  # rank order is already shuffled


def make_router(name: str, seed: int = 0, memo: bool = True) -> Router:
    if name == "kv":
        return KVAware(seed, memo=memo)
    return {"p2c": PowerOfTwo, "least_kv": LeastKV, "round_robin": RoundRobin}[name](seed)
