"""Always-on KV invariants of a running engine: a leaked or double-held block is seen when it happens.

What SGLang's scheduler does when it goes idle ("memory leak detected"), for vLLM's pool under vToken. The
scheduler (vtoken/vllm/scheduler.py) runs ``check`` when its last request has gone (idle) and every
``invariant_period`` steps under load; the engine setting ``invariants`` says what a violation does
(``log``: an error line naming the requests or blocks, counted in ``invariant_violations``; ``fatal``: an
``IntegrityError`` too, for tests; ``off``). The three invariants::

    pool     every block but vLLM's null block:  ref_cnt == number of holders
             holders = live requests' block rows (every KV manager's req_to_blocks) + vLLM's deferred frees
             vLLM's free count == blocks without a reference      => free + held == pool, nothing leaked
    tables   each given request's token table: its integrity check (every live token in a slot of its own,
             inside its row) and rows hold exactly the blocks its mode accounts for (required_blocks)
    hashes   no prefix-cached block in a given row was rewritten (its slots carry its original tokens)

Pure: reads vLLM's pool and rows and the token tables, returns the violations as text, changes nothing.
Cost: one pass over the pool's block list plus the given rows (measured in docs/operations.md).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from vtoken.core.token_table import TokenTable
from vtoken.errors import IntegrityError
from vtoken.vllm.scheduling.blocks import check_hashes

SHOWN = 8  # block ids / requests named per violation line


def pool_violations(pool, rows: Iterable[tuple[str, list]], deferred: Iterable[list]) -> list[str]:
    """The pool invariant (see the module docstring). ``rows``: (request id, block row of ``KVCacheBlock``s)
    pairs over every KV manager (a hybrid model's request has one row per group); ``deferred``: block lists
    vLLM still holds for a later free."""
    holders: Counter = Counter()
    owner: dict[int, str] = {}
    for rid, row in rows:
        for blk in row:
            if not blk.is_null:
                holders[blk.block_id] += 1
                owner.setdefault(blk.block_id, rid)
    for blocks in deferred:
        for blk in blocks:
            if not blk.is_null:
                holders[blk.block_id] += 1
                owner.setdefault(blk.block_id, "(deferred free)")
    leaked: list[Any] = []
    wrong: list[Any] = []
    unreferenced = 0
    for blk in pool.blocks:
        if blk.is_null:
            continue
        n = holders.get(blk.block_id, 0)
        unreferenced += blk.ref_cnt == 0
        if blk.ref_cnt != n:
            (leaked if n == 0 else wrong).append(blk)
    out = []
    if leaked:
        out.append(
            f"{len(leaked)} block(s) referenced by no request (leaked): ids "
            f"{[b.block_id for b in leaked[:SHOWN]]} ref_cnt {[b.ref_cnt for b in leaked[:SHOWN]]}"
        )
    if wrong:
        out.append(
            f"{len(wrong)} block(s) whose ref_cnt is not their holder count: "
            + ", ".join(
                f"{b.block_id} ({b.ref_cnt} refs, {holders[b.block_id]} holders, e.g. request {owner[b.block_id]})"
                for b in wrong[:SHOWN]
            )
        )
    free = pool.get_num_free_blocks()
    if free != unreferenced:
        out.append(f"vLLM counts {free} free blocks, {unreferenced} have no reference (pool {len(pool.blocks) - 1})")
    return out


def table_violations(
    rows: Mapping[str, list], tables: Mapping[str, TokenTable], block_hashes: Mapping[str, list]
) -> list[str]:
    """The tables and hashes invariants for ``tables`` (request id → token table; each with its row and
    vLLM's block hashes of the request)."""
    out = []
    for rid, t in tables.items():
        row = rows.get(rid, [])
        try:
            t.check(dense=True)
            check_hashes(rid, row, t, block_hashes.get(rid, []))
        except IntegrityError as err:
            out.append(f"request {rid}: {err}")
            continue
        if len(row) != t.required_blocks():
            out.append(f"request {rid}: holds {len(row)} blocks, its token table accounts for {t.required_blocks()}")
    return out
