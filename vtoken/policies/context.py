"""What a policy scores from: the per-token statistics, named once.

Every place that holds or moves a statistic uses these names as its field names: the token table's
arrays (``vtoken.core.token_table``), one step's measurements (``vtoken.core.step_stats.StepScores`` and the
worker's ``SlotScores``), the policy's view (``EvictionContext``) and ``ScorerPolicy.needs``.

  ``accumulated``  Σ over every query so far of the key's attention                       (H2O)
  ``last``         attention from the most recent query                                    (TOVA)
  ``unimportant``  uint64 history bitmask: bit j set ⇔ the j-th most recent query gave the key
                   less than the uniform share 1/(keys that query saw)                      (Scissorhands)
  ``key_norm``     L2 norm of the key, set once when it is written                          (KNorm)
  ``window``       Σ over the prompt's last ``OBSERVATION_WINDOW`` queries (the observation window) of the
                   key's attention, set once by the step that computes the prompt's last token; with a
                   chunked prefill that is the last chunk, and when it holds fewer queries than the window
                   (a short last chunk, a prefix-cache hit) the window is those queries. A key the window
                   never saw (generated later) keeps 0                                        (SnapKV)
  ``redundancy``   mean over KV heads and scored layers of the key's mean cosine similarity to the request's
                   other live keys, recomputed by every scored step over the live set *of that step*
                   (eviction changes it): with unit keys k̂, mean_{j≠i} cos = (k̂_i·Σ_j k̂_j − 1)/(n − 1), O(n·d)
                   per head, from the keys alone (no queries); every other token: 0                  (R-KV)

Attention is the mean over heads and layers of each key's probability: one decision per token per
request, shared by all layers and heads (one block table per request; docs/architecture.md §5).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import numpy as np

HISTORY_BITS = 64  # the unimportance history is a uint64 bitmask: at most 64 recent queries
OBSERVATION_WINDOW = 32  # SnapKV: the prompt's last queries whose attention the ``window`` statistic sums


class Stat(StrEnum):
    """A per-token statistic; its value is the field name everywhere it is stored."""

    ACCUMULATED = "accumulated"
    LAST = "last"
    UNIMPORTANT = "unimportant"
    KEY_NORM = "key_norm"
    WINDOW = "window"
    REDUNDANCY = "redundancy"

    @property
    def needs_attention(self) -> bool:
        """Whether measuring it needs the step's score pass over the live keys (q·K; ``redundancy`` reads the
        same gathered keys, without queries), not only the step's new keys."""
        return self is not Stat.KEY_NORM

    @property
    def prompt_only(self) -> bool:
        """Measured once, by the step that computes the prompt's last token (later steps' q·K unused)."""
        return self is Stat.WINDOW


ATTENTION_STATS = frozenset(s for s in Stat if s.needs_attention)
STEP_ATTENTION_STATS = frozenset(s for s in ATTENTION_STATS if not s.prompt_only)  # need every step's q·K


@dataclass(frozen=True)
class EvictionContext:
    """Per-candidate statistics (arrays aligned with ``logical``; 1-D for one request or 2-D
    ``[requests, tokens]`` for the batched simulator, with per-request scalars as ``[requests, 1]``).

    A statistic the policy does not need (``ScorerPolicy.needs``) may be ``None``: engines skip it.
    """

    logical: np.ndarray
    seen: np.ndarray | int
    salt: np.ndarray | int  # per-request salt for seeded randomness
    accumulated: np.ndarray | None = None
    last: np.ndarray | None = None
    unimportant: np.ndarray | None = None
    key_norm: np.ndarray | None = None
    window: np.ndarray | None = None
    redundancy: np.ndarray | None = None

    def stat(self, name: Stat) -> np.ndarray:
        """The statistic ``name`` (a policy's ``needs``: engines always fill those); ``ValueError`` naming it
        when it is missing, i.e. an engine did not measure what the policy declared it needs."""
        value = getattr(self, name.value)
        if value is None:
            raise ValueError(f"statistic {name.value!r} was not measured for this step")
        return value
