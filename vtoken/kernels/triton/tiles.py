"""The score kernels' tile loaders (``kernels.triton.scores``, ``.softmax``, ``.attention``): a key or value
tile of a request's row through its block table and the cache's ``PagedLayout``, a query token's heads of
one kv group, and their logits. Plain functions: ``TritonKernel`` wraps them as helpers of each kernel
that calls them (``TILE_HELPERS``; compiled and interpreted, ``kernels.triton.runtime``). Pure (loads only).
``tile_constexprs``: the constexprs they take, from the layout, query and cache (host side, pure)."""

from __future__ import annotations

import math

import torch
import triton.language as tl

from vtoken.kernels.gpu_layout import PagedLayout
from vtoken.kernels.triton.runtime import next_pow2

# Triton's own combine functions: tl.reduce with them is tl.sum / tl.max, and the interpreter maps them to
# numpy; tl.sum, tl.max and tl.zeros themselves are @jit functions that an interpreted kernel cannot call
# unless TRITON_INTERPRET was set before triton was imported (kernels.triton.runtime).
_SUM = tl.standard._sum_combine
_MAX = tl.standard._elementwise_max


def _kv_rows(bt_ptr, req, g, start, vis, block_stride, head_stride, bt_stride, BLOCK_SIZE, BLOCK_N):
    """Where row positions start..start+BLOCK_N-1 of request ``req``, kv head ``g``, lie: their tokens'
    element offset (int64 ``[BLOCK_N, 1]``, through the block table), offset within their block (int64
    ``[BLOCK_N, 1]``), positions and validity (below ``vis``). Int64 because a layer view of vLLM's LHBNC
    layout exceeds 2^31 elements on an H200-sized cache: ``g * head_stride`` alone does, and Triton passes
    a stride below 2^31 as int32. Loads the block table only."""
    pos = start + tl.arange(0, BLOCK_N)
    valid = pos < vis
    blk = tl.load(bt_ptr + req.to(tl.int64) * bt_stride + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    off = (pos % BLOCK_SIZE).to(tl.int64)[:, None]
    row = blk[:, None] * block_stride + g * head_stride.to(tl.int64)  # g: a Python int when interpreted
    return row, off, pos, valid


def _kv_load(cache_ptr, index_ptr, row, off, valid, token_stride, D, D_P2, WIDTH, STRIDED, ALIGN, C0):
    """Keys (C0 = 0) or values (C0 = D) of the tokens ``_kv_rows`` located: ``[BLOCK_N, D_P2]`` (0 where not
    ``valid`` or beyond D). Loads only."""
    d = tl.arange(0, D_P2)[None, :]
    kmask = valid[:, None] & (d < D)
    if STRIDED:  # [ALIGN, ALIGN], not [ALIGN, 1]: every element is a multiple of ALIGN, along the size-1
        # dim too; triton 3.6 takes dim 1's divisibility from the hint and with 1 loaded the keys element by
        # element (ld.global.b16, no cp.async pipelining); 3.9 vectorised either way (test_triton_compile)
        at = tl.multiple_of(row + off * token_stride, [ALIGN, ALIGN]) + C0 + d
    else:
        at = row + tl.load(index_ptr + off * WIDTH + C0 + d, mask=kmask, other=0)
    return tl.load(cache_ptr + at, mask=kmask, other=0.0)


def _query_tile(q_ptr, q_st, q_sh, t, g, GROUP, G_P2, D, D_P2, dtype, Q_ALIGN):
    """Query token ``t``'s heads of kv group ``g``: ``[G_P2, D_P2]`` (0 beyond GROUP or D); int64 offsets.
    Q_ALIGN divides q_st (16-byte vector loads although q_st itself is not specialised)."""
    h = tl.arange(0, G_P2)[:, None]
    d = tl.arange(0, D_P2)[None, :]
    at = tl.multiple_of(t.to(tl.int64) * q_st, Q_ALIGN) + (g * GROUP + h).to(tl.int64) * q_sh
    q = tl.load(q_ptr + at + d, mask=(h < GROUP) & (d < D), other=0.0)
    return q.to(dtype)


def _logits(q, k, scale, UPCAST, PRECISION):
    if UPCAST:  # Triton 3.9's interpreter returns garbage from a bf16 tl.dot: CPU tensors go through fp32
        return tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
    return tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale


# what a kernel that calls the tile loaders passes as its TritonKernel helpers
TILE_HELPERS = (_kv_rows, _kv_load, _query_tile, _logits)


def tile_constexprs(layout: PagedLayout, query: torch.Tensor, kv_cache: torch.Tensor, block_n: int) -> dict:
    """The tile loaders' constexprs for ``query`` (``[T, H, D]``, unit last stride) over ``kv_cache`` in
    ``layout``: query heads per kv group and its padded tile height, head dim and its padding, the layout's
    width, block size, strides' alignment and ``STRIDED``, the key tile ``block_n``, the dot's precision
    (``ieee`` for fp32), ``UPCAST`` on CPU (the interpreter) and the query strides' alignment. Pure."""
    group = query.shape[1] // layout.num_kv_heads
    d = query.shape[2]
    return dict(
        GROUP=group,
        G_P2=max(16, next_pow2(group)),
        D=d,
        D_P2=max(16, next_pow2(d)),
        WIDTH=layout.width,
        BLOCK_SIZE=layout.block_size,
        BLOCK_N=block_n,
        STRIDED=layout.token_stride is not None,
        PRECISION="ieee" if kv_cache.dtype == torch.float32 else "tf32",
        UPCAST=kv_cache.device.type == "cpu",
        ALIGN=math.gcd(16, layout.block_stride, layout.head_stride, layout.token_stride or 1),
        Q_ALIGN=math.gcd(16, query.stride(0), query.stride(1)),
    )
