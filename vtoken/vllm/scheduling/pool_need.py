"""How many KV blocks vLLM 0.32 needs before an engine starts: room for one ``max_model_len`` request in
every KV cache group, plus the pool's null block.

A hybrid model's layers are grouped by attention kind (vLLM's ``_get_kv_cache_groups_uniform_page_size``):
the layers of one kind are split into groups of ``group_size`` layers (the fewest layers any kind has, or
the most when no kind has 1.5 × the fewest), and every group draws its own blocks from the one shared pool::

    Gemma 3 270M, 15 sliding (window 512) + 3 global layers -> group_size 3
    groups:   [full] [sliding] [sliding] [sliding] [sliding] [sliding]
    need(L):  ceil(L/B) + 5 x (ceil(min(W - 1 + T, L) / B) + 1) + 1 (the null block)

``T`` is the tokens a step may have in flight (``VllmConfig.max_in_flight_tokens``: a sliding group frees
blocks behind the window only once a step's tokens are processed). vLLM refuses a pool under ``need`` in
``get_kv_cache_configs`` ("To serve at least one request with the model's max seq len …") inside the engine
core, where ``vtoken serve`` sees only that its replica did not start; ``PoolShape`` lets the launcher and
``vtoken bench serve`` say it, by name, first. A model without ``layer_types`` counts as one full-attention
group, ``need(L) = ceil(L/B) + 1`` (at least what vLLM needs), as does any model with vLLM's hybrid manager
off (one group of all layers). Pure.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from math import ceil

FULL = None  # a group's window when its layers attend every token
SLIDING_LAYER = "sliding_attention"  # transformers' ``layer_types`` entry vLLM 0.32 gives a window


@dataclass(frozen=True)
class PoolShape:
    """The KV cache groups vLLM builds for a model: ``windows`` one per group (``FULL`` or the sliding
    window in tokens), ``block_size`` tokens per block, ``in_flight_tokens`` as above."""

    windows: tuple[int | None, ...]
    block_size: int
    in_flight_tokens: int

    def group_blocks(self, window: int | None, max_model_len: int) -> int:
        """Blocks one ``max_model_len`` request holds at most in a group with ``window``."""
        if window is FULL:
            return ceil(max_model_len / self.block_size)
        # +1: the window need not start at a block boundary
        return ceil(min(window - 1 + self.in_flight_tokens, max_model_len) / self.block_size) + 1

    def need(self, max_model_len: int) -> int:
        """The smallest pool (blocks, the null block included) vLLM starts an engine on."""
        return sum(self.group_blocks(w, max_model_len) for w in self.windows) + 1

    def longest_len(self, pool_blocks: int) -> int:
        """The largest ``max_model_len`` up to ``pool_blocks x block_size`` whose ``need`` fits ``pool_blocks``
        (0 when none does). The cap binds only when every group is sliding (then any length fits)."""
        low, high = 0, pool_blocks * self.block_size
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self.need(mid) <= pool_blocks else (low, mid - 1)
        return low

    def describe(self, max_model_len: int) -> str:
        """``need`` spelled out per kind of group, e.g. ``1 full-attention group x 32 + 3 sliding-window
        (64) groups x 33 + the null block``."""
        parts = [
            f"{n} {'full-attention' if w is FULL else f'sliding-window ({w})'} group{'s' * (n > 1)} "
            f"x {self.group_blocks(w, max_model_len)}"
            for w, n in Counter(self.windows).items()
        ]
        return " + ".join(parts) + " + the null block"


def group_windows(layer_windows: list[int | None]) -> tuple[int | None, ...]:
    """vLLM 0.32's KV cache groups for layers with these windows (``FULL`` for full attention), as the
    window of each group: layers bucketed by window, each bucket split into groups of ``group_size``."""
    buckets = Counter(layer_windows)
    fewest, most = min(buckets.values()), max(buckets.values())
    size = most if most < fewest * 1.5 else fewest
    return tuple(w for w, n in buckets.items() for _ in range(ceil(n / size)))


def pool_shape(vllm_config) -> PoolShape:
    """The groups vLLM will build for ``vllm_config``'s model, from its text config's ``layer_types`` and
    ``sliding_window`` (what vLLM 0.32's Gemma 2/3, Llama, Qwen … model code reads per layer). Reads only."""
    text = vllm_config.model_config.hf_text_config
    kinds = getattr(text, "layer_types", None) or []
    window = getattr(text, "sliding_window", None)
    layers: list[int | None] = [window if kind == SLIDING_LAYER and window else FULL for kind in kinds]
    if not layers or vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        layers = [FULL]  # one group (vLLM's manager off: a sliding layer's spec joins the full one)
    return PoolShape(
        windows=group_windows(layers),
        block_size=vllm_config.cache_config.block_size,
        in_flight_tokens=vllm_config.max_in_flight_tokens,
    )
