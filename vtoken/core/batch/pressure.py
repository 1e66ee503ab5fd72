"""Eviction under pressure (``trigger: pressure``): which tokens a running batch gives up when the KV pool
cannot hold its next step. Pure (numpy only, no vLLM): the vLLM scheduler (vtoken/vllm/scheduling/pressure.py) builds
one ``Candidate`` per running request (``candidate``), calls ``plan_pressure`` and applies each request's
victims with ``decide_step(..., victims=...)``.

The rule, with ``B`` tokens per block, request ``r`` holding ``held_r`` blocks and ``live_r`` live tokens,
computing ``n_r`` tokens in the coming step and giving up ``k_r`` of them::

    need(k)  = fixed + Σ_r (after_r[k_r] − held_r)                  blocks the step takes from the pool
    trigger  : need(0) > free        the step does not fit: vLLM would preempt (or the queue's head waits)
    target   : free − need(k) ≥ margin                       margin: the caller's (one block per request)

Nothing happens while the trigger is false. When it fires, tokens go in one order across the whole batch
(``batch_keys``, lowest first; ties by request, then by the request's own order), each request only down to
its floor (its ``budget``: a candidate's ``order`` holds only tokens above it), until the target holds.
Two thresholds are the hysteresis: a round leaves ``margin`` spare blocks, so the next round comes only once
the batch has grown by that much again, never on consecutive steps for the same shortfall. Tokens that
would free no block are kept: each ``k_r`` is cut back to the fewest tokens that free the same blocks (the
highest-ranked of its victims stay). If every candidate is at its floor and the step still does not fit,
``slack`` < 0: the caller lets vLLM preempt, as it would without vToken.

The queue's head (``admit``: blocks its first chunk needs) counts in the need only when evicting every
candidate down to its floor could make room for it; otherwise evicting for it would buy nothing and it
waits, as in vLLM. ``after_r[k]``, the blocks a row holds after its step, is the mode's own count:
``⌈(live − k + n)/B⌉`` when repacking, the naive rule for ``mode: naive`` (an original block returns only
once all its tokens are dead, so the same victims free fewer blocks and naive needs more of them).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from vtoken.core.config import Mode


def blocks_for(tokens: int, block_size: int) -> int:
    """``⌈tokens / block_size⌉`` (0 for no tokens). Pure."""
    return -(-max(tokens, 0) // block_size)


def _empty_i() -> np.ndarray:
    return np.zeros(0, np.int64)


def _empty_f() -> np.ndarray:
    return np.zeros(0, np.float64)


@dataclass(frozen=True)
class Candidate:
    """One running request as pressure sees it: it holds ``held`` blocks and ``live`` live tokens and
    computes ``n_new`` in the coming step. ``order``: the logical positions it may give up (evictable and
    above its floor), first to go first; ``keys``: their batch-wide keys, non-decreasing along ``order``;
    ``after[k]`` (``k`` = 0 … ``order.size``, non-increasing): the blocks its row holds after the step when it
    gives up the first ``k``, by its mode's rule."""

    key: str
    live: int
    held: int
    n_new: int
    after: np.ndarray
    order: np.ndarray = field(default_factory=_empty_i)
    keys: np.ndarray = field(default_factory=_empty_f)

    @classmethod
    def repack(
        cls,
        key: str,
        live: int,
        held: int,
        n_new: int,
        need0: int,
        order: np.ndarray | None = None,
        keys: np.ndarray | None = None,
        *,
        block_size: int,
    ) -> Candidate:
        """A dense repacking row: ``after[0] = held + need0`` (the mode's count without eviction, e.g. a
        reused hole), ``after[k] = ⌈(live − k + n_new)/B⌉``. Pure."""
        order = _empty_i() if order is None else np.asarray(order, np.int64)
        keys = _empty_f() if keys is None else np.asarray(keys, np.float64)
        k = np.arange(1, order.size + 1, dtype=np.int64)
        after = np.concatenate([[held + need0], -(-np.maximum(live - k + n_new, 0) // block_size)])
        return cls(key, live, held, n_new, after.astype(np.int64), order, keys)

    def need(self, k: int) -> int:
        """Blocks this request takes from the pool in the coming step after giving up ``k`` tokens (may be
        negative: blocks it returns). Pure."""
        return int(self.after[k]) - self.held

    def useful(self, k: int) -> int:
        """The fewest of the first ``k`` tokens of ``order`` that free as many blocks as all ``k``. Pure."""
        while k > 0 and self.after[k - 1] == self.after[k]:
            k -= 1
        return k


@dataclass(frozen=True)
class PressureDecision:
    """``victims[key]``: ascending logical positions each request gives up (only requests that give some);
    ``deficit``: ``need(0) − free`` before (> 0: the trigger fired); ``slack``: ``free − need(k)`` after
    (< 0: every candidate is at its floor and vLLM will preempt); ``admitted``: the queue's head counted."""

    victims: dict[str, np.ndarray]
    deficit: int
    slack: int
    admitted: bool

    @property
    def evicted(self) -> int:
        return int(sum(v.size for v in self.victims.values()))

    @property
    def fired(self) -> bool:
        return self.deficit > 0


def batch_keys(ranked: np.ndarray, total_mass: float | None) -> np.ndarray:
    """Batch-wide keys of one request's candidates, ``ranked`` being their policy scores in the request's own
    eviction order (ascending). A policy whose scores are attention mass compares across requests by the
    share of the request's live mass a token holds (``total_mass``: the sum over its live tokens); any other
    policy's scores mean nothing across requests, so its tokens go by their rank in the request's order,
    scaled to (0, 1): every such request gives up the same share of its candidates first. Non-decreasing.
    Pure."""
    n = ranked.size
    if n == 0:
        return _empty_f()
    if total_mass is not None and total_mass > 0:
        return np.maximum.accumulate(np.asarray(ranked, np.float64) / total_mass)
    return np.arange(1, n + 1, dtype=np.float64) / (n + 1)


def plan_pressure(cands: list[Candidate], free: int, fixed: int, margin: int, admit: int = 0) -> PressureDecision:
    """The batch's victims under the rule of the module docstring (pure). ``fixed``: blocks the step takes
    for requests that are not candidates; ``admit``: blocks the queue's head needs to be admitted (0: none
    waits). Block counts come from each candidate's ``after``."""
    need0 = fixed + sum(c.need(0) for c in cands)
    floor_need = fixed + sum(c.need(c.order.size) for c in cands)
    admitted = admit > 0 and free - floor_need - admit >= 0
    if admitted:
        need0 += admit
    deficit = need0 - free
    if deficit <= 0:
        return PressureDecision({}, deficit, -deficit, admitted)
    idx = np.concatenate([np.full(c.order.size, i, np.int64) for i, c in enumerate(cands)] + [_empty_i()])
    pos = np.concatenate([np.arange(c.order.size, dtype=np.int64) for c in cands] + [_empty_i()])
    keys = np.concatenate([np.asarray(c.keys, np.float64) for c in cands] + [_empty_f()])
    k = [0] * len(cands)
    slack = -deficit
    for j in np.lexsort((pos, idx, keys)):
        if slack >= margin:
            break
        i = int(idx[j])
        before = cands[i].need(k[i])
        k[i] += 1
        slack += before - cands[i].need(k[i])
    victims = {}
    for c, ki in zip(cands, k):
        ki = c.useful(ki)
        if ki:
            victims[c.key] = np.sort(np.asarray(c.order[:ki], np.int64))
    return PressureDecision(victims, deficit, slack, admitted)


def candidate(key: str, table, policy, cfg, salt: int, held: int, n_new: int) -> Candidate:
    """Request ``key`` as a candidate (pure; ``table`` a ``TokenTable``, ``cfg`` its ``VTokenConfig`` with the
    protection in force): the tokens above its floor (``cfg.kept_live``, the ``budget``) that the policy may
    evict, in the order ``ScorerPolicy.select`` takes them (lowest ranked score first, ties to the older),
    so a request giving up ``k`` tokens gives up exactly what ``select`` with ``k`` would."""
    from vtoken.core.eviction import context_for

    B = table.block_size
    need0 = table.required_blocks_after_place(n_new) - held
    avail = table.live - cfg.kept_live(table.seen, table.prompt_len)
    if avail <= 0:
        return Candidate.repack(key, table.live, held, n_new, need0, block_size=B)
    logicals = table.live_logicals()
    evictable = table.evictable(logicals, cfg.sinks, cfg.recent, cfg.kept_prompt(table.prompt_len))
    if not evictable.any():
        return Candidate.repack(key, table.live, held, n_new, need0, block_size=B)
    ranked = policy.ranked(context_for(table, logicals, salt, policy))
    cand = np.flatnonzero(evictable)
    if not np.all(np.isfinite(ranked[cand])):
        raise ValueError(f"policy {policy.name!r} returned non-finite scores")
    chosen = cand[np.lexsort((logicals[cand], ranked[cand]))][:avail]
    mass = float(ranked.sum()) if policy.attention_mass else None
    c = Candidate.repack(
        key, table.live, held, n_new, need0, logicals[chosen], batch_keys(ranked[chosen], mass), block_size=B
    )
    if table.mode is Mode.NAIVE:
        c = replace(c, after=naive_after(table, c.order, n_new))
    return c


def naive_after(table, order: np.ndarray, n_new: int) -> np.ndarray:
    """``after[k]`` of a ``mode: naive`` row (pure): after giving up ``order[:k]`` and placing ``n_new``, it
    holds the dense count or, if more, its original blocks that keep a live token plus the blocks the new
    tokens open (``TokenTable.required_blocks_after_place``'s rule, applied to each prefix of ``order``)."""
    B, seen, live = table.block_size, table.seen, table.live
    counts = table.orig_live.copy()
    nonempty = table.naive_nonempty
    after = np.empty(order.size + 1, np.int64)
    after[0] = table.required_blocks_after_place(n_new)
    first, last = seen // B, (seen + max(n_new, 1) - 1) // B
    for j, pos in enumerate(order, start=1):
        b = int(pos) // B
        counts[b] -= 1
        nonempty -= int(counts[b] == 0)
        seg = counts[first : last + 1]
        if n_new:
            opened = int(np.count_nonzero(seg == 0)) + (last + 1 - first - seg.size)
        else:
            opened = int(seen % B != 0 and counts[first] == 0)
        after[j] = max(blocks_for(live - j + n_new, B), nonempty + opened)
    return after
