"""``vtoken bench score-host``: the host-side cost of one decode step's attention statistics, before and after
scoring only what can be evicted (issue 41, item 2; ``vtoken.core.scored_range``).

What it times, per shape (requests × live tokens) and ``scope``, on host buffers (CPU tensors: the device
work and the device→host copy are not in it; ``readback_bytes`` says how much the copy would move): the
Triton accumulator's ``finish`` over its ``sums``/``rows`` buffers, then for every request the scheduler's
fold, ``SlotScores.by_logical`` + ``observe`` into a token table of ``seq_len`` live tokens whose last
``generated`` are output tokens (the prompt is the rest).

  * ``old``: the code before the change, frozen below as ``legacy_finish`` — every step keeps a row per
    query even for a single query, widens whole ``[requests, longest row]`` buffers to float64, and every
    statistic covers row slots ``0..seq_len-1``;
  * ``new``: the current ``TritonScoreAccumulator.finish`` with each request's first scored slot
    (``first_scored``: the prompt under ``scope: generated``, the sinks under ``scope: all``), no rows for
    single queries, each request's slice widened alone.

Both folds start from the same fp32 sums; ``same_statistics`` checks that every statistic a policy can read
for an evictable token (logical ≥ the protected prefix) is equal in the two tables afterwards (the victims
then are). Side effects: none beyond the JSON report (``report.emit``).
"""

from __future__ import annotations

import gc
import os
import shlex
import sys
import time

import numpy as np
import torch

from vtoken.core.config import Mode, VTokenConfig
from vtoken.core.scored_range import first_scored, protected_prefix
from vtoken.core.step_stats import SlotScores, observe, unimportance_bits
from vtoken.core.token_table import TokenTable
from vtoken.kernels.gpu_layout import PagedLayout
from vtoken.kernels.scores import RequestScores
from vtoken.kernels.triton.scores import TritonScoreAccumulator
from vtoken.policies.context import HISTORY_BITS, OBSERVATION_WINDOW

# the top-level keys of the report ``run_score_host`` returns (``report.emit`` adds ``environment``)
REPORT_KEYS = frozenset({"bench", "command", "policy", "generated", "repeats", "what", "rows", "load_average"})
SHAPES = ((64, 32768), (256, 4096))  # requests × live tokens (the issue's)
STATS = ("accumulated", "last", "unimportant")


def legacy_finish(meta: dict, requests: dict[str, RequestScores]) -> dict[str, SlotScores]:
    """FROZEN COPY (for this benchmark only) of ``TritonScoreAccumulator.finish`` before the scored range:
    ``meta`` holds ``sums`` ``[R, kmax]``, ``rows`` (a row per kept query, single queries included),
    ``kept`` and ``scored`` as ``_plan`` built them then. Pure."""
    attention: dict[int, dict] = {}
    sums, rows = meta["sums"].cpu().double().numpy(), meta["rows"].cpu().double().numpy()
    start = 0
    for r, rs in enumerate(meta["scored"]):
        keep = meta["kept"][r]
        mine = rows[start : start + len(keep), : rs.seq_len] / rs.layers
        by_q = dict(zip(keep, mine))
        start += len(keep)
        last = [qi for qi in keep if qi >= rs.n_q - HISTORY_BITS]
        visible = np.arange(rs.seq_len)[None, :] < (np.array(last)[:, None] + rs.seq_len - rs.n_q + 1)
        stats = {
            "accumulated": sums[r, : rs.seq_len] / rs.layers,
            "last": by_q[rs.n_q - 1].copy(),
            "unimportant": unimportance_bits(np.stack([by_q[qi] for qi in last]), visible),
        }
        if rs.window:
            stats["window"] = sum(by_q[qi] for qi in range(max(rs.window - OBSERVATION_WINDOW, 0), rs.window))
        attention[id(rs)] = stats
    return {
        rid: SlotScores(n_queries=rs.n_q, seq_len=rs.seq_len, **attention.get(id(rs), {}))
        for rid, rs in requests.items()
    }


def _tables(cfg: VTokenConfig, n_req: int, live: int, generated: int) -> list[TokenTable]:
    out = []
    for _ in range(n_req):
        t = TokenTable(block_size=cfg.block_size, mode=Mode.REPACK, prompt_len=live - generated)
        t.place(live)
        out.append(t)
    return out


def _accumulator(n_req: int, live: int, first: int, sums: np.ndarray) -> TritonScoreAccumulator:
    """A decode step's accumulator (one query per request, one scored layer) whose host ``sums`` hold the
    given values, planned as the worker plans it (mutates nothing else)."""
    layout = PagedLayout("bench", 16, 1, 16, 512, 512, torch.zeros(16, 32, dtype=torch.int64), 32)  # unread
    acc = TritonScoreAccumulator(layout)
    row = torch.zeros(-(-live // 16), dtype=torch.int64)
    for i in range(n_req):
        acc.requests[f"r{i}"] = RequestScores(
            i, i + 1, live, row, want_attention=True, want_key_norm=False, first=first, layers=1
        )
    acc._meta = acc._plan(list(acc.requests.values()), torch.device("cpu"))
    acc._meta["sums"] = torch.from_numpy(np.ascontiguousarray(sums[:, first:]))
    return acc


def _fold(scores: dict[str, SlotScores], tables: list[TokenTable]) -> None:
    for i, t in enumerate(tables):
        observe(t, scores[f"r{i}"].by_logical(t.token_at, t.seen - 1))


def _timed(fn, repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``fn``, after one untimed warm-up call and a collection (so
    neither path pays for the other's garbage or cold caches)."""
    fn()
    gc.collect()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure(n_req: int, live: int, scope: str, policy: str, generated: int, repeats: int, seed: int) -> dict:
    """One row of the report: old and new step cost (median seconds of ``repeats``) and what they move."""
    cfg = VTokenConfig(policy=policy, scope=scope, budget=0.5)
    prompt = live - generated
    first = min(first_scored(cfg, prompt), live)
    sums = np.random.default_rng(seed).random((n_req, live), dtype=np.float32) / live
    new_acc = _accumulator(n_req, live, first, sums)
    old_acc = _accumulator(n_req, live, 0, sums)
    old_meta = dict(old_acc._meta, kept=[[0]] * n_req, rows=torch.from_numpy(sums.copy()))
    new_tables, old_tables = _tables(cfg, n_req, live, generated), _tables(cfg, n_req, live, generated)
    old_s = _timed(lambda: _fold(legacy_finish(old_meta, old_acc.requests), old_tables), repeats)
    new_s = _timed(lambda: _fold(new_acc.finish(), new_tables), repeats)
    keep = protected_prefix(cfg, prompt)
    same = all(
        np.array_equal(getattr(a, s)[keep:live], getattr(b, s)[keep:live])
        for a, b in zip(new_tables, old_tables)
        for s in STATS
    )
    old_bytes = 2 * sums.nbytes  # sums and a row per query
    new_bytes = sum(int(t.numel()) * 4 for t in new_acc.linear_buffers()[0])
    return {
        "requests": n_req,
        "live_tokens": live,
        "scope": scope,
        "first_scored": first,
        "old_ms": round(old_s * 1e3, 3),
        "new_ms": round(new_s * 1e3, 3),
        "ratio": round(old_s / new_s, 1),
        "readback_bytes_old": old_bytes,
        "readback_bytes_new": new_bytes,
        "same_statistics": bool(same),
    }


def run_score_host(
    policy: str,
    generated: int,
    repeats: int,
    seed: int,
    shapes: tuple[tuple[int, int], ...] = SHAPES,
    scopes: tuple[str, ...] = ("generated", "all"),
    on_row=None,
) -> dict:
    """The report: one row per shape × scope (``measure``); ``on_row(row)`` after each. Pure apart from
    the time it takes."""
    load = [round(x, 2) for x in os.getloadavg()]  # a shared machine: what else ran (1, 5, 15 min)
    rows = []
    for n_req, live in shapes:
        for scope in scopes:
            rows.append(measure(n_req, live, scope, policy, generated, repeats, seed))
            if on_row is not None:
                on_row(rows[-1])
    return {
        "bench": "score-host",
        "command": "vtoken bench score-host " + shlex.join(sys.argv[3:]) if len(sys.argv) > 2 else None,
        "policy": policy,
        "generated": generated,
        "repeats": repeats,
        "what": "median host seconds (after one warm-up call) of one decode step's finish() + by_logical + "
        "observe over host buffers "
        "(no device work, no device→host copy: readback_bytes_* is what that copy moves); old = the "
        "frozen pre-change path (legacy_finish), new = the scored range",
        "rows": rows,
        "load_average": {"before": load, "after": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count()},
    }
