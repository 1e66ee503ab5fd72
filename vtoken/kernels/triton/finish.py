"""The host side of ``TritonScoreAccumulator.finish``: each request's statistics over its scored range
from the step's host ``sums`` and kept query ``rows`` buffers (``kernels.triton.scores``). Pure numpy."""

from __future__ import annotations

import numpy as np

from vtoken.core.step_stats import unimportance_bits
from vtoken.kernels.scores import RequestScores
from vtoken.policies.context import HISTORY_BITS, OBSERVATION_WINDOW


def widened(sums: np.ndarray, scored: list[RequestScores]) -> np.ndarray | list[np.ndarray]:
    """Each request's ``sums`` row over its scored range, float64, divided by its layers: the whole buffer
    at once when the ranges fill at least half of it (a decode batch of similar rows: a few numpy calls in
    all), else each request's slice alone (never a long row's width for every request). Pure."""
    used = sum(rs.seq_len - rs.first for rs in scored)
    if 2 * used >= sums.size:
        return sums.astype(np.float64) / np.array([float(rs.layers) for rs in scored])[:, None]
    return [sums[r, : rs.seq_len - rs.first].astype(np.float64) / rs.layers for r, rs in enumerate(scored)]


def request_stats(
    rs: RequestScores, sums: np.ndarray, rows: np.ndarray | None, start: int, keep: list[int]
) -> dict[str, np.ndarray]:
    """One request's attention statistics over its scored range (``seq_len - first`` columns) from the
    host buffers: its ``sums`` row (float64, ÷ layers: ``widened``) and, from row ``start``, the rows of its
    ``keep`` queries (none for a single query: its row is its sums), each sliced before it is widened. The
    arrays may share memory with each other and the buffers: read-only. Pure."""
    n = rs.seq_len - rs.first
    acc = sums[:n]
    if not keep:  # one query: accumulated, last and the window are its row
        # unimportance_bits of one row that saw every key: bit 0 ⇔ below 1/seq_len (same values, no 2-D pass)
        stats = {"accumulated": acc, "last": acc, "unimportant": (acc < 1.0 / rs.seq_len).astype(np.uint64)}
        if rs.window:
            stats["window"] = acc
        return stats
    by_q = dict(zip(keep, rows[start : start + len(keep), :n].astype(np.float64) / rs.layers))
    last = [qi for qi in keep if qi >= rs.n_q - HISTORY_BITS]
    seen = np.array(last)[:, None] + rs.seq_len - rs.n_q + 1  # keys each kept query saw, in all
    visible = np.arange(rs.first, rs.seq_len)[None, :] < seen
    stats = {
        "accumulated": acc,
        "last": by_q[rs.n_q - 1].copy(),
        "unimportant": unimportance_bits(np.stack([by_q[qi] for qi in last]), visible, seen[:, 0]),
    }
    if rs.window:
        rows_w = range(max(rs.window - OBSERVATION_WINDOW, 0), rs.window)
        stats["window"] = sum(by_q[qi] for qi in rows_w)
    return stats
