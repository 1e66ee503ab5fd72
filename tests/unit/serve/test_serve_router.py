"""KV-aware router ranking and the autoscaling policy's decisions, on synthetic stats and contexts.

Unit tests of the pure decision functions; the behaviour with real engines is in test_serve_e2e.py and
test_serve_multinode.py.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from types import SimpleNamespace

import pytest

from vtoken.core.reporting.engine_kv import KVSnapshot
from vtoken.serve.control.autoscaling import KVAutoscalingPolicy, ScalingParams, decide
from vtoken.serve.control.ranking import RouterParams, effective_free_tokens, rank_by_kv, stats_as_of
from vtoken.serve.control.router import UNSCORED_LOG_EVERY_S, KVAwareRouter
from vtoken.serve.telemetry.stat_logger import POLLED_AT, routing_stats

NOW = 1_000_000.0
P = RouterParams(stale_after_s=5.0, fragmentation_weight=0.5, tokens_per_queued_request=256, tie_tokens=64)


def stats(
    held: int,
    live: int | None = None,
    pool: int = 63,
    running: int = 0,
    waiting: int = 0,
    at: float = NOW,
    polled: float = NOW,
) -> dict:
    snap = KVSnapshot(
        live_tokens=live if live is not None else held * 32,
        held_blocks=held,
        packing_bound_blocks=held,
        naive_blocks=held,
        pool_blocks=pool,
        block_size=32,
        num_running=running,
        num_waiting=waiting,
        at=at,
    )
    return routing_stats(snap, polled)


def test_more_free_kv_ranks_first_and_fragmentation_discounts():
    a, b = stats(held=40, running=1), stats(held=10, running=1)
    assert effective_free_tokens(a, 1, P, NOW) == (63 - 40) * 32
    ranks = rank_by_kv([("a", effective_free_tokens(a, 1, P, NOW)), ("b", effective_free_tokens(b, 1, P, NOW))], 64)
    assert ranks == [["b"], ["a"]]
    # same free blocks; c fills its 20 held blocks half (320 wasted slots, charged at weight 0.5)
    c = stats(held=20, live=320, running=1)
    d = stats(held=20, running=1)
    assert effective_free_tokens(c, 1, P, NOW) == pytest.approx(43 * 32 - 0.5 * 320)
    assert rank_by_kv([("c", effective_free_tokens(c, 1, P, NOW)), ("d", effective_free_tokens(d, 1, P, NOW))], 64) == [
        ["d"],
        ["c"],
    ]


def test_one_short_request_does_not_make_a_replica_look_full():
    """A 3-token request in one block is 90% 'fragmented', but wastes only 29 slots of 2016."""
    short = stats(held=1, live=3, running=1)
    long_ = stats(held=12, live=368, running=1)
    s_short, s_long = effective_free_tokens(short, 1, P, NOW), effective_free_tokens(long_, 1, P, NOW)
    assert s_short == pytest.approx(62 * 32 - 0.5 * 29) and s_short - s_long > 64


def test_queued_requests_are_charged_and_ties_share_a_rank():
    idle = stats(held=0)
    # 3 requests already sent to "busy" but not running yet: charged 3 * 256 tokens
    assert effective_free_tokens(idle, 3, P, NOW) == 63 * 32 - 3 * 256
    assert effective_free_tokens(stats(held=0, waiting=2), 0, P, NOW) == 63 * 32 - 2 * 256
    near = [("x", 2000.0), ("y", 1990.0), ("z", 1000.0)]
    ranks = rank_by_kv(near, tie_tokens=64, rng=random.Random(0))
    assert sorted(ranks[0]) == ["x", "y"] and ranks[1] == ["z"]
    assert rank_by_kv(near, tie_tokens=0) == [["x"], ["y"], ["z"]]


def test_equal_scores_are_shuffled_so_idle_traffic_spreads():
    firsts = {rank_by_kv([("a", 5.0), ("b", 5.0)], 0, rng=random.Random(seed))[0][0] for seed in range(20)}
    assert firsts == {"a", "b"}


def test_missing_or_stale_stats_go_last_or_trigger_fallback():
    fresh = stats(held=30)
    stale_poll = stats(held=0, polled=NOW - 60)
    long_step = stats(held=30, running=1, at=NOW - 60)  # busy engine inside a minute-long step
    assert effective_free_tokens({}, 0, P, NOW) is None
    assert effective_free_tokens({"vtoken:free_kv_tokens": "x"}, 0, P, NOW) is None
    assert effective_free_tokens(stale_poll, 0, P, NOW) is None
    assert effective_free_tokens(long_step, 0, P, NOW) == (63 - 30) * 32  # still counts what it holds
    idle_old = stats(held=0, at=NOW - 600)  # idle engine: old step, still accurate
    assert effective_free_tokens(idle_old, 0, P, NOW) == 63 * 32
    scores = [("fresh", effective_free_tokens(fresh, 0, P, NOW)), ("stale", None), ("none", None)]
    assert rank_by_kv(scores, 64) == [["fresh"], ["stale", "none"]]
    assert rank_by_kv([("a", None), ("b", None)], 64) is None


class FakeReplica(SimpleNamespace):
    pass


def make_router(queue: dict) -> KVAwareRouter:
    router = object.__new__(KVAwareRouter)  # the ranking does not need Serve's constructor
    router._replica_queue_len_cache = SimpleNamespace(get=lambda rid: queue.get(rid))
    router.initialize_state(stale_after_s=5.0, tie_tokens=64)
    return router


def test_choose_replicas_kv_first_then_power_of_two_fallback(monkeypatch):
    monkeypatch.setattr("vtoken.serve.control.router.time.time", lambda: NOW)
    loaded = FakeReplica(replica_id="A", routing_stats=stats(held=50, running=2))
    empty = FakeReplica(replica_id="B", routing_stats=stats(held=2, running=1))
    router = make_router({"A": 2, "B": 1})
    ranks = asyncio.run(router.choose_replicas([loaded, empty]))
    assert [[r.replica_id for r in rank] for rank in ranks] == [["B"], ["A"]]
    assert router.kv_routed == 1
    unknown = [FakeReplica(replica_id=i, routing_stats={}) for i in "CDE"]
    ranks = asyncio.run(router.choose_replicas(unknown))
    assert len(ranks) == 1 and len(ranks[0]) == 2 and router.fallbacks == 1


def test_replicas_ranked_last_are_logged_once_per_period(monkeypatch, caplog):
    """A replica without fresh stats is an operational fault: one line per replica and period says why."""
    clock = [NOW]
    monkeypatch.setattr("vtoken.serve.control.router.time.time", lambda: clock[0])
    fresh = FakeReplica(replica_id="A", routing_stats=stats(held=1))
    stale = FakeReplica(replica_id="B", routing_stats=stats(held=0, polled=NOW - 60))
    silent = FakeReplica(replica_id="C", routing_stats={})
    partial = FakeReplica(replica_id="D", routing_stats={POLLED_AT: NOW})
    router = make_router({})
    caplog.set_level("WARNING", logger="ray.serve")
    for _ in range(3):
        asyncio.run(router.choose_replicas([fresh, stale, silent, partial]))
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        (
            "vtoken router: replica B ranked last: stats polled 60.0 s before the freshest "
            "replica's, 60.0 s ago (stale after 5.0 s)"
        ),
        "vtoken router: replica C ranked last: no routing stats",
        "vtoken router: replica D ranked last: its routing stats lack a number the ranking needs",
    ]
    clock[0] += UNSCORED_LOG_EVERY_S  # a period later, no new poll: B and C again; A aged with them, fresh
    asyncio.run(router.choose_replicas([fresh, stale, silent, partial]))
    assert sorted(r.getMessage().split(" ranked")[0][-1] for r in caplog.records[3:]) == ["B", "C", "D"]


def test_staleness_is_judged_against_the_freshest_poll(monkeypatch):
    """Serve's controller polls every replica in one loop: when a loaded head falls behind, all polls
    age together and still rank by KV; a replica whose poll lags the others' (it stopped answering) is
    stale. A poll stamped ahead of the router's clock counts as now."""
    monkeypatch.setattr("vtoken.serve.control.router.time.time", lambda: NOW)
    assert stats_as_of([stats(held=0, polled=NOW - 8), stats(held=0, polled=NOW - 9), None, {}], NOW) == NOW - 8
    assert stats_as_of([None, {}], NOW) == NOW and stats_as_of([stats(held=0, polled=NOW + 5)], NOW) == NOW
    lagging = [
        FakeReplica(replica_id="A", routing_stats=stats(held=50, running=1, polled=NOW - 8)),
        FakeReplica(replica_id="B", routing_stats=stats(held=2, running=1, polled=NOW - 9)),
    ]
    router = make_router({"A": 1, "B": 1})
    for _ in range(5):
        ranks = asyncio.run(router.choose_replicas(lagging))
        assert [[r.replica_id for r in rank] for rank in ranks] == [["B"], ["A"]]
    assert (router.kv_routed, router.fallbacks) == (5, 0)
    # one stopped answering 8 s before the other's last poll: stale; the other still ranks by KV
    behind = FakeReplica(replica_id="C", routing_stats=stats(held=0, polled=NOW - 16))
    ranks = asyncio.run(router.choose_replicas([lagging[0], behind]))
    assert [[r.replica_id for r in rank] for rank in ranks] == [["A"], ["C"]]


def test_concurrent_choices_are_spread_by_reservations(monkeypatch):
    """Serve runs several routing tasks before any request is sent: the numbers they read are the
    same, so without reservations a burst lands on one replica."""
    monkeypatch.setattr("vtoken.serve.control.router.time.time", lambda: NOW)
    a = FakeReplica(replica_id="A", routing_stats=stats(held=0))
    b = FakeReplica(replica_id="B", routing_stats=stats(held=0))
    router = make_router({})
    firsts = []
    for i in range(10):
        pending = SimpleNamespace(metadata=SimpleNamespace(internal_request_id=f"r{i}"))
        firsts.append(asyncio.run(router.choose_replicas([a, b], pending))[0][0].replica_id)
    assert sorted(Counter(firsts).values()) == [5, 5]
    # routed requests release their reservation (Serve's queue-length cache counts them from then on)
    for i in range(10):
        router.on_request_routed(SimpleNamespace(metadata=SimpleNamespace(internal_request_id=f"r{i}")), None, None)
    assert not router._reservations
    # a reservation made at NOW lasts reservation_ttl_s (5 s): still counted at NOW + 5, dropped after
    pending = SimpleNamespace(metadata=SimpleNamespace(internal_request_id="late"))
    late = asyncio.run(router.choose_replicas([a, b], pending))[0][0].replica_id
    assert router.params.reservation_ttl_s == 5.0
    assert router._reserved_counts(NOW + 4.0) == Counter({late: 1})
    assert router._reserved_counts(NOW + 5.0) == Counter({late: 1})
    assert router._reserved_counts(NOW + 5.001) == Counter()
    assert not router._reservations  # dropped, not only left out of the count


# ---------------------------------------------------------------- autoscaling policy
S = ScalingParams(
    upscale_kv_utilization=0.75,
    downscale_kv_utilization=0.25,
    target_kv_utilization=0.5,
    upscale_waiting_per_replica=2.0,
)


@pytest.mark.parametrize(
    "current, kv, waiting, expect, reason",
    [
        (1, {"a": 0.9}, {"a": 0}, 2, "up"),  # KV pressure
        (1, {"a": 0.3}, {"a": 3}, 2, "up"),  # queue pressure
        (2, {"a": 0.95, "b": 0.95}, {}, 4, "up"),  # ceil(2 * 0.95 / 0.5) = 4, clamped below
        (2, {"a": 0.5, "b": 0.6}, {}, 2, "hold"),  # inside the hysteresis band
        (2, {"a": 0.1, "b": 0.0}, {}, 1, "down"),
        (2, {"a": 0.1, "b": 0.0}, {"a": 1}, 2, "hold"),  # waiting requests block a scale-down
        (3, {}, {}, 3, "no-metrics"),
    ],
)
def test_decide(current, kv, waiting, expect, reason):
    d = decide(current, kv, waiting, S, lo=1, hi=4)
    assert (d.desired, d.reason) == (expect, reason)


def test_decide_clamps_to_min_and_max():
    assert decide(2, {"a": 1.0, "b": 1.0}, {}, S, lo=1, hi=2).desired == 2
    assert decide(3, {"a": 0.0}, {}, S, lo=2, hi=4).desired == 2
    assert decide(1, {"a": 0.0}, {}, S, lo=1, hi=4).desired == 1


@pytest.mark.parametrize(
    "kv, waiting, expect, reason",
    [
        ({"a": 0.5}, {}, 2, "hold"),  # the lost replica is replaced, not forgotten (was: 1)
        ({"a": 0.9}, {}, 2, "up"),  # the replacement already counts as the extra replica (not 3)
        ({"a": 0.9, "b": None}, {"a": 5}, 2, "up"),
        ({"a": 0.0}, {}, 1, "down"),  # an idle survivor: no need to replace
    ],
)
def test_decide_keeps_serves_target_when_a_replica_is_lost_or_starting(kv, waiting, expect, reason):
    """1 replica running of Serve's target 2 (its node died, or the second one is still starting)."""
    d = decide(1, kv, waiting, S, lo=1, hi=4, target=2)
    assert (d.desired, d.reason) == (expect, reason)


def test_hysteresis_band_prevents_flapping():
    """Utilization oscillating inside (downscale, upscale) never changes the replica count."""
    for kv in (0.3, 0.5, 0.7, 0.26, 0.74):
        assert decide(2, {"a": kv, "b": kv}, {}, S, 1, 4).reason == "hold"


def test_params_are_validated():
    with pytest.raises(ValueError, match=r"downscale_kv_utilization 0.5 must be below upscale_kv_utilization 0.3"):
        ScalingParams(upscale_kv_utilization=0.3, downscale_kv_utilization=0.5)
    with pytest.raises(ValueError, match="tie_tokens must be >= 0, got -1"):
        RouterParams(tie_tokens=-1)


def test_policy_callable_reads_serve_context_and_ignores_departed_replicas():
    policy = KVAutoscalingPolicy(upscale_kv_utilization=0.75, downscale_kv_utilization=0.25)
    ctx = SimpleNamespace(
        aggregated_metrics={
            "vtoken:kv_utilization": {"r1": 0.9, "gone": 0.0},
            "vllm:num_requests_waiting": {"r1": 0.0},
        },
        running_replicas=["r1"],
        current_num_replicas=1,
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=2,
    )
    desired, state = policy(ctx)
    assert desired == 2 and state["vtoken"]["reason"] == "up" and state["vtoken"]["mean_kv"] == 0.9
    # Serve's context counts running replicas in current_num_replicas and the goal in target_num_replicas
    ctx.aggregated_metrics["vtoken:kv_utilization"]["r1"] = 0.5
    assert policy(ctx)[0] == 1
    ctx.target_num_replicas = 2  # the second replica's node died: hold the target, Serve replaces it
    assert policy(ctx) == (2, {"vtoken": {"reason": "hold", "mean_kv": 0.5, "waiting": 0.0, "trimmed": None}})


def test_autoscaling_keys_are_numeric_routing_stats():
    from vtoken.serve.telemetry.stat_logger import AUTOSCALING_KEYS, KV_UTILIZATION, NUM_WAITING

    snap = stats(held=10, waiting=3)
    assert {KV_UTILIZATION, NUM_WAITING} <= set(AUTOSCALING_KEYS) <= set(snap)
    assert all(isinstance(snap[k], float) for k in AUTOSCALING_KEYS)
