"""StreamingLLM — attention sinks plus a sliding window."""

from dataclasses import dataclass

import numpy as np

from vtoken.policies.base import ScorerPolicy
from vtoken.policies.context import EvictionContext
from vtoken.policies.registry import register_policy


@register_policy("streamingllm")
@dataclass(frozen=True)
class StreamingLLMPolicy(ScorerPolicy):
    """Keep the sinks (protected by the ``sinks`` setting) and the most recent tokens: evict the oldest.

    Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024,
    https://arxiv.org/abs/2309.17453. Query-free.
    """

    def score(self, ctx: EvictionContext) -> np.ndarray:
        return np.asarray(ctx.logical, dtype=np.float64)
