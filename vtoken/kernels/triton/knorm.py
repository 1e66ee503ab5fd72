"""``TritonKeyNorms``: KNorm's statistic for every layer in one Triton launch.

What the runner's torch path computes per layer (``VTokenRunnerMixin._vt_key_norms``: a gather through
``gpu_layout.read_k``, ``float()``, ``norm``, ``mean``, ``+``: about four eager kernels per layer)::

    out[i] = Σ_layers mean_{kv heads} ‖K[layer, slots[i], head, :]‖₂      (fp32, layers in forward order)

here as one launch, grid ``(slots,)``: program i computes slot i's element offsets once (block, offset in
block, the layout's index table or token stride) and walks the layers from the first layer's tensor by
per-layer element offsets (``data_ptr`` differences, as ``TritonSlotMover`` does), loading a ``[kv heads,
head_dim]`` tile of K per layer. Element offsets are int64 (a layer view of vLLM's LHBNC layout exceeds 2^31
elements on an H200-sized cache). CPU tensors run through Triton's interpreter (``kernels.triton.runtime``).

Compiled variants (CUDA): one per model. The slot count changes only the grid; everything else (layout
constexprs, strides, layer count, pointer dtypes and alignment) is fixed per model. ``warmup`` compiles it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton.language as tl

from vtoken.kernels.gpu_layout import PagedLayout, check_view
from vtoken.kernels.moves import unique_caches
from vtoken.kernels.triton.runtime import TritonKernel, next_pow2
from vtoken.kernels.triton.tiles import _SUM


def _key_norm_sum(
    cache_ptr,
    layer_off_ptr,
    slot_ptr,
    out_ptr,
    index_ptr,
    n_layers,
    block_stride,
    head_stride,
    token_stride,
    HEADS: tl.constexpr,
    H_P2: tl.constexpr,
    D: tl.constexpr,
    D_P2: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    STRIDED: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """Program i: out[i] = Σ over the ``n_layers`` layers of the mean over kv heads of the L2 norm of the K
    channels of token ``slot_ptr[i]`` (writes out_ptr[i] only)."""
    i = tl.program_id(0)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    block = slot // BLOCK_SIZE
    off = slot - block * BLOCK_SIZE
    h = tl.arange(0, H_P2)
    d = tl.arange(0, D_P2)[None, :]
    ok = (h[:, None] < HEADS) & (d < D)
    row = block * block_stride + h[:, None].to(tl.int64) * head_stride  # [H_P2, 1]
    if STRIDED:
        row += off * token_stride
        inner = d
    else:
        inner = tl.load(index_ptr + off * WIDTH + d, mask=d < D, other=0)
    total = tl.full([H_P2], 0.0, tl.float32)
    for layer in range(n_layers):  # ALIGN divides every layer offset too: the rows stay 16-byte vectors
        at = tl.multiple_of(tl.load(layer_off_ptr + layer) + row, [ALIGN, ALIGN]) + inner
        k = tl.load(cache_ptr + at, mask=ok, other=0.0).to(tl.float32)
        norms = tl.sqrt(tl.reduce(k * k, 1, _SUM))
        total += tl.where(h < HEADS, norms, 0.0) / HEADS
    tl.store(out_ptr + i, tl.reduce(total, 0, _SUM))


_KNORM = TritonKernel(_key_norm_sum)
KERNELS = {"_key_norm_sum": _KNORM}  # by name, for the device check's compiled-variant counts


class TritonKeyNorms:
    """KNorm's per-slot statistic over every layer (module doc) for one ``PagedLayout``; CUDA tensors
    compiled, CPU tensors interpreted. Keeps the layer offsets and the index table of the last set of layer
    tensors (rebuilt when their addresses change)."""

    def __init__(self, layout: PagedLayout) -> None:
        self.layout = layout
        self._key: tuple | None = None
        self._first: torch.Tensor | None = None
        self._offsets: torch.Tensor | None = None
        self._index: torch.Tensor | None = None
        self._constexprs: dict = {}

    def _prepare(self, kv_caches: Sequence[torch.Tensor]) -> None:
        """Check the layer tensors agree with the layout and each other (``ValueError`` otherwise); keep their
        element offsets from the first one. Idempotent for the same tensors."""
        caches = unique_caches(kv_caches)
        key = tuple(kv.data_ptr() for kv in caches)
        if key == self._key:
            return
        first, lay = caches[0], self.layout
        for kv in caches:
            if kv.shape != first.shape or kv.stride() != first.stride() or kv.dtype != first.dtype:
                raise ValueError("TritonKeyNorms: the layer caches differ in shape, strides or dtype")
            if kv.device != first.device:
                raise ValueError("TritonKeyNorms: the layer caches are on different devices")
        check_view(first, lay)
        esize = first.element_size()
        deltas = [kv.data_ptr() - first.data_ptr() for kv in caches]
        if any(d % esize for d in deltas):
            raise ValueError("TritonKeyNorms: layer tensors are not element-aligned with each other")
        self._first = first
        self._offsets = torch.tensor([d // esize for d in deltas], dtype=torch.int64, device=first.device)
        self._index = lay.index.to(device=first.device, dtype=torch.int32)
        self._constexprs = dict(
            HEADS=lay.num_kv_heads,
            H_P2=next_pow2(lay.num_kv_heads),
            D=lay.head_dim,
            D_P2=max(16, next_pow2(lay.head_dim)),
            WIDTH=lay.width,
            BLOCK_SIZE=lay.block_size,
            STRIDED=lay.token_stride is not None,
            ALIGN=math.gcd(16, lay.block_stride, lay.head_stride, lay.token_stride or 1, *(d // esize for d in deltas)),
        )
        self._key = key

    def sum(self, kv_caches: Sequence[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
        """``[len(slots)]`` fp32 on the caches' device: Σ over the distinct layer tensors (in order) of the
        mean over kv heads of each slot's key L2 norm. ``slots``: physical slots (any integer dtype, any
        device). One launch; asynchronous on CUDA. Pure apart from the cached offsets."""
        self._prepare(kv_caches)
        first, lay = self._first, self.layout
        slots = slots.to(device=first.device, dtype=torch.int64)
        out = torch.empty(slots.numel(), dtype=torch.float32, device=first.device)
        if slots.numel():
            _KNORM.launch(
                first.device,
                (slots.numel(),),
                first,
                self._offsets,
                slots,
                out,
                self._index,
                int(self._offsets.numel()),
                lay.block_stride,
                lay.head_stride,
                lay.token_stride or 0,
                **self._constexprs,
            )
        return out

    def warmup(self, kv_caches: Sequence[torch.Tensor]) -> None:
        """Compile (CUDA) the one variant: a launch over slot 0, which only reads the cache (writes a scratch
        output). Call once at start-up, outside graph capture."""
        first = unique_caches(kv_caches)[0]
        self.sum(kv_caches, torch.zeros(1, dtype=torch.int64, device=first.device))
