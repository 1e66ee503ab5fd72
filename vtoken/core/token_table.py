"""The per-request token table: live logical tokens → slots of the request's block-table row.

Slots here are *row-relative*: slot ``s`` lives in the row's block ``s // B`` at offset ``s % B``.
Physical addresses (block id × B + offset) are the caller's business (``CacheManager`` or the vLLM
scheduler hook), because the row's block ids belong to whoever owns the pool.

::

    B = 4, 12 tokens seen, t1 t2 t4 t5 t7 t10 evicted (docs/architecture.md §1)

    slot      0   1   2   3 |  4   5   6   7 |  8   9  10  11
    token    t0  __  __  t3 | __  __  t6  __ | t8  t9  __ t11     live = 6, extent = 12
                  ^   ^          ^   ^      ^           ^
                  holes below live (slots 1, 2, 4, 5): filled from the tail t8 t9 t11 ... -> 4 moves

    after the plan: t0 t11 t9 t3 | t8 t6 .. ..                  keep ceil(6/4) = 2 blocks, free 1

Invariants kept here (``check()``; ``vtoken.core.integrity`` adds the pool-wide ones):
  * every live token owns exactly one slot and every occupied slot belongs to one live token;
  * logical indices (RoPE positions) never change; the next token's position is ``seen``;
  * tokens in the shared prefix blocks sit at their original slot and are never evicted or moved;
  * the row holds at least ``required_blocks()`` blocks once a plan is applied.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from vtoken.core.config import Mode
from vtoken.errors import ConfigError, IntegrityError
from vtoken.policies.context import Stat

NO_SLOT = -1  # slot_of[logical] for a token that is dead (or not yet placed)
NO_TOKEN = -1  # token_at[slot] for a hole


@dataclass(frozen=True)
class SlotPlan:
    """Row-relative repack plan: copy slot ``src`` to slot ``dst``; keep the row's first ``keep_blocks``.

    Pure data. ``version`` ties it to the table state it was computed from; applying it to a table
    that changed since raises.
    """

    moves: np.ndarray  # int64 [k, 2] read-only: (src_slot, dst_slot)
    keep_blocks: int
    version: int
    lower_bound: int  # live tokens outside [0, live): each must move once for a dense row
    live: int  # live tokens when planned (after the plan they occupy slots 0..live-1)
    block_size: int

    @property
    def num_moves(self) -> int:
        return int(self.moves.shape[0])


def _grow(arr: np.ndarray, size: int, fill) -> np.ndarray:
    if size <= arr.shape[0]:
        return arr
    new = np.full(max(size, 2 * arr.shape[0], 64), fill, dtype=arr.dtype)
    new[: arr.shape[0]] = arr
    return new


@dataclass
class TokenTable:
    """Slots, logical positions and per-token policy state of one request. Mutated in place."""

    block_size: int
    mode: Mode = Mode.REPACK
    seen: int = 0  # tokens ever placed = next logical position
    live: int = 0
    extent: int = 0  # highest occupied slot + 1
    shared_blocks: int = 0  # leading row blocks shared through the prefix cache
    prompt_len: int = 0  # the request's prompt tokens (what VTokenConfig.kept_prompt protects; 0: unknown)
    version: int = 0  # bumped by every mutation that changes slots
    evicted_total: int = 0
    slot_of: np.ndarray = field(default_factory=lambda: np.full(0, NO_SLOT, np.int64))
    token_at: np.ndarray = field(default_factory=lambda: np.full(0, NO_TOKEN, np.int64))
    orig_live: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # per original block
    naive_nonempty: int = 0
    # Per-token statistics (one array per ``Stat``, named by it), indexed by logical position.
    accumulated: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    last: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    unimportant: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    key_norm: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    window: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    redundancy: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))

    # ---------------------------------------------------------------- queries (no side effects)
    def stat(self, stat: Stat) -> np.ndarray:
        """The array of statistic ``stat`` over logical positions (a view; writing it mutates the table)."""
        return getattr(self, stat.value)

    def live_logicals(self) -> np.ndarray:
        """Logical indices of live tokens, ascending."""
        return np.flatnonzero(self.slot_of[: self.seen] != NO_SLOT)

    def holes(self) -> np.ndarray:
        """Free slots below ``extent``, ascending."""
        return np.flatnonzero(self.token_at[: self.extent] == NO_TOKEN)

    def packing_bound(self) -> int:
        return math.ceil(self.live / self.block_size)

    def naive_blocks(self) -> int:
        """Blocks the paired naive baseline holds: original blocks with a live token, plus the
        partially filled last one (the next token is placed there)."""
        partial_tail = self.seen % self.block_size != 0 and self.orig_live[self.seen // self.block_size] == 0
        return self.naive_nonempty + int(partial_tail)

    def required_blocks(self) -> int:
        """Blocks the row must hold in the current state, by the mode's accounting."""
        physical = math.ceil(self.extent / self.block_size)
        if self.mode is Mode.NONE:
            return math.ceil(self.seen / self.block_size)
        if self.mode is Mode.NAIVE:
            return max(physical, self.naive_blocks())
        return physical

    def required_blocks_after_place(self, n: int) -> int:
        """``required_blocks()`` as it would be after ``place(n)`` (pure)."""
        B = self.block_size
        if self.mode is Mode.NONE:
            return math.ceil((self.seen + n) / B)
        free_below = min(self.holes().size, 1) if self.mode.reuses_holes and n == 1 else 0
        physical = math.ceil((self.extent + max(n - free_below, 0)) / B)
        if self.mode is not Mode.NAIVE:
            return physical
        if n == 0:
            return max(physical, self.naive_blocks())
        first, last = self.seen // B, (self.seen + n - 1) // B
        seg = self.orig_live[first : last + 1]
        opened = int(np.count_nonzero(seg == 0)) + (last + 1 - first - seg.size)
        return max(physical, self.naive_nonempty + opened)

    def evictable(self, logicals: np.ndarray, sinks: int, recent: int, kept: tuple[int, int] = (0, 0)) -> np.ndarray:
        """Mask over ``logicals``: not a sink, not in the recent window, not in a shared block, not in the
        kept logical range ``kept = [lo, hi)`` (the protected prompt, ``VTokenConfig.kept_prompt``)."""
        shared_tokens = self.shared_blocks * self.block_size
        lo, hi = kept
        return (
            (logicals >= max(sinks, shared_tokens))
            & (logicals < self.seen - recent)
            & ((logicals < lo) | (logicals >= hi))
        )

    # ---------------------------------------------------------------- mutations
    def place(self, n: int, key_norm: np.ndarray | None = None) -> np.ndarray:
        """Give the next ``n`` logical tokens a slot; returns their row-relative slots.

        Side effects: ``seen``/``live``/``extent`` grow; per-token state starts at zero.
        ``reuse+repack`` writes a single new token (a decode step) into the lowest hole; a multi-token
        step (prefill chunk) and every other mode append at ``extent`` in logical order, because the
        attention kernel's causal mask assumes a step's new tokens are the last slots, in order.
        """
        if n < 0:
            raise ValueError(f"cannot place a negative number of tokens ({n})")
        first = self.seen
        self._reserve(first + n)
        if self.mode.reuses_holes and n == 1:
            holes = self.holes()[:n]
            slots = np.concatenate([holes, np.arange(self.extent, self.extent + n - holes.size)])
        else:
            slots = np.arange(self.extent, self.extent + n, dtype=np.int64)
        logicals = np.arange(first, first + n, dtype=np.int64)
        self.slot_of[logicals] = slots
        self.token_at[slots] = logicals
        np.add.at(self.orig_live, logicals // self.block_size, 1)
        self.naive_nonempty = int(np.count_nonzero(self.orig_live[: (first + n - 1) // self.block_size + 1]))
        if key_norm is not None:
            self.key_norm[logicals] = key_norm
        self.seen += n
        self.live += n
        self.extent = max(self.extent, int(slots.max()) + 1) if n else self.extent
        self.version += 1
        return slots.astype(np.int64)

    def evict(self, logicals: np.ndarray, sinks: int = 0, recent: int = 0, kept: tuple[int, int] = (0, 0)) -> None:
        """Kill live, evictable tokens; their slots become holes. Raises on a protected or dead token."""
        if not self.mode.evicts:
            raise ConfigError("reclamation mode 'none' never evicts")
        logicals = np.unique(np.asarray(logicals, dtype=np.int64))
        if logicals.size == 0:
            return
        if logicals[0] < 0 or logicals[-1] >= self.seen or np.any(self.slot_of[logicals] == NO_SLOT):
            raise ValueError(f"evict: tokens {logicals.tolist()[:8]}… are not all live")
        if not np.all(self.evictable(logicals, sinks, recent, kept)):
            raise ValueError("evict: a sink, recent-window, kept-prompt or shared-prefix token is protected")
        slots = self.slot_of[logicals]
        self.token_at[slots] = NO_TOKEN
        self.slot_of[logicals] = NO_SLOT
        blocks = logicals // self.block_size
        np.subtract.at(self.orig_live, blocks, 1)
        self.naive_nonempty = int(np.count_nonzero(self.orig_live[: max(self.seen - 1, 0) // self.block_size + 1]))
        self.live -= logicals.size
        self.evicted_total += logicals.size
        occupied = np.flatnonzero(self.token_at[: self.extent] != NO_TOKEN)
        self.extent = int(occupied[-1]) + 1 if occupied.size else 0
        self.version += 1

    def plan(self) -> SlotPlan:
        """Minimal-move plan to make the row dense (pure).

        Every hole below ``live`` gets a live token from a slot ``>= live``: holes in ascending order
        take the tail tokens in descending slot order. Nothing else moves, so ``moves`` equals the
        number of live tokens outside ``[0, live)`` -- the lower bound for any dense layout.
        """
        dst = self.holes()
        dst = dst[dst < self.live]
        tail = np.flatnonzero(self.token_at[self.live : self.extent] != NO_TOKEN) + self.live
        src = tail[::-1]
        assert src.size == dst.size, "dense-layout counting identity broken"
        moves = np.stack([src, dst], axis=1).astype(np.int64) if dst.size else np.zeros((0, 2), np.int64)
        moves.setflags(write=False)
        keep = math.ceil(self.live / self.block_size)
        if self.mode is Mode.NAIVE:
            keep = max(keep, self.naive_blocks())
        elif self.mode is Mode.NONE:
            keep = math.ceil(self.seen / self.block_size)
        lower_bound = int(np.count_nonzero(self.slot_of[: self.seen] >= self.live))
        return SlotPlan(
            moves=moves,
            keep_blocks=keep,
            version=self.version,
            lower_bound=lower_bound,
            live=self.live,
            block_size=self.block_size,
        )

    def apply(self, plan: SlotPlan) -> None:
        """Apply a plan's moves to the bookkeeping. Raises if the table changed since ``plan()``."""
        if plan.version != self.version:
            raise ValueError(f"stale plan (made at version {plan.version}, table is at {self.version})")
        if plan.num_moves:
            src, dst = plan.moves[:, 0], plan.moves[:, 1]
            tokens = self.token_at[src].copy()
            self.token_at[src] = NO_TOKEN
            self.token_at[dst] = tokens
            self.slot_of[tokens] = dst
        self.extent = self.live  # holes below live are filled and nothing is left at or above it
        self.version += 1

    def mark_shared(self, n_blocks: int) -> None:
        """Declare the row's first ``n_blocks`` shared through the prefix cache (never evicted or moved).

        Only pristine blocks can be shared: full, every token alive at its original slot.
        """
        B = self.block_size
        if n_blocks < 0 or n_blocks * B > self.seen:
            raise ValueError(f"cannot share {n_blocks} blocks of a request with {self.seen} tokens")
        end = n_blocks * B
        if np.any(self.token_at[:end] != np.arange(end)):
            raise ValueError(f"cannot share {n_blocks} blocks: some are not pristine (evicted or rewritten)")
        self.shared_blocks = n_blocks

    def pristine_blocks(self) -> int:
        """Leading full blocks whose slots still hold their original tokens (prefix-cache valid)."""
        B = self.block_size
        n_full = self.seen // B
        ok = self.token_at[: n_full * B].reshape(n_full, B) == np.arange(n_full * B).reshape(n_full, B)
        bad = np.flatnonzero(~ok.all(axis=1))
        return int(bad[0]) if bad.size else n_full

    def _reserve(self, n: int) -> None:
        self.slot_of = _grow(self.slot_of, n, NO_SLOT)
        self.token_at = _grow(self.token_at, n, NO_TOKEN)
        self.orig_live = _grow(self.orig_live, n // self.block_size + 1, 0)
        for stat in Stat:
            arr = getattr(self, stat.value)
            setattr(self, stat.value, _grow(arr, n, arr.dtype.type(0)))

    # ---------------------------------------------------------------- checks
    def check(self, dense: bool = False) -> None:
        """Raise ``IntegrityError`` naming the broken invariant (``dense``: also invariant 3)."""
        live = self.live_logicals()
        if live.size != self.live:
            raise IntegrityError("live count", f"{live.size} live tokens, counter says {self.live}")
        slots = self.slot_of[live]
        if np.unique(slots).size != slots.size:
            raise IntegrityError("1: one owner per slot", "two live tokens share a slot")
        if np.any(self.token_at[slots] != live):
            raise IntegrityError("1: one owner per slot", "slot_of and token_at disagree")
        if np.count_nonzero(self.token_at != NO_TOKEN) != self.live:
            raise IntegrityError("1: one owner per slot", "a slot is owned by a dead token")
        if slots.size and int(slots.max()) >= self.extent:
            raise IntegrityError("extent", f"slot {int(slots.max())} beyond extent {self.extent}")
        if dense and self.extent != self.live:
            raise IntegrityError("3: dense row", f"live tokens span {self.extent} slots, live = {self.live}")
        if self.shared_blocks:
            end = self.shared_blocks * self.block_size
            if np.any(self.token_at[:end] != np.arange(end)):
                raise IntegrityError("6: shared blocks untouched", "a shared prefix block was rewritten")
        counts = np.bincount(live // self.block_size, minlength=self.orig_live.size)
        if np.any(counts[: self.orig_live.size] != self.orig_live):
            raise IntegrityError("naive accounting", "per-original-block live counts drifted")
