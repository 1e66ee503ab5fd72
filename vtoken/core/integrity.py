"""``check_integrity``: every invariant of docs/architecture.md §4 that holds without an engine.

Raises ``IntegrityError`` whose ``invariant`` names the broken rule. Read-only.

  1. no slot is owned by two live tokens; no slot of a free block is referenced
  2. free + held blocks = pool size; no block is held twice or both held and free
  3. (``dense=True``, i.e. when a forward would run) live tokens occupy exactly slots 0..live-1
  4. logical positions never change: token ``i`` is alive at most once and ``seen`` counts placements
  6. shared prefix blocks still hold their original tokens (never a move source or destination)
  +  the row holds at least what the mode's accounting requires, and never less than the live data
"""

from __future__ import annotations

import math

from vtoken.core.config import Mode
from vtoken.core.manager import CacheManager
from vtoken.errors import IntegrityError


def check_integrity(manager: CacheManager, dense: bool = False) -> None:
    pool = manager.pool
    held: dict[int, str] = {}
    for rid, row in manager.rows.items():
        table = manager.tables[rid]
        table.check(dense=dense)
        for b in row:
            if b in held:
                raise IntegrityError("2: one owner per block", f"block {b} held by {held[b]!r} and {rid!r}")
            if pool.is_free(b):
                raise IntegrityError("1: no slot of a free block referenced", f"{rid!r} holds free block {b}")
            held[b] = rid
        if math.ceil(table.extent / table.block_size) > len(row):
            raise IntegrityError(
                "1: no slot of a free block referenced",
                f"{rid!r} uses {table.extent} slots but its row has {len(row)} blocks",
            )
        if len(row) < table.required_blocks():
            raise IntegrityError("accounting", f"{rid!r} holds {len(row)} < {table.required_blocks()} blocks")
        if table.mode is Mode.NONE and table.live != table.seen:
            raise IntegrityError("4: positions", f"mode none lost tokens in {rid!r}")
    if len(held) + pool.num_free != pool.num_blocks:
        raise IntegrityError("2: free + held = pool", f"{len(held)} held + {pool.num_free} free != {pool.num_blocks}")
