"""A plain paged *decode* attention in Triton: the yardstick for the score kernels' cost (``gpu_check``).

Not used by the engine (vLLM's own kernels run the model). One program per (request, kv head): its query
heads as one tile, an online softmax over the row's keys read through the block table and the cache's
``PagedLayout`` (the score kernels' tile loaders, ``kernels.triton.tiles``), ``out = softmax(q·Kᵀ·scale)·V``.
``paged_decode_reference`` is the torch version it is tested against. Pure apart from writing ``out``.
"""

from __future__ import annotations

import torch
import triton.language as tl

from vtoken.kernels.gpu_layout import PagedLayout, read_kv
from vtoken.kernels.scores import row_slots
from vtoken.kernels.triton.runtime import TritonKernel
from vtoken.kernels.triton.tiles import (
    _MAX,
    _SUM,
    TILE_HELPERS,
    _kv_load,
    _kv_rows,
    _logits,
    _query_tile,
    tile_constexprs,
)


def _paged_decode(
    q_ptr,
    q_st,
    q_sh,
    cache_ptr,
    bt_ptr,
    bt_stride,
    index_ptr,
    seq_ptr,
    out_ptr,
    o_st,
    o_sh,
    block_stride,
    head_stride,
    token_stride,
    scale,
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
    """Program (r, g): out[r, heads of group g] for request r's single query over its seq_len keys."""
    r = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    seq = tl.load(seq_ptr + r)
    q = _query_tile(q_ptr, q_st, q_sh, r, g, GROUP, G_P2, D, D_P2, cache_ptr.dtype.element_ty, Q_ALIGN)
    m = tl.full([G_P2], float("-inf"), tl.float32)
    den = tl.full([G_P2], 0.0, tl.float32)
    acc = tl.full([G_P2, D_P2], 0.0, tl.float32)
    for start in range(0, seq, BLOCK_N):
        kv_row, off, pos, valid = _kv_rows(
            bt_ptr, r, g, start, seq, block_stride, head_stride, bt_stride, BLOCK_SIZE, BLOCK_N
        )
        k = _kv_load(cache_ptr, index_ptr, kv_row, off, valid, token_stride, D, D_P2, WIDTH, STRIDED, ALIGN, 0)
        v = _kv_load(cache_ptr, index_ptr, kv_row, off, valid, token_stride, D, D_P2, WIDTH, STRIDED, ALIGN, D)
        s = _logits(q, k, 1.0, UPCAST, PRECISION) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.reduce(s, 1, _MAX))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        den = den * alpha + tl.reduce(p, 1, _SUM)
        if UPCAST:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m = m_new
    h = tl.arange(0, G_P2)[:, None]
    d = tl.arange(0, D_P2)[None, :]
    out = acc / den[:, None]
    tl.store(
        out_ptr + r * o_st + (g * GROUP + h).to(tl.int64) * o_sh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=(h < GROUP) & (d < D),
    )


_DECODE = TritonKernel(_paged_decode, helpers=TILE_HELPERS)


def paged_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layout: PagedLayout,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    block_n: int = 32,
) -> None:
    """``out[r] = attention of query[r]`` (``[R, Hq, D]``) over request r's ``seq_lens[r]`` keys (writes
    ``out``). ``block_table``: int32 ``[R, max_blocks]``; ``seq_lens``: int32 ``[R]``; all on the cache's
    device (no host copies: capturable in a CUDA graph)."""
    _DECODE.launch(
        kv_cache.device,
        (query.shape[0], layout.num_kv_heads),
        query,
        query.stride(0),
        query.stride(1),
        kv_cache,
        block_table,
        block_table.stride(0),
        layout.index,
        seq_lens,
        out,
        out.stride(0),
        out.stride(1),
        layout.block_stride,
        layout.head_stride,
        layout.token_stride or 0,
        float(scale),
        **tile_constexprs(layout, query, kv_cache, block_n),
    )


def paged_decode_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layout: PagedLayout,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The same in torch (fp32), one request at a time: ``[R, Hq, D]`` float32 (pure)."""
    outs = []
    for r in range(query.shape[0]):
        slots = row_slots(block_table[r].to(torch.int64), int(seq_lens[r]), layout.block_size)
        k, v = read_kv(kv_cache, layout, slots)
        group = query.shape[1] // layout.num_kv_heads
        k = k.float().repeat_interleave(group, dim=1)
        v = v.float().repeat_interleave(group, dim=1)
        p = torch.softmax(torch.einsum("hd,khd->hk", query[r].float(), k) * scale, dim=-1)
        outs.append(torch.einsum("hk,khd->hd", p, v))
    return torch.stack(outs)
