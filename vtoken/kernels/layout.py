"""Where one token's K and V live inside a paged KV block, found by asking the backend's own writer.

vLLM's CPU attention cache is one tensor per layer, ``[num_blocks, num_kv_heads, block_size, 2*head_dim]``,
but the *interior* of each (block, kv head) region is backend- and ISA-specific: with the ``vec`` ISA K is
stored transposed as ``[head_dim, block_size]`` followed by V as ``[block_size, head_dim]``; AMX packs
differently. Treating K as token rows corrupts it silently (a ~1e-3 logprob drift on random weights).

So instead of hard-coding a layout we *probe* it once: write tokens whose values encode (token, channel)
with the backend's own ``reshape_and_cache`` into a scratch cache, and read back where each element
landed. The result, ``TokenLayout.index[o, c]``, is the element offset (inside one (block, head) region of
``R = 2*block_size*head_dim`` elements) of channel ``c`` of the token at block offset ``o``; channels
``0..head_dim-1`` are K, ``head_dim..2*head_dim-1`` are V::

    region of one (block, kv head), vec ISA, B = 4, D = 2:
    [k0d0 k1d0 k2d0 k3d0 k0d1 k1d1 k2d1 k3d1 | v0d0 v0d1 v1d0 v1d1 v2d0 v2d1 v3d0 v3d1]
    index[o=1] = [1, 5, 10, 11]           (K channel 0, K channel 1, V channel 0, V channel 1)

Every move, read and score computation in ``vtoken.kernels`` goes through this index, so a backend that
changes its packing is picked up at start-up (and ``probe_layout`` raises if the probe is ambiguous).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# (key[T,H,D], value[T,H,D], key_cache, value_cache, slot_mapping[T]) -> None: the backend's cache writer.
CacheWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class TokenLayout:
    """Per-token element offsets inside one (block, kv head) region of a paged KV cache tensor."""

    block_size: int
    head_dim: int
    index: torch.Tensor  # int64 [block_size, 2*head_dim]: K channels then V channels

    @property
    def region(self) -> int:
        return 2 * self.block_size * self.head_dim

    def to(self, device: torch.device | str) -> TokenLayout:
        return TokenLayout(self.block_size, self.head_dim, self.index.to(device))

    @classmethod
    def cpu_vec(cls, block_size: int, head_dim: int) -> TokenLayout:
        """The documented layout of vLLM 0.32's CPU ``vec`` ISA (K transposed, then V row-major).

        Used by tests as an independent reference for the probe; production code always probes.
        """
        o = torch.arange(block_size).unsqueeze(1)
        d = torch.arange(head_dim).unsqueeze(0)
        k = d * block_size + o
        v = block_size * head_dim + o * head_dim + d
        return cls(block_size, head_dim, torch.cat([k, v], dim=1).to(torch.int64))


def split_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (key_cache, value_cache) views vLLM's CPU backend hands its kernels (cpu_attn.py)."""
    nb, nkv, bs, _ = kv_cache.shape
    kv = kv_cache.view(nb, nkv, bs * 2, -1)
    key_cache, value_cache = kv.chunk(2, dim=2)
    return key_cache, value_cache


def probe_layout(
    writer: CacheWriter, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> TokenLayout:
    """Find the per-token element offsets by writing coded tokens with ``writer`` (pure; scratch memory).

    Three passes encode the token offset and the channel in small integers (exact even in bf16), so the
    probe works for every float dtype the backend supports.
    """
    region = 2 * block_size * head_dim
    codes = []
    o = torch.arange(block_size).view(block_size, 1, 1).expand(block_size, num_kv_heads, head_dim)
    d = torch.arange(head_dim).view(1, 1, head_dim).expand(block_size, num_kv_heads, head_dim)
    for k_val, v_val in (
        (o + 1, o + 1),
        (d % 128 + 1, d % 128 + 1),
        (d // 128 + 1, d // 128 + 129),  # V marked by +128 in the high channel digit
    ):
        cache = torch.zeros(1, num_kv_heads, block_size, region // block_size, dtype=dtype)
        key_cache, value_cache = split_kv_cache(cache)
        writer(
            k_val.to(dtype).contiguous(),
            v_val.to(dtype).contiguous(),
            key_cache,
            value_cache,
            torch.arange(block_size, dtype=torch.int64),
        )
        codes.append(cache.view(num_kv_heads, region).to(torch.int64))
    tok, lo, hi = codes
    if torch.any(tok == 0):
        raise RuntimeError("KV layout probe: the backend's cache writer left elements unwritten")
    is_v = hi > 128
    chan = (torch.where(is_v, hi - 129, hi - 1)) * 128 + (lo - 1)
    chan = torch.where(is_v, chan + head_dim, chan)
    index = torch.full((block_size, 2 * head_dim), -1, dtype=torch.int64)
    index[tok[0] - 1, chan[0]] = torch.arange(region)
    if torch.any(index < 0):
        raise RuntimeError("KV layout probe: ambiguous layout (some token channels were not found)")
    for h in range(1, num_kv_heads):
        other = torch.full_like(index, -1)
        other[tok[h] - 1, chan[h]] = torch.arange(region)
        if not torch.equal(other, index):
            raise RuntimeError("KV layout probe: kv heads are packed differently; unsupported layout")
    return TokenLayout(block_size, head_dim, index)
