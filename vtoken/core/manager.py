"""The engine-free vToken cache manager: token tables + block rows + a pool + the step order.

One step of one request is ``vtoken.core.eviction.decide_step`` (the order every engine follows,
docs/architecture.md §2), then this owner's block work::

    decision = decide_step(table, ...)  evict, [reuse+repack] place 1, plan, apply   (table)
    free row[plan.keep_blocks:]          tail blocks back to the pool (tail first)     (pool)
    place(n_new)      [unless placed]    new tokens append at ``live``; rows grow      (table + pool)

``apply`` frees the plan's blocks only after its moves are booked; a consumer that copies KV
(the vLLM worker) must run the copies before anything writes the freed blocks.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from vtoken.core.config import VTokenConfig
from vtoken.core.eviction import choose_victims, decide_step
from vtoken.core.pool import BlockPool, PoolExhausted
from vtoken.core.reporting.engine_kv import ReclaimCounters
from vtoken.core.step_stats import StepScores, observe
from vtoken.core.token_table import SlotPlan, TokenTable


@dataclass(frozen=True)
class RepackPlan:
    """Immutable: physical ``(src_slot, dst_slot)`` copies, then the blocks freed once they are done.

    Physical slot = block_id * block_size + offset.
    """

    request_id: str
    moves: np.ndarray  # int64 [k, 2], read-only
    freed_blocks: tuple[int, ...]
    slot_plan: SlotPlan

    @property
    def num_moves(self) -> int:
        return int(self.moves.shape[0])


def physical_slots(row: list[int] | np.ndarray, slots: np.ndarray, block_size: int) -> np.ndarray:
    """Row-relative slots → physical slots through the row's block ids."""
    row = np.asarray(row, dtype=np.int64)
    slots = np.asarray(slots, dtype=np.int64)
    return row[slots // block_size] * block_size + slots % block_size


def request_salt(request_id: str) -> int:
    """A stable per-request salt (same id → same salt in every process)."""
    return zlib.crc32(request_id.encode())


class CacheManager:
    """Owns a ``BlockPool``, one ``TokenTable`` and one block row per request. Mutating methods say so."""

    def __init__(self, cfg: VTokenConfig, num_blocks: int) -> None:
        self.cfg = cfg
        self.pool = BlockPool(num_blocks)
        self.policy = cfg.make_policy()
        self.tables: dict[str, TokenTable] = {}
        self.rows: dict[str, list[int]] = {}
        self.counters = ReclaimCounters()

    # -------------------------------------------------------------- request lifecycle (mutating)
    def add_request(self, request_id: str, prompt_len: int = 0) -> TokenTable:
        """A new request's table; ``prompt_len``: its prompt tokens (``VTokenConfig.kept_prompt``)."""
        if request_id in self.tables:
            raise ValueError(f"request {request_id!r} already exists")
        table = TokenTable(block_size=self.cfg.block_size, mode=self.cfg.mode, prompt_len=prompt_len)
        self.tables[request_id] = table
        self.rows[request_id] = []
        return table

    def free(self, request_id: str) -> None:
        """Finish a request: every block of its row returns to the pool."""
        row = self.rows.pop(request_id)
        del self.tables[request_id]
        self.pool.free(list(reversed(row)))

    def place(self, request_id: str, n: int, key_norm: np.ndarray | None = None) -> np.ndarray:
        """Give ``n`` new tokens slots, growing the row from the pool; returns physical slots.

        Raises ``PoolExhausted`` before changing anything if the pool cannot cover the growth.
        """
        table, row = self.tables[request_id], self.rows[request_id]
        need = table.required_blocks_after_place(n) - len(row)
        if need > self.pool.num_free:
            raise PoolExhausted(f"request {request_id!r} needs {need} more blocks, {self.pool.num_free} free")
        slots = table.place(n, key_norm)
        grow = table.required_blocks() - len(row)
        if grow > 0:
            row.extend(self.pool.allocate(grow))
        return physical_slots(row, slots, self.cfg.block_size)

    def evict(self, request_id: str, logicals: np.ndarray) -> None:
        table = self.tables[request_id]
        table.evict(logicals, self.cfg.sinks, self.cfg.recent, self.cfg.kept_prompt(table.prompt_len))
        self.counters = self.counters.add(evicted_tokens=int(np.unique(logicals).size))

    def victims(self, request_id: str) -> np.ndarray:
        """The policy's victims for this request now (pure)."""
        return choose_victims(self.tables[request_id], self.policy, self.cfg, request_salt(request_id))

    def plan(self, request_id: str) -> RepackPlan:
        """The request's repack plan in physical slots (pure)."""
        table, row = self.tables[request_id], self.rows[request_id]
        sp = table.plan()
        moves = physical_slots(row, sp.moves.reshape(-1), self.cfg.block_size).reshape(-1, 2)
        moves.setflags(write=False)
        return RepackPlan(request_id, moves, tuple(row[sp.keep_blocks :]), sp)

    def apply(self, plan: RepackPlan) -> None:
        """Book the plan's moves, then return its freed blocks to the pool (tail first)."""
        table, row = self.tables[plan.request_id], self.rows[plan.request_id]
        if tuple(row[plan.slot_plan.keep_blocks :]) != plan.freed_blocks:
            raise ValueError("stale plan: the request's row changed since it was planned")
        table.apply(plan.slot_plan)
        self._free_tail(plan)

    def _free_tail(self, plan: RepackPlan) -> None:
        """Return an applied plan's tail blocks to the pool (tail first) and count the plan."""
        del self.rows[plan.request_id][plan.slot_plan.keep_blocks :]
        self.pool.free(list(reversed(plan.freed_blocks)))
        self.counters = self.counters.add(
            repack_moves=plan.num_moves, reclaimed_blocks=len(plan.freed_blocks), repack_plans=1
        )

    def mark_shared(self, request_id: str, n_blocks: int) -> None:
        self.tables[request_id].mark_shared(n_blocks)

    def observe(self, request_id: str, scores: StepScores) -> None:
        observe(self.tables[request_id], scores, self.cfg.question_aware)

    def step(self, request_id: str, n_new: int, key_norm: np.ndarray | None = None) -> tuple[RepackPlan, np.ndarray]:
        """One scheduler step for one request (``decide_step``, then blocks); returns (plan, new slots).

        Raises ``PoolExhausted`` if the new tokens' blocks cannot be allocated (the decision stands).
        """
        table, row = self.tables[request_id], self.rows[request_id]
        decision = decide_step(table, self.policy, self.cfg, request_salt(request_id), n_new)
        self.counters = self.counters.add(evicted_tokens=int(decision.victims.size))
        sp = decision.plan
        moves = physical_slots(row, sp.moves.reshape(-1), self.cfg.block_size).reshape(-1, 2)
        moves.setflags(write=False)
        plan = RepackPlan(request_id, moves, tuple(row[sp.keep_blocks :]), sp)
        self._free_tail(plan)
        if decision.placed is None:
            return plan, self.place(request_id, n_new, key_norm)
        if key_norm is not None:
            table.key_norm[table.seen - 1] = key_norm[0]
        return plan, physical_slots(row, decision.placed, self.cfg.block_size)

    # -------------------------------------------------------------- read-only views
    def held_blocks(self) -> int:
        return sum(len(r) for r in self.rows.values())

    def packing_bound(self) -> int:
        return sum(t.packing_bound() for t in self.tables.values())
