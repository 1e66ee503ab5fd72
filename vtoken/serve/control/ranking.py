"""The KV-aware router's ranking, without Ray (pure functions and their parameters).

``vtoken.serve.control.router.KVAwareRouter`` (which runs inside Serve's handles and proxy) calls these;
the serving config validates ``RouterParams`` at build time. See ``vtoken.serve.control.router`` for the
formula.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from vtoken.serve.telemetry.stat_logger import (
    BLOCK_SIZE,
    FRAGMENTATION,
    FREE_KV_TOKENS,
    HELD_BLOCKS,
    NUM_RUNNING,
    NUM_WAITING,
    POLLED_AT,
)


@dataclass(frozen=True)
class RouterParams:
    """The KV-aware router's hyperparameters: their one declaration (``router.*`` in the serving config,
    ``request_router_kwargs`` for Serve, ``KVAwareRouter.initialize_state``). Validated on construction.

    - ``stale_after_s``: stats polled more than this before the freshest candidate's poll (the replica
      stopped answering ``record_routing_stats`` while the others did; ``stats_as_of``) are ignored; set
      it to a few ``stats_period_s``. Stats that all aged together are used: Serve's controller polls
      every replica in one loop, and on a loaded head it falls behind for all of them (seen: 7–9 s with
      0.5 s polls at load average 20) — their numbers still compare, and ignoring them all would hand
      routing to power of two exactly under load. The age of the engine step behind the numbers is
      *not* a reason to ignore them either: a replica inside a long prefill step
      still holds (at least) the KV it reported, and requests sent to it since are charged through
      Serve's live queue-length cache. Dropping such a replica to the last rank herds a burst onto the
      other replicas (measured: 22/2 split of 24 requests).
    - ``fragmentation_weight``: KV tokens charged per slot wasted inside held blocks
      (``fragmentation_ratio · held_blocks · B``); 0 ignores fragmentation.
    - ``tokens_per_queued_request``: KV tokens charged per request queued at a replica but not yet
      running in its engine (roughly prompt + expected output of a typical request), and per reservation.
    - ``tie_tokens``: replicas within this many effective free tokens of a rank's best share the rank;
      Serve then picks the shortest queue among them. 0 = strict KV order.
    - ``reservation_ttl_s``: a reservation (request ranked first on a replica, not yet routed) is dropped
      after this long if Serve never reports the request as routed.
    """

    __pydantic_config__ = {"extra": "forbid"}  # read by pydantic only (the serving config's edge)

    stale_after_s: float = 5.0
    fragmentation_weight: float = 0.5
    tokens_per_queued_request: int = 256
    tie_tokens: int = 64
    reservation_ttl_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("stale_after_s", "reservation_ttl_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("fragmentation_weight", "tokens_per_queued_request", "tie_tokens"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")

    def kwargs(self) -> dict[str, Any]:
        """``{field: value}``: Serve's ``request_router_kwargs`` (``initialize_state`` rebuilds this)."""
        return {f.name: getattr(self, f.name) for f in fields(RouterParams)}


def stats_as_of(stats: Iterable[Mapping[str, Any] | None], now: float) -> float:
    """The instant staleness is judged at (pure): the newest ``polled_at`` among ``stats`` (``None`` and
    dicts without one are skipped), at most ``now``; ``now`` when none has one. With it a replica is stale
    when its poll lags the others', not when every poll lags (see ``RouterParams.stale_after_s``)."""
    polls = []
    for one in stats:
        try:
            polls.append(float(one[POLLED_AT]))  # type: ignore[index]
        except (KeyError, TypeError, ValueError):
            continue
    return min(now, max(polls)) if polls else now


def effective_free_tokens(
    stats: Mapping[str, Any], queue_len: int | None, params: RouterParams, as_of: float, reserved: int = 0
) -> float | None:
    """The ranking score of one replica, or None if its stats are missing or stale (pure).

    ``as_of``: the instant staleness is judged at (``stats_as_of`` over the candidates; the wall clock
    for a lone replica). ``reserved``: requests this router has just ranked first on the replica but not
    sent yet."""
    try:
        polled_at = float(stats[POLLED_AT])
        free = float(stats[FREE_KV_TOKENS])
        frag = float(stats[FRAGMENTATION])
        held_slots = float(stats[HELD_BLOCKS]) * float(stats[BLOCK_SIZE])
        waiting = float(stats[NUM_WAITING])
        running = float(stats[NUM_RUNNING])
    except (KeyError, TypeError, ValueError):
        return None
    if as_of - polled_at > params.stale_after_s:
        return None
    pending = max(waiting, float(queue_len or 0) - running) + reserved
    wasted = min(1.0, max(0.0, frag)) * held_slots
    return free - params.fragmentation_weight * wasted - pending * params.tokens_per_queued_request


def rank_by_kv(
    scores: Sequence[tuple[Any, float | None]], tie_tokens: float, rng: random.Random | None = None
) -> list[list[Any]] | None:
    """Group ``(replica, score)`` pairs into ranks, best first (pure apart from ``rng``).

    Scored replicas are sorted by score (equal scores in random order: Serve breaks queue-length ties
    by list order, so a fixed order would pin idle traffic on one replica); a new rank starts when a
    score falls more than ``tie_tokens`` below the current rank's best. Unscored (None) replicas form
    the last rank. Returns None when no replica has a score (caller falls back to power of two).
    """
    rng = rng or random
    keyed = [(s, rng.random(), r) for r, s in scores if s is not None]
    scored = sorted(keyed, key=lambda t: (-t[0], t[1]))
    if not scored:
        return None
    ranks: list[list[Any]] = []
    best = None
    for score, _, replica in scored:
        if best is None or best - score > tie_tokens:
            ranks.append([])
            best = score
        ranks[-1].append(replica)
    unscored = [r for r, s in scores if s is None]
    if unscored:
        ranks.append(unscored)
    return ranks
