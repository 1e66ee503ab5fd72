"""vLLM block surgery for the vToken scheduler: the one place that edits vLLM's KV-cache manager state.

Everything here acts on the scheduler's own instances (never on classes, never at import time):

* ``install_block_sizing`` wraps the coordinator's ``get_num_blocks_to_allocate`` / ``allocate_new_blocks``
  so rows are sized by the token table (``required_blocks_after_place``: ⌈live/B⌉ for repack, the naive
  rule for naive) while ``num_computed_tokens`` stays logical, and ``cache_blocks`` so a request stops
  publishing prefix-cache hashes after its first eviction (its later KV no longer matches its hash chain).
* ``shared_prefix`` counts the leading blocks another request also holds (``ref_cnt > 1``).
* ``unhash_written`` takes the hash off every block a decision writes (prefix cache stays truthful).
* ``free_tail`` returns a row's tail to vLLM's ``BlockPool`` (tail first, vLLM's own free order).

The vLLM internals used are listed with their reasons in ``vtoken.vllm.internals``.
"""

from __future__ import annotations

from collections.abc import Callable

from vtoken.core.token_table import TokenTable
from vtoken.errors import IntegrityError


def install_block_sizing(coord, table_of: Callable[[str], TokenTable | None], block_size: int) -> None:
    """Wrap three methods of the coordinator *instance* ``coord`` (mutates it; see the module docstring).
    ``table_of(request_id)`` is the request's token table, or None for plain vLLM accounting."""
    orig_count = coord.get_num_blocks_to_allocate
    orig_alloc = coord.allocate_new_blocks
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

    coord.get_num_blocks_to_allocate = get_num_blocks_to_allocate
    coord.allocate_new_blocks = allocate_new_blocks
    coord.cache_blocks = cache_blocks


def shared_prefix(blocks: list) -> int:
    """Leading blocks of a row that another request also holds (``ref_cnt > 1``)."""
    n = 0
    while n < len(blocks) and blocks[n].ref_cnt > 1:
        n += 1
    return n


def unhash_written(kv_cache_manager, request_id: str, written: list) -> None:
    """Drop the prefix-cache hash of every block in ``written`` (mutates vLLM's cache index). Raises
    ``IntegrityError`` if one is shared or null: vToken must never write a block someone else reads."""
    for b in written:
        if b.ref_cnt != 1 or b.is_null:
            raise IntegrityError(
                "6: shared blocks untouched",
                f"request {request_id} would write block {b.block_id} (ref_cnt={b.ref_cnt})",
            )
    hashed = {b.block_id for b in written if b.block_hash is not None}
    if hashed:
        kv_cache_manager.evict_blocks(hashed)


def free_tail(kv_cache_manager, type_manager, request_id: str, keep: int) -> int:
    """Cut the request's row (``type_manager.req_to_blocks``) to ``keep`` blocks and return the rest to the
    pool, tail first (mutates both). Returns the number of blocks freed."""
    blocks = type_manager.req_to_blocks[request_id]
    if keep >= len(blocks):
        return 0
    tail = blocks[keep:]
    del blocks[keep:]
    cached = type_manager.num_cached_block
    if request_id in cached:
        cached[request_id] = min(cached[request_id], keep)
    kv_cache_manager.block_pool.free_blocks(reversed(tail))
    return len(tail)
