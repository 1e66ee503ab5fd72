"""A block pool with vLLM's free-queue discipline, for the engine-free core and the simulator.

Inside vLLM the engine's own ``BlockPool`` is used instead; this one mirrors its behaviour that
matters for repacking: freed blocks are handed out again LIFO, so a block freed by a plan can be
given to another request in the very same step (its moves must run first).
"""

from __future__ import annotations


class PoolExhausted(RuntimeError):
    """Not enough free blocks; nothing was allocated."""


class BlockPool:
    """``num_blocks`` block ids ``0..num_blocks-1``; allocation and freeing mutate the free list."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._is_free = [True] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolExhausted(f"need {n} blocks, {len(self._free)} free of {self.num_blocks}")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._is_free[b] = False
        return out

    def free(self, blocks: list[int]) -> None:
        """Return blocks; the last one freed is the first handed out again (LIFO). Raises on double free."""
        for b in blocks:
            if self._is_free[b]:
                raise ValueError(f"block {b} freed twice")
        for b in blocks:
            self._is_free[b] = True
            self._free.append(b)

    def is_free(self, block: int) -> bool:
        return self._is_free[block]
