"""Accumulating what a simulation measured, per decode step and per request, mergeable across chunks."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MODES = ("none", "naive", "repack", "reuse+repack")
MOVING_MODES = ("repack", "reuse+repack")


@dataclass
class ModeTally:
    """Retained blocks of one mode: Σ over requests per decode step, and each request's peak."""

    per_step_sum: np.ndarray  # float64 [M]
    peaks: list[np.ndarray] = field(default_factory=list)  # int [R_chunk] per chunk
    moves: int = 0
    moves_lower_bound: int = 0


@dataclass
class SimTally:
    """Everything a run measured. ``add_*`` mutate; ``summary()`` is pure."""

    gen_len: int
    requests: int = 0
    packing_per_step_sum: np.ndarray = field(init=False)
    live_per_step_sum: np.ndarray = field(init=False)
    modes: dict[str, ModeTally] = field(init=False)

    def __post_init__(self) -> None:
        self.packing_per_step_sum = np.zeros(self.gen_len)
        self.live_per_step_sum = np.zeros(self.gen_len)
        self.modes = {m: ModeTally(np.zeros(self.gen_len)) for m in MODES}

    def add_step(self, step: int, live: np.ndarray, packing: np.ndarray, retained: dict[str, np.ndarray]) -> None:
        """Record decode step ``step`` (0-based) for a chunk: arrays are per request in the chunk."""
        self.live_per_step_sum[step] += float(np.sum(live))
        self.packing_per_step_sum[step] += float(np.sum(packing))
        for mode, blocks in retained.items():
            self.modes[mode].per_step_sum[step] += float(np.sum(blocks))

    def add_chunk(self, n: int, peaks: dict[str, np.ndarray], moves: dict[str, tuple[int, int]]) -> None:
        self.requests += n
        for mode, p in peaks.items():
            self.modes[mode].peaks.append(np.asarray(p))
        for mode, (mv, lb) in moves.items():
            self.modes[mode].moves += mv
            self.modes[mode].moves_lower_bound += lb

    def mean_series(self) -> dict[str, np.ndarray]:
        """Mean retained blocks per request at each decode step, per mode (+ ``packing_bound``)."""
        out = {m: t.per_step_sum / self.requests for m, t in self.modes.items()}
        out["packing_bound"] = self.packing_per_step_sum / self.requests
        return out

    def summary(self) -> dict:
        denom = self.requests * self.gen_len
        modes = {}
        for m, t in self.modes.items():
            peaks = np.concatenate(t.peaks) if t.peaks else np.zeros(0)
            entry = {
                "retained_blocks_mean": float(t.per_step_sum.sum() / denom),
                "peak_blocks": int(peaks.max(initial=0)),
                "peak_blocks_mean": float(peaks.mean()) if peaks.size else 0.0,
            }
            if m in MOVING_MODES:
                entry["moves_total"] = int(t.moves)
                entry["moves_lower_bound"] = int(t.moves_lower_bound)
            modes[m] = entry
        naive = modes["naive"]["retained_blocks_mean"]
        for m in MOVING_MODES:
            modes[m]["vs_naive_pct"] = 100.0 * (modes[m]["retained_blocks_mean"] / naive - 1.0) if naive else 0.0
        return {
            "packing_bound_mean": float(self.packing_per_step_sum.sum() / denom),
            "live_tokens_mean": float(self.live_per_step_sum.sum() / denom),
            "modes": modes,
        }


def window_blocks(seen: np.ndarray, window: int, block_size: int) -> np.ndarray:
    """Blocks one sliding-window KV cache group holds for a request with ``seen`` tokens (vLLM 0.32's
    ``SlidingWindowManager``: the next token attends the last ``window - 1`` of them, the ``seen - window +
    1`` before are skipped, whole skipped blocks go back to the pool). Pure, vectorised over ``seen``::

        B = 4, window 6, seen 13    [0 1 2 3][4 5 6 7][8 9 10 11][12]    tokens 0-7 skipped: 2 blocks held
    """
    seen = np.asarray(seen, dtype=np.int64)
    skipped = np.maximum(seen - window + 1, 0) // block_size
    return -(-seen // block_size) - skipped


def whole_pool(summary: dict, prompt_len: int, gen_len: int, block_size: int, window: int, groups: int) -> dict:
    """A hybrid model's whole pool per request, from a simulation of its full-attention group (``summary``:
    ``SimTally.summary()``): each mode's mean retained blocks plus ``groups`` sliding-window groups' blocks
    at every decode step (the same in every mode: vToken leaves them to vLLM), and repack's saving against
    naive over that whole pool. Pure."""
    seen = prompt_len + np.arange(1, gen_len + 1)
    sliding = float(groups * window_blocks(seen, window, block_size).mean())
    pool = {m: {"pool_blocks_mean": e["retained_blocks_mean"] + sliding} for m, e in summary["modes"].items()}
    naive = pool["naive"]["pool_blocks_mean"]
    for m in MOVING_MODES:
        pool[m]["vs_naive_pct"] = 100.0 * (pool[m]["pool_blocks_mean"] / naive - 1.0) if naive else 0.0
    return {"sliding_blocks_mean": sliding, "modes": pool}
