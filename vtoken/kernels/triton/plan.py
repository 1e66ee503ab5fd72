"""A step's launch metadata for the score kernels (``kernels.triton.scores``), built once per step, reused by every
layer.

``plan_step`` turns the step's scored requests into per-query int32 tables (token, request, visible keys,
kept row, first scored position: numpy, no per-query Python loop), the padded int32 block table, the split
of the key range (``kernels.triton.softmax.plan_splits``) and the zeroed ``sums``/``rows`` buffers, on the device in
two host→device copies (the five query tables share one buffer). ``launch_state`` adds, once per step and
query/cache kind, what the launches need beyond the query and the layer's cache: the constexprs, the layout's
index table on the device and the ``m``/``l`` buffers (overwritten by each layer's stats launch before its
``_probs`` launch reads them: stream order).

Invariant: every table's first element is 16-byte aligned, like a fresh torch allocation: ``triton.jit``
specialises pointers on 16-byte divisibility, so a misaligned table would compile another variant.
"""

from __future__ import annotations

import numpy as np
import torch

from vtoken.kernels.gpu_layout import PagedLayout
from vtoken.kernels.scores import RequestScores
from vtoken.kernels.triton.softmax import SplitPlan, plan_splits
from vtoken.kernels.triton.tiles import tile_constexprs
from vtoken.policies.context import HISTORY_BITS, OBSERVATION_WINDOW

NO_ROW = -1  # a query whose probabilities no kept row records (q_row)
QUERY_FIELDS = ("tok", "req", "vis", "row", "first")  # the per-query int32 tables, in their buffer's order
_INTS_PER_16_BYTES = 4


def kept_queries(rs: RequestScores) -> list[int]:
    """Query indices whose rows ``finish`` needs: the last ≤ ``HISTORY_BITS`` and SnapKV's window; none for
    a single query (its row is bit-identical to the request's sums, which ``finish`` reads instead) (pure)."""
    if rs.n_q == 1:
        return []
    keep = set(range(max(0, rs.n_q - HISTORY_BITS), rs.n_q))
    if rs.window:
        keep.update(range(max(rs.window - OBSERVATION_WINDOW, 0), rs.window))
    return sorted(keep)


def query_tables(scored: list[RequestScores]) -> tuple[np.ndarray, list[list[int]], int]:
    """``(tables, kept, n_rows)``: ``tables`` int32 ``[len(QUERY_FIELDS), queries]`` in the step's query
    order (request by request), ``kept`` each request's ``kept_queries``, ``n_rows`` their total; a kept
    query's ``row`` numbers the rows request by request, the others' are ``NO_ROW``. Pure."""
    n_q = np.array([rs.n_q for rs in scored], dtype=np.int64)
    q0 = np.array([rs.q_start for rs in scored], dtype=np.int64)
    seq = np.array([rs.seq_len for rs in scored], dtype=np.int64)
    first = np.array([rs.first for rs in scored], dtype=np.int64)
    starts = np.cumsum(n_q) - n_q
    req = np.repeat(np.arange(len(scored)), n_q)
    qi = np.arange(int(n_q.sum())) - starts[req]
    row = np.full(qi.shape, NO_ROW, dtype=np.int64)
    kept, n_rows = [], 0
    for r, rs in enumerate(scored):
        keep = kept_queries(rs)
        if keep:
            row[starts[r] + np.array(keep)] = n_rows + np.arange(len(keep))
        n_rows += len(keep)
        kept.append(keep)
    tables = np.stack([q0[req] + qi, req, (seq - n_q)[req] + qi + 1, row, first[req]]).astype(np.int32)
    return tables, kept, n_rows


def device_meta(
    device: torch.device, tables: np.ndarray, bt: torch.Tensor, kmax: int, n_rows: int, split: SplitPlan
) -> dict:
    """The launch metadata on ``device``: the ``QUERY_FIELDS`` tables by name (int32 views of one buffer,
    each row starting 16-byte aligned), the int32 block table ``bt``, zeroed fp32 ``sums`` ``[requests,
    kmax]`` (``kmax``: the longest scored range) and ``rows`` ``[n_rows, kmax]`` (``[1, 1]``, never written,
    without kept rows; ``n_rows`` records how many), the key ``split`` (new tensors; pure)."""
    n = tables.shape[1]
    packed = torch.zeros(len(QUERY_FIELDS), -(-max(n, 1) // _INTS_PER_16_BYTES) * _INTS_PER_16_BYTES, dtype=torch.int32)
    packed[:, :n] = torch.from_numpy(np.ascontiguousarray(tables, dtype=np.int32))
    on = _to_device(packed, device)
    return dict(
        {name: on[f, :n] for f, name in enumerate(QUERY_FIELDS)},
        bt=_to_device(bt, device),
        kmax=kmax,
        n_rows=n_rows,
        split=split,
        sums=torch.zeros(bt.shape[0], kmax, device=device),
        rows=torch.zeros(n_rows or 1, kmax if n_rows else 1, device=device),
    )


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """CUDA: through pinned memory, so planning never waits for the stream."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def plan_step(
    scored: list[RequestScores], device: torch.device, block_n: int, split_keys: int, max_splits: int
) -> dict:
    """``device_meta`` of a step's scored requests, plus ``kept`` (each request's kept queries) and
    ``scored`` (the requests, in buffer order). The split follows the longest visible length (every key,
    not only the scored range: m and l cover them all). Pure apart from the copies."""
    tables, kept, n_rows = query_tables(scored)
    blocks = [rs.block_row.to("cpu", torch.int32).reshape(-1) for rs in scored]
    bt = torch.zeros(len(scored), max(int(t.numel()) for t in blocks), dtype=torch.int32)
    for r, t in enumerate(blocks):
        bt[r, : t.numel()] = t
    kmax = max(max(rs.seq_len - rs.first for rs in scored), 1)
    split = plan_splits(max(rs.seq_len for rs in scored), block_n, split_keys, max_splits)
    return dict(device_meta(device, tables, bt, kmax, n_rows, split), kept=kept, scored=scored)


def launch_state(meta: dict, layout: PagedLayout, query: torch.Tensor, kv_cache: torch.Tensor, block_n: int) -> dict:
    """What the score launches need beyond the layer's query and cache, built on the first layer of a kind
    (query shape, strides and dtype; cache dtype and device) and kept in ``meta["launch"]`` (mutates
    ``meta``): ``constexprs``, ``index`` (the layout's int32 index table on the cache's device),
    ``parts``/``out`` (the ``m``/``l`` buffers: ``[queries, splits, HQ]`` partials, ``[queries, HQ]``
    merged; the same tensors when there is one split). ``query``: ``[T, H, D]`` with unit last stride."""
    heads, d = query.shape[1], query.shape[2]
    key = (heads, d, query.stride(0), query.stride(1), query.dtype, kv_cache.dtype, kv_cache.device)
    states = meta.setdefault("launch", {})
    if key not in states:
        dev, nq, splits = kv_cache.device, int(meta["tok"].numel()), meta["split"].splits
        parts = tuple(torch.empty(nq, splits, heads, dtype=torch.float32, device=dev) for _ in range(2))
        out = (parts[0][:, 0], parts[1][:, 0]) if splits == 1 else tuple(torch.empty_like(p[:, 0]) for p in parts)
        constexprs = dict(HQ=heads, **tile_constexprs(layout, query, kv_cache, block_n))
        index = layout.index.to(device=dev, dtype=torch.int32)
        states[key] = dict(constexprs=constexprs, index=index, parts=parts, out=out)
    return states[key]
