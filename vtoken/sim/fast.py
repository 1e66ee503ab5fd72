"""The batched simulator: the same semantics as ``vtoken.sim.exact``, vectorised over requests.

All requests of a chunk share prompt and generation lengths, so every row has the same live count at
every step (same budget, same protected set) and per-row state stays rectangular:

::

    per request r (row), C = live-token columns in ascending logical order (dead ones masked, compacted
    from time to time)          logical[r, c]  alive[r, c]  acc[r, c]  last[r, c]  bits[r, c]
    per layout (repack, reuse+repack), indexed by logical / by slot:  slot_of[r, t]  token_at[r, s]
    naive accounting, per original block:                              orig_live[r, b]

Victims come from the policy's ``select_batch`` (same order as ``select``: score, then position);
moves follow the planner's rule (holes ascending ← tail tokens descending). ``tests/cpu/test_sim.py``
checks block series and move counts against the exact engine.
"""

from __future__ import annotations

import math

import numpy as np

from vtoken.core.config import VTokenConfig
from vtoken.core.eviction import eviction_count
from vtoken.core.manager import request_salt
from vtoken.policies.base import EvictionContext
from vtoken.sim import jit
from vtoken.sim.exact import request_name
from vtoken.sim.result import SimTally

HOLE = -1  # token_at value of a free slot / slot_of value of a dead token


class _Layout:
    """Physical slots of one moving mode for a chunk (mutated in place)."""

    def __init__(self, R: int, T: int, P: int, reuse: bool):
        self.reuse = reuse
        self.slot_of = np.full((R, T), HOLE, np.int32)
        self.token_at = np.full((R, T), HOLE, np.int32)
        self.slot_of[:, :P] = np.arange(P)
        self.token_at[:, :P] = np.arange(P)
        self.moves = 0
        self.lower_bound = 0

    def step(self, victims: np.ndarray, live: int, n: int) -> None:
        """Evict ``victims`` [R, k] (logical), place token ``n``, repack. ``live``: count after eviction."""
        moved, bound = jit.layout_step(self.slot_of, self.token_at, np.ascontiguousarray(victims), live, n,
                                       self.reuse, HOLE)
        self.moves += moved
        self.lower_bound += bound


class _Columns:
    """Per-request token columns in ascending logical order (mutated in place).

    The first ``sinks`` columns and the last ``recent`` are always alive (protected), so the evictable
    candidates of every row are the alive columns of one contiguous slice. Starts as the prompt's
    columns; dead columns are dropped by ``compact`` (which also reserves room for the remaining steps).
    """

    NAMES = ("logical", "alive", "acc", "last", "bits", "knorm", "w")

    def __init__(self, P: int, source, prefill, need: frozenset[str]):
        R = source.num_requests
        total, last, bits = prefill
        self.has_knorm = "key_norm" in need
        self.width = P
        self.logical = np.broadcast_to(np.arange(P, dtype=np.int64), (R, P)).copy()
        self.alive = np.ones((R, P), bool)
        self.acc, self.last, self.bits = total, last, bits
        self.knorm = source.key_norm[:, :P].copy() if self.has_knorm else np.zeros((R, P))
        self.w = source.w[:, :P].copy() if hasattr(source, "w") else np.zeros((R, P))

    def view(self, name: str, lo: int = 0, hi: int | None = None) -> np.ndarray:
        return getattr(self, name)[:, lo : self.width if hi is None else hi]

    def append(self, n: int, source) -> None:
        c = self.width
        if c == self.logical.shape[1]:
            self._resize(np.ones(self.alive[0].shape, bool)[None, :].repeat(self.alive.shape[0], 0), c, 64)
        self.logical[:, c] = n
        self.alive[:, c] = True
        self.acc[:, c] = 0.0
        self.last[:, c] = 0.0
        self.bits[:, c] = 0
        if self.has_knorm:
            self.knorm[:, c] = source.key_norm[:, n]
        if hasattr(source, "w"):
            self.w[:, c] = source.w[:, n]
        self.width += 1

    def compact(self, room: int) -> None:
        """Drop dead columns (every row has the same number alive); keep ``room`` free columns."""
        keep = self.view("alive").copy()
        self._resize(keep, int(keep[0].sum()), room)

    def _resize(self, keep: np.ndarray, n_keep: int, room: int) -> None:
        R = keep.shape[0]
        for name in self.NAMES:
            old = self.view(name)
            new = np.zeros((R, n_keep + room), old.dtype)
            new[:, :n_keep] = old[keep].reshape(R, n_keep)
            setattr(self, name, new)
        self.width = n_keep

    def observe(self, source, n: int, needs: frozenset[str]) -> None:
        """Fold query ``n``'s attention over every column into the statistics ``needs`` names."""
        need_acc, need_last, need_bits = ("accumulated" in needs, "last" in needs, "unimportant" in needs)
        if hasattr(source, "w"):  # synthetic: one fused pass (bit-identical to SyntheticSource._attn)
            jit.synthetic_step(self.w, np.ascontiguousarray(source.Z[:, n]), self.logical, self.width, n,
                               source.decay, source.band, 1.0 - source.cfg.recency_weight,
                               max(0, self.width - source.band), self.acc, self.last, self.bits,
                               need_acc, need_last, need_bits, 1.0 / (n + 1))
            return
        a = source.attention(n, self.view("logical"))
        if need_acc:
            self.view("acc")[:] += a
        if need_last:
            self.view("last")[:] = a
        if need_bits:
            bits = self.view("bits")
            bits[:] = (bits << np.uint64(1)) | (a < 1.0 / (n + 1)).astype(np.uint64)


def _select(policy, ctx: EvictionContext, k: int, candidate: np.ndarray) -> np.ndarray:
    """Victim mask: a fused argmin loop for the usual handful per step, the policy's batched partition
    otherwise (both: lowest score first, then the oldest)."""
    if k > 4:
        return policy.select_batch(ctx, np.full(candidate.shape[0], k), candidate)
    scores = np.asarray(policy.score(ctx), dtype=np.float64)
    if scores.shape != candidate.shape:
        scores = np.ascontiguousarray(np.broadcast_to(scores, candidate.shape))
    victims = np.zeros(candidate.shape, bool)
    if not jit.lowest_k(scores, candidate, k, victims):
        raise ValueError(f"policy {policy.name!r} returned non-finite scores")
    return victims


def simulate_fast(cfg: VTokenConfig, source, prompt_len: int, gen_len: int, first_request: int = 0,
                  tally: SimTally | None = None) -> SimTally:
    """Simulate one chunk (all of ``source``'s requests); adds to ``tally`` if given."""
    R = source.num_requests
    P, M, B = prompt_len, gen_len, cfg.block_size
    T = P + M
    policy = cfg.make_policy()
    needs = policy.needs
    tally = tally if tally is not None else SimTally(M)
    salt = np.array([request_salt(request_name(first_request + r)) for r in range(R)], np.uint64)[:, None]
    cols = _Columns(P, source, source.prefill(P, "unimportant" in needs), needs)
    live = P
    layouts = {"repack": _Layout(R, T, P, reuse=False), "reuse+repack": _Layout(R, T, P, reuse=True)}
    nb = math.ceil(T / B)
    orig_live = np.zeros((R, nb), np.int64)
    orig_live[:, : math.ceil(P / B)] = np.bincount(np.arange(P) // B, minlength=math.ceil(P / B))
    peaks = {m: np.zeros(R, np.int64) for m in ("none", "naive", "repack", "reuse+repack")}
    rows = np.arange(R)[:, None]
    scored = bool(needs & {"accumulated", "last", "unimportant"})

    for d in range(M):
        n = P + d
        k = eviction_count(live, n, cfg)
        lo, hi = min(cfg.sinks, cols.width), max(cols.width - min(cfg.recent, n), 0)
        if k and hi > lo:
            ctx = EvictionContext(logical=cols.view("logical", lo, hi), accumulated=cols.view("acc", lo, hi),
                                  last=cols.view("last", lo, hi), unimportant_bits=cols.view("bits", lo, hi),
                                  key_norm=cols.view("knorm", lo, hi), seen=n, salt=salt)
            vmask = _select(policy, ctx, k, cols.view("alive", lo, hi))
            k = int(vmask[0].sum())
            victims = ctx.logical[vmask].reshape(R, k)
            cols.view("alive", lo, hi)[vmask] = False
            live -= k
            np.subtract.at(orig_live, (rows, victims // B), 1)
        else:
            victims = np.zeros((R, 0), np.int64)
        for lay in layouts.values():
            lay.step(victims, live, n)
        live += 1
        orig_live[:, n // B] += 1
        if cols.width - live > max(64, cols.width // 4):
            cols.compact(room=M - d)
        cols.append(n, source)
        if scored:
            cols.observe(source, n, needs)
        packing = math.ceil(live / B)
        naive = np.maximum(packing, np.count_nonzero(orig_live, axis=1))
        retained = {"none": np.full(R, math.ceil((n + 1) / B)), "naive": naive,
                    "repack": np.full(R, packing), "reuse+repack": np.full(R, packing)}
        for m, v in retained.items():
            np.maximum(peaks[m], v, out=peaks[m])
        tally.add_step(d, np.full(R, live), np.full(R, packing), retained)
    tally.add_chunk(R, peaks, {m: (lay.moves, lay.lower_bound) for m, lay in layouts.items()})
    return tally
