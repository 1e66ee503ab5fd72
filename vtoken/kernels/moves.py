"""KV slot moves: copy whole tokens (K and V, every kv head, every layer) between physical slots.

A repack plan is a list of ``(src_slot, dst_slot)`` physical slots (``block_id * block_size + offset``).
The sources and destinations of one step are disjoint (sources are live tokens at or beyond ``live``,
destinations are holes below it), so a gather of every source followed by a scatter to every destination
is exact whatever the order of the pairs. That is what ``TorchSlotMover`` does, per layer tensor.

``SlotMover`` is the interface the vLLM worker uses; on CUDA ``TritonSlotMover`` (``triton/moves.py``)
implements the same ``move`` on the GPU layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from vtoken.kernels.layout import TokenLayout


class SlotMover(Protocol):
    def move(self, kv_caches: Sequence[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy token ``src[i]`` onto ``dst[i]`` in every tensor of ``kv_caches`` (mutates them)."""


def token_index(layout: TokenLayout, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks [n, 1], elements [n, 2*head_dim])``: where the tokens at ``slots`` sit in a layer viewed as
    ``[num_blocks, num_kv_heads, region]`` (pure)."""
    blocks = torch.div(slots, layout.block_size, rounding_mode="floor")
    return blocks.unsqueeze(1), layout.index[slots - blocks * layout.block_size]


def flat_offsets(layout: TokenLayout, slots: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[n * num_kv_heads * 2*head_dim]`` offsets of every element of the tokens at ``slots`` in a contiguous
    layer tensor flattened to 1-D — the same for every layer with ``num_kv_heads``, so a mover computes them
    once per step and each layer is one 1-D gather and one 1-D scatter (pure)."""
    blocks, elements = token_index(layout, slots)
    heads = torch.arange(num_kv_heads, device=slots.device) * layout.region
    return (blocks[:, :, None] * (num_kv_heads * layout.region) + heads[None, :, None] + elements[:, None, :]).reshape(
        -1
    )


def gather_tokens(kv_cache: torch.Tensor, layout: TokenLayout, slots: torch.Tensor) -> torch.Tensor:
    """All elements of the tokens at ``slots``: ``[n, 2*head_dim, num_kv_heads]`` (K channels then V)."""
    blocks, elements = token_index(layout, slots)
    return kv_cache.view(kv_cache.shape[0], kv_cache.shape[1], layout.region)[blocks, :, elements]


def read_kv(kv_cache: torch.Tensor, layout: TokenLayout, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the tokens at ``slots``, each ``[n, num_kv_heads, head_dim]`` (pure)."""
    vals = gather_tokens(kv_cache, layout, slots).permute(0, 2, 1)
    return vals[..., : layout.head_dim], vals[..., layout.head_dim :]


def read_k(kv_cache: torch.Tensor, layout: TokenLayout, slots: torch.Tensor) -> torch.Tensor:
    """K only of the tokens at ``slots``: ``[n, num_kv_heads, head_dim]`` (pure; half the gather of read_kv)."""
    blocks, elements = token_index(layout, slots)
    flat = kv_cache.view(kv_cache.shape[0], kv_cache.shape[1], layout.region)
    return flat[blocks, :, elements[:, : layout.head_dim]].permute(0, 2, 1)


def unique_caches(kv_caches: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The layer tensors, each once (layers sharing one cache tensor are moved once)."""
    seen: set[int] = set()
    out = []
    for kv in kv_caches:
        if kv.data_ptr() not in seen:
            seen.add(kv.data_ptr())
            out.append(kv)
    return out


class TorchSlotMover:
    """Reference mover for any layout ``probe_layout`` can describe (CPU now; also runs on CUDA tensors)."""

    def __init__(self, layout: TokenLayout) -> None:
        self.layout = layout

    def move(self, kv_caches: Sequence[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
        if src.numel() == 0:
            return
        if src.shape != dst.shape:
            raise ValueError(f"move: {src.numel()} sources but {dst.numel()} destinations")
        where: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (device, kv heads) -> source/dest offsets
        for kv in unique_caches(kv_caches):
            key = (kv.device, kv.shape[1])
            if key not in where:
                layout = self.layout if self.layout.index.device == kv.device else self.layout.to(kv.device)
                where[key] = (
                    flat_offsets(layout, src.to(kv.device), kv.shape[1]),
                    flat_offsets(layout, dst.to(kv.device), kv.shape[1]),
                )
            s, d = where[key]
            flat = kv.view(-1)  # a layer tensor is contiguous (vLLM allocates each; a view error says otherwise)
            flat[d] = flat[s]  # the gather copies first: exact even if a destination is another pair's source
