"""Copy-on-write of row blocks a step must not write (pure; docs/vllm-integration.md, "Prefix caching").

A repack writes into the request's own row blocks: move destinations, the hole a reused decode token
takes, and every kept block from the live frontier on (later tokens append there). Inside vLLM some of
those blocks must stay as they are: a block carrying a prefix-cache hash (a later request with the same
prefix would read it) or one another request also holds. Such a *frozen* block is never written; the row
gets a replacement block instead, the live tokens that stay in it (its *survivors*) are copied across,
the plan's moves into it land in the replacement, and the original leaves the row untouched (vLLM keeps
it as a cached block, evictable, or drops this request's reference)::

    B = 4, row [H0 H1 T2], H0 and H1 prefix-cached; t5 and t11 evicted: live = 10, one hole (slot 5)

    before   H0 [t0 t1 t2 t3] | H1 [t4 __ t6 t7] | T2 [t8 t9 t10 __]
    plan     (10 -> 5), keep 3 blocks     H1 holds a destination: it would be written; H0 is not written
    cow      H1 -> R (a fresh block)      survivors of H1: slots 4, 6, 7, copied at the same offsets
    moves    src through the old row, dst through the new row, every source gathered before any scatter:
             t10: T2[2] -> R[1]    t4: H1[0] -> R[0]    t6: H1[2] -> R[2]    t7: H1[3] -> R[3]
    after    H0 [t0 t1 t2 t3] | R  [t4 t10 t6 t7] | T2 [t8 t9 .. ..]   H1 released unchanged, still cached

**Lower bound.** A frozen block the step writes must leave the row (it has a hole to fill or receives
appends), so each survivor must be copied at least once; the plan's own moves are the tail tokens at slots
``>= live``, disjoint from the survivors (below ``live``). The step's copies are therefore
``SlotPlan.lower_bound + survivors``, each necessary while every other block keeps its row position (the
planner never relabels a block: a tail block moved into the row with its tokens in place could save a
few copies; not done). The packing bound is unchanged: the row keeps ``keep`` blocks either way.

Physical addresses: sources are read through the row *before* the swap, destinations written through
the row *after* it; the worker gathers every source before it scatters, and the block owner picks
replacements that hold no source of the step (``spare_tail``; fresh pool blocks are never sources), so
sources and destinations stay disjoint (docs/architecture.md §3).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vtoken.core.eviction import StepDecision
from vtoken.core.manager import physical_slots
from vtoken.core.token_table import SlotPlan


@dataclass(frozen=True)
class CowPlan:
    """Which row blocks are replaced and which row slots are copied into their replacements (pure data)."""

    blocks: np.ndarray  # int64 ascending row block indices that get a replacement
    survivors: np.ndarray  # int64 ascending row slots copied from the original block to its replacement
    lower_bound: int  # copies the step needs in all: plan.lower_bound + survivors

    @property
    def num_copies(self) -> int:
        return int(self.survivors.size)


def frozen_written(decision: StepDecision, keep: int, frozen: np.ndarray) -> np.ndarray:
    """The row blocks this step writes that must not be written (``frozen[b]``), ascending (pure)."""
    written = decision.written_blocks(keep)
    return written[np.asarray(frozen, bool)[written]]


def plan_cow(plan: SlotPlan, placed: np.ndarray | None, replaced: np.ndarray) -> CowPlan:
    """Survivors of the ``replaced`` row blocks (pure): their slots below ``plan.live`` that no move of
    ``plan`` writes and that are not the ``placed`` hole (whose token the forward writes later)."""
    B = plan.block_size
    replaced = np.unique(np.asarray(replaced, np.int64))
    if replaced.size == 0:
        return CowPlan(replaced, np.zeros(0, np.int64), plan.lower_bound)
    slots = (replaced[:, None] * B + np.arange(B)[None, :]).reshape(-1)
    slots = slots[slots < plan.live]
    taken = [plan.moves[:, 1]] if plan.num_moves else []
    if placed is not None:
        taken.append(np.asarray(placed, np.int64))
    if taken:
        slots = slots[~np.isin(slots, np.concatenate(taken))]
    return CowPlan(replaced, slots, plan.lower_bound + int(slots.size))


def spare_tail(plan: SlotPlan, keep: int, row_len: int, writable: np.ndarray) -> list[int]:
    """Row indices ``>= keep`` (blocks this plan frees) that can serve as replacements (pure): writable
    (``writable[k]``) and holding no source of the plan's moves, so no slot is both read and written."""
    B = plan.block_size
    sources = set((plan.moves[:, 0] // B).tolist()) if plan.num_moves else set()
    return [k for k in range(keep, row_len) if k not in sources and bool(writable[k])]


def physical_moves(plan: SlotPlan, cow: CowPlan, old_row, new_row) -> tuple[np.ndarray, np.ndarray]:
    """``(src, dst)`` physical slots of the step's copies (pure): the plan's moves, then the survivors'.
    Sources through ``old_row`` (block ids before the swap), destinations through ``new_row`` (after)."""
    B = plan.block_size
    src = np.concatenate([plan.moves[:, 0], cow.survivors]).astype(np.int64)
    dst = np.concatenate([plan.moves[:, 1], cow.survivors]).astype(np.int64)
    return physical_slots(old_row, src, B), physical_slots(new_row, dst, B)
