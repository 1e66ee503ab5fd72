"""The batched simulator: the same semantics as ``vtoken.sim.exact``, vectorised over requests.

All requests of a chunk share prompt and generation lengths, so every row has the same live count at
every step (same budget, same protected set) and per-row state stays rectangular:

::

    per request r (row), C = live-token columns in ascending logical order (dead ones masked, compacted
    from time to time)          logical[r, c]  alive[r, c]  acc[r, c]  last[r, c]  bits[r, c]
    per layout (repack, reuse+repack), indexed by logical / by slot:  slot_of[r, t]  token_at[r, s]
    naive accounting, per original block:                              orig_live[r, b]

Victims come from the policy's ``select_batch`` (same order as ``select``: score, then position);
moves follow the planner's rule (holes ascending ← tail tokens descending). ``tests/integration/test_sim.py``
checks block series and move counts against the exact engine. Block granularity (whole original blocks, a
ragged number per row) is the exact engine's only: ``simulate_fast`` refuses it.
"""

from __future__ import annotations

import math

import numpy as np

from vtoken.core.config import Granularity, VTokenConfig
from vtoken.core.eviction import eviction_count
from vtoken.core.manager import request_salt
from vtoken.errors import ConfigError
from vtoken.policies.context import STEP_ATTENTION_STATS, EvictionContext, Stat
from vtoken.sim.exact import request_name
from vtoken.sim.result import SimTally
from vtoken.sim.source import check_simulable

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
        R, k = victims.shape
        if k == 1:
            return self._step_one(victims[:, 0], live, n)
        rows = np.arange(R)[:, None]
        extent = live + k  # the row was dense before this step
        hole_slots = np.take_along_axis(self.slot_of, victims, axis=1)
        self.token_at[rows, hole_slots] = HOLE
        self.slot_of[rows, victims] = HOLE
        if self.reuse and k > 0:  # the decode token takes the lowest hole
            hole_slots = np.sort(hole_slots, axis=1)
            new_slot = hole_slots[:, 0]
            hole_slots = hole_slots[:, 1:]
        else:
            new_slot = np.full(R, extent if self.reuse else live, np.int64)
        L = live + 1 if self.reuse else live
        if self.reuse:
            self._place(new_slot, n)
        if extent > L:
            tail = self.token_at[:, L:extent]
            src = np.where(tail != HOLE, np.arange(L, extent), -1)
            src = -np.sort(-src, axis=1)  # occupied tail slots, descending; -1 padding last
            dst = np.sort(np.where(hole_slots < L, hole_slots, np.iinfo(np.int64).max), axis=1)
            width = min(src.shape[1], dst.shape[1])
            src, dst = src[:, :width], dst[:, :width]
            ok = src >= 0
            self.moves += int(ok.sum())
            self.lower_bound += int((tail != HOLE).sum())
            r_idx = np.broadcast_to(rows, src.shape)[ok]
            s_ok, d_ok = src[ok], dst[ok]
            tok = self.token_at[r_idx, s_ok]
            self.token_at[r_idx, s_ok] = HOLE
            self.token_at[r_idx, d_ok] = tok
            self.slot_of[r_idx, tok] = d_ok
        if not self.reuse:
            self._place(new_slot, n)

    def _step_one(self, victim: np.ndarray, live: int, n: int) -> None:
        """The steady decode case, one victim per row: the same rule without sorting.

        reuse+repack: the decode token takes the hole, nothing moves. repack: the token at the last
        slot (``live``) moves into the hole unless it was the victim; the decode token goes to ``live``.
        """
        rows = np.arange(victim.shape[0])
        hole = self.slot_of[rows, victim].astype(np.int64)
        self.token_at[rows, hole] = HOLE
        self.slot_of[rows, victim] = HOLE
        if self.reuse:
            self._place(hole, n)
            return
        move = hole != live
        tok = self.token_at[rows[move], live]
        self.moves += int(move.sum())
        self.lower_bound += int(np.count_nonzero(self.token_at[:, live] != HOLE))
        self.token_at[rows[move], live] = HOLE
        self.token_at[rows[move], hole[move]] = tok
        self.slot_of[rows[move], tok] = hole[move]
        self._place(np.full(rows.size, live, np.int64), n)

    def _place(self, slot: np.ndarray, n: int) -> None:
        R = slot.shape[0]
        self.slot_of[:, n] = slot
        self.token_at[np.arange(R), slot] = n


class _Columns:
    """Per-request token columns in ascending logical order (mutated in place).

    The first ``sinks`` columns and the last ``recent`` are always alive (protected), so the evictable
    candidates of every row are the alive columns of one contiguous slice. Starts as the prompt's
    columns; dead columns are dropped by ``compact`` (which also reserves room for the remaining steps).
    """

    NAMES = ("logical", "alive", *(s.value for s in Stat), "w")  # the statistics' columns are named by Stat

    def __init__(self, P: int, source, prefill, need: frozenset[Stat]):
        R = source.num_requests
        self.has_knorm = Stat.KEY_NORM in need
        self.width = P
        self.logical = np.broadcast_to(np.arange(P, dtype=np.int64), (R, P)).copy()
        self.alive = np.ones((R, P), bool)
        self.accumulated, self.last, self.unimportant, self.window = prefill
        self.key_norm = source.key_norm[:, :P].copy() if self.has_knorm else np.zeros((R, P))
        self.redundancy = np.zeros((R, P))  # never read: no source has keys (check_simulable)
        self.w = source.w[:, :P].copy() if hasattr(source, "w") else np.zeros((R, P))

    def view(self, name: str, lo: int = 0, hi: int | None = None) -> np.ndarray:
        return getattr(self, name)[:, lo : self.width if hi is None else hi]

    def append(self, n: int, source) -> None:
        c = self.width
        if c == self.logical.shape[1]:
            self._resize(np.ones(self.alive[0].shape, bool)[None, :].repeat(self.alive.shape[0], 0), c, 64)
        self.logical[:, c] = n
        self.alive[:, c] = True
        self.accumulated[:, c] = 0.0
        self.last[:, c] = 0.0
        self.unimportant[:, c] = 0
        self.window[:, c] = 0.0  # the observation window never sees a generated token
        if self.has_knorm:
            self.key_norm[:, c] = source.key_norm[:, n]
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

    def attention(self, source, n: int) -> np.ndarray:
        keys = self.view("logical")
        if hasattr(source, "w"):
            band_start = max(0, self.width - source.band)
            return source._attn(self.view("w"), source.Z[:, n : n + 1], n, keys, band_start)
        return source.attention(n, keys)


def simulate_fast(
    cfg: VTokenConfig, source, prompt_len: int, gen_len: int, first_request: int = 0, tally: SimTally | None = None
) -> SimTally:
    """Simulate one chunk (all of ``source``'s requests); adds to ``tally`` if given. Raises ``ConfigError``
    for ``granularity=block`` (the exact engine runs it)."""
    if cfg.granularity is Granularity.BLOCK:
        raise ConfigError("granularity 'block' runs on the exact engine only: pass --engine exact")
    if cfg.keep_mass is not None:  # one live count for every request is what makes this engine fast
        raise ConfigError("keep_mass runs on the exact engine only: pass --engine exact")
    check_simulable(cfg)
    R = source.num_requests
    P, M, B = prompt_len, gen_len, cfg.block_size
    T = P + M
    policy = cfg.make_policy()
    needs = policy.needs
    tally = tally if tally is not None else SimTally(M)
    salt = np.array([request_salt(request_name(first_request + r)) for r in range(R)], np.uint64)[:, None]
    cols = _Columns(P, source, source.prefill(P, Stat.UNIMPORTANT in needs, Stat.WINDOW in cfg.measured_stats()), needs)
    if cfg.question_aware:  # the prompt scored by its observation window (PromptScores.WINDOW)
        cols.accumulated[:] = cols.window
    live = P
    layouts = {"repack": _Layout(R, T, P, reuse=False), "reuse+repack": _Layout(R, T, P, reuse=True)}
    nb = math.ceil(T / B)
    orig_live = np.zeros((R, nb), np.int64)
    orig_live[:, : math.ceil(P / B)] = np.bincount(np.arange(P) // B, minlength=math.ceil(P / B))
    peaks = {m: np.zeros(R, np.int64) for m in ("none", "naive", "repack", "reuse+repack")}
    rows = np.arange(R)[:, None]
    scored = bool(needs & STEP_ATTENTION_STATS)
    # SnapKV pools a token's score over its live neighbours: it must see exactly the live tokens, as the exact
    # engine's table gives them (the other policies score each token alone: dead columns are harmless)
    pools = Stat.WINDOW in needs
    kept_lo, kept_hi = cfg.kept_prompt(P)

    for d in range(M):
        n = P + d
        k = eviction_count(live, n, P, cfg)
        if k and pools and cols.width > live:
            cols.compact(room=M - d)
        lo, hi = min(cfg.sinks, cols.width), max(cols.width - min(cfg.recent, n), 0)
        if k and hi > lo:  # every live token in the context; candidates: the alive columns lo..hi-1
            stats = {s.value: cols.view(s.value) for s in needs}
            ctx = EvictionContext(logical=cols.view("logical"), seen=n, salt=salt, **stats)
            evictable = cols.view("alive").copy()
            evictable[:, :lo] = evictable[:, hi:] = False
            if kept_hi > kept_lo:  # the protected prompt (prompt_tail, scope generated)
                evictable &= (ctx.logical < kept_lo) | (ctx.logical >= kept_hi)
            vmask = policy.select_batch(ctx, np.full(R, k), evictable)
            k = int(vmask[0].sum())
            victims = ctx.logical[vmask].reshape(R, k)
            cols.view("alive")[vmask] = False
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
            a = cols.attention(source, n)
            if Stat.ACCUMULATED in needs:
                cols.view("accumulated")[:] += a
            if Stat.LAST in needs:
                cols.view("last")[:] = a
            if Stat.UNIMPORTANT in needs:
                bits = cols.view("unimportant")
                bits[:] = (bits << np.uint64(1)) | (a < 1.0 / (n + 1)).astype(np.uint64)
        packing = math.ceil(live / B)
        naive = np.maximum(packing, np.count_nonzero(orig_live, axis=1))
        retained = {
            "none": np.full(R, math.ceil((n + 1) / B)),
            "naive": naive,
            "repack": np.full(R, packing),
            "reuse+repack": np.full(R, packing),
        }
        for m, v in retained.items():
            np.maximum(peaks[m], v, out=peaks[m])
        tally.add_step(d, np.full(R, live), np.full(R, packing), retained)
    tally.add_chunk(R, peaks, {m: (lay.moves, lay.lower_bound) for m, lay in layouts.items()})
    return tally
