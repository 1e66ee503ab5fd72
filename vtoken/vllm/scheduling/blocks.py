"""vLLM block surgery for the vToken scheduler: the one place that edits vLLM's KV-cache manager state.

Everything here acts on the scheduler's own instances (never on classes, never at import time):

* ``install_block_sizing`` wraps the full-attention manager's ``get_num_blocks_to_allocate`` /
  ``allocate_new_blocks`` so rows are sized by the token table (``required_blocks_after_place``: ⌈live/B⌉
  for repack, the naive rule for naive) while ``num_computed_tokens`` stays logical (a hybrid model's
  sliding-window managers keep vLLM's logical sizing), and the coordinator's ``cache_blocks`` so a request
  stops publishing prefix-cache hashes after its first eviction (its later KV no longer matches its hash
  chain).
* ``shared_prefix`` counts the leading blocks another request also holds (``ref_cnt > 1``).
* ``rewrite_row`` does a decision's block work: copy-on-write of every block the step writes that must not
  be written (prefix-cached or shared), the physical moves, the cut tail; ``release`` frees what it let go
  once every decision of the step is made, cached blocks keeping their hashes.
* ``check_hashes`` (``check: true``): every cached block in a row still holds what its hash names.

The vLLM internals used are listed with their reasons in ``vtoken.vllm.internals``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from vllm.v1.core.kv_cache_utils import get_block_hash

from vtoken.core.cow import CowPlan, frozen_written, physical_moves, plan_cow, spare_tail
from vtoken.core.eviction import StepDecision
from vtoken.core.token_table import TokenTable
from vtoken.errors import IntegrityError


def install_block_sizing(coord, manager, table_of: Callable[[str], TokenTable | None], block_size: int) -> None:
    """Wrap two methods of the full-attention ``manager`` *instance* (the coordinator's manager of the group
    vToken manages) and ``cache_blocks`` of the coordinator *instance* ``coord`` (mutates both; see the
    module docstring). Only that manager sees physical token counts: a hybrid model's sliding-window
    managers keep vLLM's logical accounting. ``table_of(request_id)`` is the request's token table, or None
    for plain vLLM accounting."""
    orig_count = manager.get_num_blocks_to_allocate
    orig_alloc = manager.allocate_new_blocks
    orig_cache = coord.cache_blocks

    def physical_tokens(request_id: str, num_tokens: int) -> int:
        t = table_of(request_id)
        if t is None:
            return num_tokens
        return t.required_blocks_after_place(max(num_tokens - t.seen, 0)) * block_size

    def get_num_blocks_to_allocate(request_id, num_tokens, *args, **kwargs):
        return orig_count(request_id, physical_tokens(request_id, num_tokens), *args, **kwargs)

    def allocate_new_blocks(request_id, num_tokens, *args, **kwargs):
        return orig_alloc(request_id, physical_tokens(request_id, num_tokens), *args, **kwargs)

    def cache_blocks(request, num_computed_tokens):
        t = table_of(request.request_id)
        if t is not None and t.evicted_total > 0:
            return None  # its KV no longer matches the hash chain of its tokens
        return orig_cache(request, num_computed_tokens)

    manager.get_num_blocks_to_allocate = get_num_blocks_to_allocate
    manager.allocate_new_blocks = allocate_new_blocks
    coord.cache_blocks = cache_blocks


def shared_prefix(blocks: list) -> int:
    """Leading blocks of a row that another request also holds (``ref_cnt > 1``)."""
    n = 0
    while n < len(blocks) and blocks[n].ref_cnt > 1:
        n += 1
    return n


@dataclass
class RowWork:
    """One decision's block work on one request's row (``rewrite_row``): what the worker must do and what
    the scheduler counts. ``release`` goes back to the pool only after every decision of the step."""

    src: np.ndarray  # int64 physical source slots (plan moves, then copy-on-write survivors)
    dst: np.ndarray  # int64 physical destination slots
    replace: dict[int, int]  # row index -> block id now at that index (copy-on-write replacements)
    release: list  # KVCacheBlocks to free: the cut tail (last first), then the replaced originals
    cut: bool  # the row was shortened: the worker cuts it to ``keep`` blocks too
    freed: int  # blocks the row gave back to the pool (net)
    cow: CowPlan
    fallbacks: int  # prefix-cached blocks un-hashed and rewritten in place (no replacement block free)


def _ids(row: list) -> np.ndarray:
    return np.fromiter((b.block_id for b in row), dtype=np.int64, count=len(row))


def rewrite_row(block_pool, type_manager, request_id: str, decision: StepDecision) -> RowWork:
    """Block work of an applied decision (mutates the row, the pool, vLLM's prefix-cache index).

    Every block the step writes (``StepDecision.written_blocks``) that vLLM's ``is_block_writable``
    refuses — prefix-cached, or held by another request — is replaced, copy on write (``vtoken.core.cow``)::

        row     [H0 H1 H2 T3 T4 T5]    H* prefix-cached; the plan keeps 3 blocks and writes H1, H2
        spare   T5: freed by this plan, writable, no move reads it      (else a fresh block from the pool)
        row  -> [H0 T5 F  ]            F: fresh; survivors of H1 -> T5, of H2 -> F; moves into H1/H2 land there
        release T4 T3 (tail, last first), H2 H1 (vLLM keeps their hashes: cached, at the evictable end)

    Replacements never hold a source of the step (spare tail blocks hold none; the pool holds no block freed
    this step, because ``release`` waits until every decision is made), so sources and destinations of
    the step stay disjoint. With no spare and an empty pool a cached block with ``ref_cnt == 1`` is un-hashed
    and rewritten in place (``fallbacks``); a shared one raises ``IntegrityError`` (``can_replace_shared``
    keeps a decision from reaching that)."""
    row = type_manager.req_to_blocks[request_id]
    plan = decision.plan
    keep = min(plan.keep_blocks, len(row))
    writable = np.array([block_pool.is_block_writable(b) for b in row], dtype=bool)
    spares = spare_tail(plan, keep, len(row), writable)
    new_row, used, replaced, fallbacks = list(row), set(), [], 0
    frozen = frozen_written(decision, keep, ~writable).tolist()
    # shared blocks first: they have no fallback, so they get the spares and the pool before cached ones
    frozen.sort(key=lambda b: (row[b].ref_cnt == 1, b))
    for b in frozen:
        blk = row[b]
        if blk.is_null:
            raise IntegrityError("6: shared blocks untouched", f"request {request_id} would write the null block")
        if spares:
            used.add(spares[0])
            new_row[b] = row[spares.pop(0)]
        elif block_pool.get_num_free_blocks() > 0:
            new_row[b] = block_pool.get_new_blocks(1)[0]  # drops a stale hash the fresh block had
        elif blk.ref_cnt == 1:
            block_pool.evict_blocks({blk.block_id})  # rewritten in place: its cache entry must go
            fallbacks += 1
            continue
        else:
            raise IntegrityError(
                "6: shared blocks untouched",
                f"request {request_id} would write block {blk.block_id} (ref_cnt={blk.ref_cnt})",
            )
        replaced.append(b)
    replaced.sort()
    cow = plan_cow(plan, decision.placed, np.asarray(replaced, np.int64))
    src, dst = physical_moves(plan, cow, _ids(row), _ids(new_row))
    tail = [row[k] for k in range(keep, len(row)) if k not in used]
    originals = [row[b] for b in replaced]  # ascending row order: released last first (chain tail first)
    cut, freed = keep < len(row), len(row) - keep
    row[:] = new_row[:keep]
    cached = type_manager.num_cached_block
    if request_id in cached:
        cached[request_id] = min([cached[request_id], keep, *replaced])
    return RowWork(
        src=src,
        dst=dst,
        replace={b: new_row[b].block_id for b in replaced},
        release=tail[::-1] + originals[::-1],
        cut=cut,
        freed=freed,
        cow=cow,
        fallbacks=fallbacks,
    )


def can_replace_shared(row: list, n_shared: int, block_pool) -> bool:
    """Whether every block past the protected leading ``n_shared`` that another request also holds could get
    a fresh replacement now (pure). A shared block can sit past the shared prefix once a copy-on-write kept
    an earlier one cached for another request; it may be evicted from only if it can be replaced."""
    return sum(1 for b in row[n_shared:] if b.ref_cnt > 1) <= block_pool.get_num_free_blocks()


def release(block_pool, blocks: list) -> None:
    """Return a step's released blocks to vLLM's pool (mutates it): unhashed ones to the front of the free
    queue (reused first), cached ones to its evictable end with their hashes (a later request hits them;
    memory pressure reclaims them first-in, first-out). A block another request holds just loses a ref."""
    if blocks:
        block_pool.free_blocks(blocks)


def check_hashes(request_id: str, row: list, table: TokenTable, block_hashes: list) -> None:
    """Raise ``IntegrityError`` unless every prefix-cached block in the row holds exactly what its hash
    names: its slots carry their original tokens (never rewritten) and the hash is the request's own
    hash of that block (pure; ``check: true``)."""
    B = table.block_size
    for b, blk in enumerate(row):
        if blk.block_hash is None:
            continue
        pristine = (b + 1) * B <= table.seen and np.array_equal(
            table.token_at[b * B : (b + 1) * B], np.arange(b * B, (b + 1) * B)
        )
        if not pristine or b >= len(block_hashes) or get_block_hash(blk.block_hash) != block_hashes[b]:
            raise IntegrityError(
                "6: shared blocks untouched",
                f"request {request_id}: block {blk.block_id} at row index {b} is cached under a "
                "hash its content no longer matches",
            )
