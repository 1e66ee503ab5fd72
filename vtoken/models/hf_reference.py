"""The correctness oracle: a Hugging Face model run with exactly vToken's evicted keys masked out.

Invariant 5 (docs/architecture.md §4) says vToken's output equals "the HF model with the same tokens masked".
This module is that HF model: transformers, eager attention, fp32, CPU, with a custom additive 4-D mask
(0 = visible, dtype-min = evicted) and position ids = logical positions (nothing is ever removed from the
sequence, so RoPE positions are preserved). transformers 5.19 passes a 4-D mask through unchanged
(``masking_utils._preprocess_mask_arguments`` early-exits on ``attention_mask.ndim == 4``) and eager
attention adds it to the scores before the softmax, for Llama and Qwen2 alike; no patching is needed. Hybrid
models (sliding-window layers, ``config.layer_types``) get one mask per layer kind (``layer_masks``).

Convention (``LiveTrace``), with P = len(prompt_ids), M = len(output_ids)::

    logical     0 1 ... P-2 | P-1 | P    P+1  ...  P+M-2 | (P+M-1: last output, never a query)
    token       prompt ...  | p   | o0   o1   ...  o(M-2)
    step                    | 0   | 1    2    ...  M-1
    produces                | o0  | o1   o2   ...  o(M-1)

* Step s (0 ≤ s < M) produces ``output_ids[s]``; its query is the token at logical position
  q_s = P + s - 1 (step 0 is the last row of the prefill, steps ≥ 1 are decode steps).
* ``live_at_step[s]`` = the logical positions of the keys that query may attend: a subset of
  [0, q_s] that **must contain q_s itself** (a token's own key is written before it attends).
* Prompt rows 0 .. P-2 attend causally (keys 0..i) unless ``prefill_visible`` ([P, P] bool, lower
  triangular with a true diagonal) says otherwise; row P-1 is always ``live_at_step[0]``.
* Every row's visibility is the one in force *when that token was computed*: that is what a KV cache
  holds, so later evictions never change earlier tokens' keys/values. One forward over the T = P+M-1
  tokens with this [T, T] mask is therefore exact for teacher forcing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass(frozen=True)
class LiveTrace:
    """What one request saw: prompt, outputs, and per step the live key positions (module doc)."""

    prompt_ids: list[int]
    output_ids: list[int]
    live_at_step: list[np.ndarray]
    prefill_visible: np.ndarray | None = None  # bool [P, P]; None = causal

    def __post_init__(self) -> None:
        p, m = len(self.prompt_ids), len(self.output_ids)
        if p == 0 or m == 0:
            raise ValueError(f"LiveTrace needs a prompt and outputs, got {p} prompt / {m} output ids")
        if len(self.live_at_step) != m:
            n = len(self.live_at_step)
            raise ValueError(f"live_at_step has {n} entries, expected one per output ({m})")
        for s, keys in enumerate(self.live_at_step):
            keys, q = np.asarray(keys), p + s - 1
            if keys.ndim != 1 or keys.size == 0 or keys.min() < 0 or keys.max() > q or q not in keys:
                raise ValueError(f"live_at_step[{s}] must be 1-D positions in [0, {q}] containing {q}")
        if self.prefill_visible is not None:
            v = np.asarray(self.prefill_visible, dtype=bool)
            if v.shape != (p, p) or np.triu(v, 1).any() or not np.diag(v).all():
                raise ValueError(f"prefill_visible must be lower-triangular bool [{p}, {p}], true diagonal")

    @property
    def num_steps(self) -> int:
        return len(self.output_ids)

    def input_ids(self) -> list[int]:
        """The T = P + M - 1 tokens that are queries (everything but the last output)."""
        return list(self.prompt_ids) + list(self.output_ids[:-1])

    def visibility(self) -> np.ndarray:
        """Bool [T, T] (T = P + M - 1): row i = keys visible to the token at logical position i. Pure."""
        p, m = len(self.prompt_ids), self.num_steps
        vis = np.zeros((p + m - 1, p + m - 1), dtype=bool)
        if self.prefill_visible is None:
            vis[:p, :p] = np.tril(np.ones((p, p), dtype=bool))
        else:
            vis[:p, :p] = np.asarray(self.prefill_visible, dtype=bool)
        for s in range(m):
            vis[p + s - 1, : p + s] = False
            vis[p + s - 1, np.asarray(self.live_at_step[s], dtype=np.int64)] = True
        return vis


@dataclass(frozen=True)
class ReferenceResult:
    """Per step s: log p(output_ids[s]) under the masked model (full-vocabulary log-softmax), and the
    masked model's own top-1 token with its log-prob. float64 / int64 arrays of length M."""

    token_logprobs: np.ndarray
    top1_ids: np.ndarray
    top1_logprobs: np.ndarray

    def greedy_match(self, output_ids: list[int]) -> np.ndarray:
        """Bool [M]: where ``output_ids`` equals the masked model's top-1 token."""
        return self.top1_ids == np.asarray(output_ids, dtype=np.int64)


def load_reference_model(path: str | Path):
    """Load a causal LM from ``path`` for use as the oracle: fp32, eager attention, eval mode, CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def sliding_window(model) -> int | None:
    """The window of a hybrid model's sliding-window layers (``config.layer_types`` holds
    ``"sliding_attention"``), else None. Pure."""
    cfg = model.config
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
        return int(cfg.sliding_window)
    return None


def layer_masks(model, visible: np.ndarray, first_row: int):
    """The ``attention_mask`` for rows at logical positions ``first_row …`` over keys ``0 … k-1``: the
    additive mask of ``visible``, or on a hybrid model a dict per layer kind (transformers takes a
    mapping and uses it as is): full-attention layers see ``visible`` (vToken's evictions), sliding-window
    layers see the last ``window`` logical positions, evicted or not (vLLM keeps that group whole)::

        row q, window W      keys  0 ........ q-W | q-W+1 ... q | q+1 ...
        full_attention             visible[q]       visible[q]    -
        sliding_attention          -                all           -
    """
    window = sliding_window(model)
    if window is None:
        return additive_mask(visible)
    rows = np.arange(first_row, first_row + visible.shape[0])[:, None]
    keys = np.arange(visible.shape[1])[None, :]
    return {
        "full_attention": additive_mask(visible),
        "sliding_attention": additive_mask((keys <= rows) & (rows - keys < window)),
    }


def additive_mask(visible: np.ndarray, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[1, 1, q, k] float mask from a bool [q, k] visibility matrix: 0 where visible, dtype-min elsewhere."""
    vis = torch.as_tensor(np.asarray(visible, dtype=bool))
    mask = torch.zeros(vis.shape, dtype=dtype).masked_fill_(~vis, torch.finfo(dtype).min)
    return mask[None, None]


@torch.inference_mode()
def masked_logprobs(model, input_ids, visible: np.ndarray, position_ids=None) -> torch.Tensor:
    """Log-softmax [T, V] (fp32) of one forward over ``input_ids`` (T tokens) with row i attending the
    keys ``visible[i]`` (bool [T, T]). ``position_ids`` default to 0..T-1. Pure (no cache is kept)."""
    _check_eager(model)
    ids = torch.as_tensor(np.asarray(input_ids, dtype=np.int64))[None]
    t = ids.shape[1]
    if visible.shape != (t, t):
        raise ValueError(f"visibility must be [{t}, {t}] for {t} tokens, got {list(visible.shape)}")
    pos = torch.arange(t) if position_ids is None else torch.as_tensor(position_ids, dtype=torch.long)
    pos = pos[None]
    out = model(input_ids=ids, attention_mask=layer_masks(model, visible, 0), position_ids=pos, use_cache=False)
    return torch.log_softmax(out.logits[0].float(), dim=-1)


def score_trace(model, trace: LiveTrace) -> ReferenceResult:
    """Teacher-forced log-probs of ``trace.output_ids`` with the trace's masks: one forward. Pure."""
    p = len(trace.prompt_ids)
    logp = masked_logprobs(model, trace.input_ids(), trace.visibility())[p - 1 :]
    chosen = torch.as_tensor(trace.output_ids, dtype=torch.long)
    top_lp, top_id = logp.max(dim=-1)
    return ReferenceResult(
        token_logprobs=logp.gather(1, chosen[:, None])[:, 0].double().numpy(),
        top1_ids=top_id.long().numpy(),
        top1_logprobs=top_lp.double().numpy(),
    )


@torch.inference_mode()
def greedy_replay(model, trace: LiveTrace) -> list[int]:
    """Generate ``trace.num_steps`` tokens greedily from ``trace.prompt_ids`` with the trace's masks
    (``trace.output_ids`` is ignored except for its length). Incremental: a KV cache plus one
    [1, 1, 1, k] mask per decode step, so earlier tokens keep the keys they were computed with. Pure."""
    from transformers import DynamicCache

    _check_eager(model)
    p, m = len(trace.prompt_ids), trace.num_steps
    vis = trace.visibility()  # rows of generated tokens depend only on positions, not on token ids
    cache = DynamicCache()  # every layer keeps every key (a sliding layer's window comes from its mask)
    ids = torch.as_tensor(trace.prompt_ids, dtype=torch.long)[None]
    out = model(
        input_ids=ids,
        attention_mask=layer_masks(model, vis[:p, :p], 0),
        position_ids=torch.arange(p)[None],
        past_key_values=cache,
        use_cache=True,
    )
    tokens = [int(out.logits[0, -1].argmax())]
    for s in range(1, m):
        q = p + s - 1
        mask = layer_masks(model, vis[q : q + 1, : q + 1], q)
        out = model(
            input_ids=torch.tensor([[tokens[-1]]]),
            attention_mask=mask,
            position_ids=torch.tensor([[q]]),
            past_key_values=cache,
            use_cache=True,
        )
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def _check_eager(model) -> None:
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != "eager":
        raise ValueError(f"the reference needs attn_implementation='eager', model uses {impl!r}")
