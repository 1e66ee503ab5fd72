"""The KV cache layouts of vLLM 0.32's CUDA attention backends, as one ``PagedLayout``, and torch references.

Read from the installed vLLM 0.32 (not guessed; the pre-0.3x ``get_kv_cache_shape`` /
``get_kv_cache_stride_order`` hooks the GPU issue names no longer exist on these backends):

* every attention layer gets one 4-D *logical* view ``[B, H, N, C]`` (blocks, kv heads, tokens of a block,
  content) with ``C = head_size + head_size_v`` elements: the K channels, then the V channels
  (``vllm/v1/kv_cache_interface.py``: ``compute_layer_kv_cache_shape_bytes``, ``create_kv_cache_views``);
* the *physical* order is one ``KVCacheLayout`` for the whole model, a permutation of the 5-D logical
  ``[L, B, H, N, C]`` (``vllm/v1/kv_cache_layout.py``); ``KVCacheTensor`` gives each layer its
  ``layer_stride`` / ``block_stride`` (``vllm/v1/core/kv_cache_utils.py``:
  ``get_kv_cache_config_from_groups``; block-outer layouts interleave all layers' pages of a block);
* the engine core resolves it once (``vllm/v1/attention/backends/utils.py``: ``resolve_kv_cache_layout``,
  ``_DEFAULT_LAYOUT_PREFERENCE`` = LBNHC first) from the backends' ``supported_kv_cache_layouts()``:
  ``FlashAttentionBackend`` and ``TritonAttentionBackend`` declare none (so LBNHC), ``FlashInferBackend``
  declares none on SM90 (H200: LBNHC) and ``(LBHNC, BLHNC)`` on SM100; ``VLLM_KV_CACHE_LAYOUT`` may pick
  any other supported one;
* every backend splits the view the same way: ``key_cache, value_cache =
  kv_cache.transpose(1, 2).split(head_size, dim=-1)`` → two ``[B, N, H, D]`` views
  (``flash_attn.py``: ``FlashAttentionImpl.forward`` / ``do_kv_cache_update``; ``triton_attn.py``:
  ``TritonAttentionImpl.forward`` / ``do_kv_cache_update``; ``flashinfer.py``: ``FlashInferImpl.forward``
  (``kv_cache.permute(*layout.layer_view_order).split(head_size, -1)``) / ``do_kv_cache_update``).
  So K and V of one token are *not* separate halves of a ``[2, …]`` tensor any more: they share the C row.

``PagedLayout`` states where channel ``c`` (``0..D-1`` K, ``D..2D-1`` V) of kv head ``h`` of the token at
(block ``b``, offset ``o``) lives, in elements from the layer view's start::

    b * block_stride + h * head_stride + index[o, c]

    LBNHC (flash_attn / triton_attn / flashinfer on an H200), H = 2, D = 2, block_size = 2; one block:
    [t0h0: k0 k1 v0 v1 | t0h1: k0 k1 v0 v1 | t1h0: k0 k1 v0 v1 | t1h1: k0 k1 v0 v1]
    block_stride = 16 (× layers for BL* layouts), head_stride = 4, index[o, c] = 8 * o + c

The CPU backend's ``TokenLayout`` (probed ISA packing, K transposed) is the same form with ``block_stride =
H * 2BD``, ``head_stride = 2BD`` (``paged_layout(view, token_layout=…)``). Pure module: torch only, no vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vtoken.kernels.layout import TokenLayout
from vtoken.kernels.moves import unique_caches
from vtoken.kernels.scores import ScoreAccumulator

# vllm/v1/kv_cache_layout.py, KVCacheLayout: physical order of the logical axes [L, B, H, N, C]
KV_CACHE_LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
# What each CUDA backend resolves to on an H200 (SM90) with VLLM_KV_CACHE_LAYOUT unset (see above).
BACKEND_LAYOUTS: dict[str, str] = {"flash_attn": "LBNHC", "triton_attn": "LBNHC", "flashinfer": "LBNHC"}
LAYOUT_NAMES: tuple[str, ...] = ("cpu", *BACKEND_LAYOUTS, *KV_CACHE_LAYOUTS)


@dataclass(frozen=True)
class PagedLayout:
    """Element offsets of every (token, kv head, channel) of one layer's paged cache view (see module doc)."""

    name: str
    block_size: int
    num_kv_heads: int
    head_dim: int
    block_stride: int
    head_stride: int
    index: torch.Tensor  # int64 [block_size, 2*head_dim]: K channels then V channels
    token_stride: int | None = None  # set when index[o, c] == o * token_stride + c (kernels compute it)

    @property
    def width(self) -> int:
        return 2 * self.head_dim

    def to(self, device: torch.device | str) -> PagedLayout:
        return PagedLayout(
            self.name,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
            self.block_stride,
            self.head_stride,
            self.index.to(device),
            self.token_stride,
        )


def paged_layout(view: torch.Tensor, name: str = "", token_layout: TokenLayout | None = None) -> PagedLayout:
    """The layout of one layer's logical ``[B, H, N, 2D]`` view (pure). Strides give block, head and token
    offsets; ``token_layout`` (the CPU backend's probed interior) replaces the token/channel part."""
    _, heads, bs, width = view.shape
    sb, sh, sn, sc = view.stride()
    if token_layout is not None:
        if token_layout.block_size != bs or token_layout.region != bs * width:
            raise ValueError("paged_layout: the token layout does not match the view's block")
        return PagedLayout(name or "cpu", bs, heads, width // 2, sb, sh, token_layout.index.to(view.device))
    o = torch.arange(bs, device=view.device).unsqueeze(1)
    c = torch.arange(width, device=view.device).unsqueeze(0)
    return PagedLayout(name, bs, heads, width // 2, sb, sh, (o * sn + c * sc).to(torch.int64), sn if sc == 1 else None)


def allocate_kv_caches(
    name: str,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> list[torch.Tensor]:
    """Per-layer ``[B, H, N, 2D]`` views exactly as vLLM 0.32 builds them for layout ``name`` (zeros; one
    backing buffer for all layers, like ``create_kv_cache_views``); ``cpu``: one tensor per layer (CPU
    worker). Raises ``ValueError`` naming an unknown layout."""
    if name == "cpu":
        return [
            torch.zeros(num_blocks, num_kv_heads, block_size, 2 * head_dim, dtype=dtype, device=device)
            for _ in range(num_layers)
        ]
    order = KV_CACHE_LAYOUTS.get(BACKEND_LAYOUTS.get(name, name))
    if order is None:
        raise ValueError(f"unknown KV layout {name!r}; valid: {', '.join(LAYOUT_NAMES)}")
    logical = (num_layers, num_blocks, num_kv_heads, block_size, 2 * head_dim)
    raw = torch.zeros([logical[d] for d in order], dtype=dtype, device=device)
    inverse = [order.index(d) for d in range(5)]
    five = raw.permute(*inverse)  # logical [L, B, H, N, C] with the layout's physical strides
    return [five[layer] for layer in range(num_layers)]


def layout_for(name: str, view: torch.Tensor) -> PagedLayout:
    """The ``PagedLayout`` of a view from ``allocate_kv_caches(name, …)`` (``cpu``: the vec ISA's)."""
    if name == "cpu":
        return paged_layout(view, "cpu", TokenLayout.cpu_vec(view.shape[2], view.shape[3] // 2))
    return paged_layout(view, name)


def backend_kv_views(view: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key_cache, value_cache)``, each ``[B, N, H, D]``, exactly as vLLM 0.32's CUDA backends split a layer
    view (flash_attn.py / triton_attn.py / flashinfer.py ``do_kv_cache_update``). Views, no copy."""
    return view.transpose(1, 2).split(head_dim, dim=-1)


# ---------------------------------------------------------------- torch reference on any PagedLayout
def _storage(view: torch.Tensor) -> torch.Tensor:
    """A 1-D view of every element the layer view can reach, from its first one (aliases ``view``)."""
    extent = 1 + sum((n - 1) * s for n, s in zip(view.shape, view.stride()))
    return view.as_strided((extent,), (1,), view.storage_offset())


def element_offsets(layout: PagedLayout, slots: torch.Tensor) -> torch.Tensor:
    """``[n, H, 2D]`` element offsets of the tokens at physical ``slots`` (pure)."""
    slots = slots.to(torch.int64)
    blocks = torch.div(slots, layout.block_size, rounding_mode="floor")
    inner = layout.index[slots - blocks * layout.block_size]  # [n, 2D]
    heads = torch.arange(layout.num_kv_heads, device=slots.device) * layout.head_stride
    return (blocks * layout.block_stride)[:, None, None] + heads[None, :, None] + inner[:, None, :]


def gather(view: torch.Tensor, layout: PagedLayout, slots: torch.Tensor) -> torch.Tensor:
    """Every element of the tokens at ``slots``: ``[n, H, 2D]`` (a copy; pure)."""
    return _storage(view)[element_offsets(layout, slots.to(view.device))]


def scatter(view: torch.Tensor, layout: PagedLayout, slots: torch.Tensor, values: torch.Tensor) -> None:
    """Inverse of ``gather`` (mutates ``view``)."""
    _storage(view)[element_offsets(layout, slots.to(view.device))] = values


def read_kv(view: torch.Tensor, layout: PagedLayout, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the tokens at ``slots``, each ``[n, H, D]`` (pure)."""
    vals = gather(view, layout, slots)
    return vals[..., : layout.head_dim], vals[..., layout.head_dim :]


def key_offsets(layout: PagedLayout, slots: torch.Tensor) -> torch.Tensor:
    """``[n, H, D]`` element offsets of the K channels of the tokens at ``slots``: the same for every layer
    view of ``layout``, so a caller reading many layers computes them once (pure)."""
    return element_offsets(layout, slots)[..., : layout.head_dim]


def read_k(
    view: torch.Tensor, layout: PagedLayout, slots: torch.Tensor, offsets: torch.Tensor | None = None
) -> torch.Tensor:
    """K only, ``[n, H, D]`` (pure). ``offsets``: ``key_offsets(layout, slots)`` on ``view``'s device when the
    caller has them already."""
    offs = key_offsets(layout, slots.to(view.device)) if offsets is None else offsets
    return _storage(view)[offs]


def check_view(view: torch.Tensor, layout: PagedLayout) -> None:
    """Raise ``ValueError`` unless ``view`` is a ``[B, H, N, 2D]`` view with ``layout``'s block/head strides
    (a ``clone()`` of a layer view is contiguous, i.e. another layout)."""
    if (
        view.dim() != 4
        or tuple(view.shape[1:]) != (layout.num_kv_heads, layout.block_size, layout.width)
        or (view.stride(0), view.stride(1)) != (layout.block_stride, layout.head_stride)
    ):
        raise ValueError(f"cache {tuple(view.shape)} strides {view.stride()} is not layout {layout.name!r}")


class PagedTorchMover:
    """Reference ``SlotMover`` for any ``PagedLayout``: per layer, gather every source, then scatter every
    destination (exact whatever the pairs' order, even when a destination is another pair's source)."""

    def __init__(self, layout: PagedLayout) -> None:
        self.layout = layout

    def move(self, kv_caches: Sequence[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
        if src.shape != dst.shape:
            raise ValueError(f"move: {src.numel()} sources but {dst.numel()} destinations")
        if src.numel() == 0:
            return
        for kv in unique_caches(kv_caches):
            check_view(kv, self.layout)
            layout = self.layout if self.layout.index.device == kv.device else self.layout.to(kv.device)
            scatter(kv, layout, dst, gather(kv, layout, src))


class PagedScoreAccumulator(ScoreAccumulator):
    """``ScoreAccumulator`` (the torch reference of score collection) reading K through a ``PagedLayout``."""

    def _read_keys(self, kv_cache: torch.Tensor, layout, slots: torch.Tensor) -> torch.Tensor:
        return read_k(kv_cache, layout, slots)
