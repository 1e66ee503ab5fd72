"""Row max ``m`` and normaliser ``l`` of every (query, head) of a step, split over key ranges.

``softmax(s)_k = exp(s_k - m) / l`` with ``m = max_k s_k`` and ``l = Σ_k exp(s_k - m)`` over a query's
visible keys. One program per (query, kv head) alone walks all of a query's keys: at batch 1 and 32k keys
that is a handful of programs, so a handful of SMs. Flash-decoding's split instead:

    _softmax_stats  grid (queries, kv heads, splits): program (i, g, s) runs the online softmax over key
                    positions [s·chunk, min((s+1)·chunk, vis_i)) only → partial m_s, l_s (m_s = -inf,
                    l_s = 0 for a range past the query's keys: a request shorter than one split)
    _softmax_merge  grid (queries,): m = max_s m_s, l = Σ_s l_s·exp(m_s − m) (terms with m_s = -inf are 0)

``plan_splits`` picks the split count from the step's longest visible length: ``1`` (no merge launch, the
partials are the result, bit-identical to the unsplit kernel) up to ``split_keys`` keys, then one split
per ``split_keys`` keys up to ``max_splits`` (longer ranges get longer chunks). ``chunk`` is a multiple of
the key tile, so a split's tiles never straddle two splits.

Compiled variants (CUDA): ``chunk`` (stats) and ``splits`` (merge) change with the step and are not
specialised (``do_not_specialize``), so each kernel compiles one variant per model, as ``_probs`` does
(``kernels.triton.scores`` module doc). Not for ``import *``: the kernels are plain functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

from vtoken.kernels.triton.runtime import TritonKernel
from vtoken.kernels.triton.tiles import _MAX, _SUM, TILE_HELPERS, _kv_load, _kv_rows, _logits, _query_tile


def _softmax_stats(
    q_ptr,
    q_st,
    q_sh,
    cache_ptr,
    bt_ptr,
    bt_stride,
    index_ptr,
    q_tok,
    q_req,
    q_vis,
    m_ptr,
    l_ptr,
    chunk,
    block_stride,
    head_stride,
    token_stride,
    scale,
    HQ: tl.constexpr,
    GROUP: tl.constexpr,
    G_P2: tl.constexpr,
    D: tl.constexpr,
    D_P2: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STRIDED: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    ALIGN: tl.constexpr,
    Q_ALIGN: tl.constexpr,
):
    """Program (i, g, s): partial m and l of query i's heads in kv group g over key positions
    [s·chunk, min((s+1)·chunk, vis)) (writes m_ptr/l_ptr[i, s, heads] of a [queries, splits, HQ] buffer)."""
    i = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)
    t = tl.load(q_tok + i).to(tl.int64)
    req = tl.load(q_req + i).to(tl.int64)
    lo = s * chunk
    hi = tl.minimum(lo + chunk, tl.load(q_vis + i))
    q = _query_tile(q_ptr, q_st, q_sh, t, g, GROUP, G_P2, D, D_P2, cache_ptr.dtype.element_ty, Q_ALIGN)
    m = tl.full([G_P2], float("-inf"), tl.float32)
    den = tl.full([G_P2], 0.0, tl.float32)
    for start in range(lo, hi, BLOCK_N):  # interpreted: range() calls the bounds' __index__ (kernels.triton.runtime)
        kv_row, off, pos, valid = _kv_rows(
            bt_ptr, req, g, start, hi, block_stride, head_stride, bt_stride, BLOCK_SIZE, BLOCK_N
        )
        k = _kv_load(cache_ptr, index_ptr, kv_row, off, valid, token_stride, D, D_P2, WIDTH, STRIDED, ALIGN, 0)
        x = _logits(q, k, scale, UPCAST, PRECISION)
        x = tl.where(valid[None, :], x, float("-inf"))
        m_new = tl.maximum(m, tl.reduce(x, 1, _MAX))
        den = den * tl.exp(m - m_new) + tl.reduce(tl.exp(x - m_new[:, None]), 1, _SUM)
        m = m_new
    h = tl.arange(0, G_P2)
    at = (i.to(tl.int64) * tl.num_programs(2) + s) * HQ + g * GROUP + h
    tl.store(m_ptr + at, m, mask=h < GROUP)
    tl.store(l_ptr + at, den, mask=h < GROUP)


def _softmax_merge(mp_ptr, lp_ptr, m_ptr, l_ptr, splits, HQ: tl.constexpr, HQ_P2: tl.constexpr):
    """Program i: query i's m = max_s m_s and l = Σ_s l_s·exp(m_s − m) from the [queries, splits, HQ]
    partials (a split that saw no key, m_s = -inf and l_s = 0, adds 0; when no split saw one, m = -inf and
    l = 0, as the unsplit kernel gives)."""
    i = tl.program_id(0)
    h = tl.arange(0, HQ_P2)
    ok = h < HQ
    base = i.to(tl.int64) * splits * HQ + h
    m = tl.full([HQ_P2], float("-inf"), tl.float32)
    for s in range(splits):
        m = tl.maximum(m, tl.load(mp_ptr + base + s * HQ, mask=ok, other=0.0))
    m_ref = tl.where(m > float("-inf"), m, 0.0)  # m = -inf: no split saw a key (every l_s = 0): no -inf - -inf
    den = tl.full([HQ_P2], 0.0, tl.float32)
    for s in range(splits):  # exp(-inf - m_ref) = 0 for a split past the query's keys (its l_s is 0 too)
        den += tl.load(lp_ptr + base + s * HQ, mask=ok, other=0.0) * tl.exp(
            tl.load(mp_ptr + base + s * HQ, mask=ok, other=0.0) - m_ref
        )
    tl.store(m_ptr + i * HQ + h, m, mask=ok)
    tl.store(l_ptr + i * HQ + h, den, mask=ok)


_STATS = TritonKernel(_softmax_stats, helpers=TILE_HELPERS, do_not_specialize=("q_st", "bt_stride", "chunk"))
_MERGE = TritonKernel(_softmax_merge, do_not_specialize=("splits",))


@dataclass(frozen=True)
class SplitPlan:
    """How a step's keys are split: ``splits`` ranges of ``chunk`` positions (a multiple of the key tile)."""

    splits: int
    chunk: int


def plan_splits(longest: int, block_n: int, split_keys: int, max_splits: int) -> SplitPlan:
    """The split of a step whose longest query sees ``longest`` keys (module doc). Pure. Raises
    ``ValueError`` unless ``split_keys`` and ``max_splits`` are ≥ 1."""
    if split_keys < 1 or max_splits < 1:
        raise ValueError(f"plan_splits: split_keys {split_keys} and max_splits {max_splits} must be >= 1")
    tiles = max(-(-max(longest, 1) // block_n), 1)
    splits = min(max(-(-max(longest, 1) // split_keys), 1), max_splits, tiles)
    chunk_tiles = -(-tiles // splits)
    return SplitPlan(-(-tiles // chunk_tiles), chunk_tiles * block_n)


def launch_softmax_stats(
    device: torch.device,
    split: SplitPlan,
    kv_heads: int,
    head_args: tuple,
    tail_args: tuple,
    parts: tuple[torch.Tensor, torch.Tensor],
    out: tuple[torch.Tensor, torch.Tensor],
    constexprs: dict,
    merge: bool = False,
) -> None:
    """``m`` and ``l`` of every (query, head) into ``out`` (``[queries, HQ]`` fp32 each): the split stats
    launch, into ``parts`` (``[queries, splits, HQ]`` fp32 each; may be ``out`` itself when ``splits`` is 1),
    then the merge launch when ``splits > 1`` or ``merge`` (the warm-up compiles it so). ``head_args``:
    query … q_vis of ``_softmax_stats``; ``tail_args``: strides and scale. Mutates ``parts`` and ``out``;
    asynchronous on CUDA."""
    nq = int(parts[0].shape[0])
    _STATS.launch(device, (nq, kv_heads, split.splits), *head_args, *parts, split.chunk, *tail_args, **constexprs)
    if split.splits > 1 or merge:
        hq = constexprs["HQ"]
        _MERGE.launch(device, (nq,), *parts, *out, split.splits, HQ=hq, HQ_P2=max(16, 1 << (hq - 1).bit_length()))
