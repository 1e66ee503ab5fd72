"""Per-token attention scores for the eviction policies: q·K of a step's queries over the live keys.

The attention kernel returns no weights, so after it ran (the step's keys are already in the cache) we
recompute ``softmax(q·Kᵀ·scale)`` for the requests that need scores, reading K through the probed
``TokenLayout``. A request's row is dense: its live keys are physical slots ``0..seq_len-1`` of its block
row, and the step's ``n_q`` queries see the keys causally (query ``i`` sees slots ``< seq_len - n_q + i + 1``;
a single decode query written into a hole sees all ``seq_len`` slots, which the same formula gives).

``ScoreAccumulator`` averages the probabilities over heads and layers (docs/architecture.md §5: one
decision per token, shared by every layer and head) and, separately, the L2 norm of each new key (KNorm).
On the step that computes the prompt's last token it also sums the prompt's last ``OBSERVATION_WINDOW``
queries (SnapKV's observation window; fewer when the step has fewer prompt queries). For a request that
asks for it (R-KV) it also takes each live key's mean cosine similarity to the other live keys from the same
gathered keys (``key_redundancy``), mean over KV heads, summed over the scored layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from vtoken.core.step_stats import SlotScores, unimportance_bits
from vtoken.kernels.layout import TokenLayout
from vtoken.kernels.moves import read_k
from vtoken.policies.context import OBSERVATION_WINDOW


def row_slots(block_row: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Physical slots of row positions ``0..seq_len-1`` through the request's block ids."""
    pos = torch.arange(seq_len, device=block_row.device)
    return block_row[pos // block_size].to(torch.int64) * block_size + pos % block_size


def attention_probs(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Mean over heads of causal softmax(q·Kᵀ·scale): ``[n_q, n_k]`` float32.

    ``q``: ``[n_q, H, D]``; ``k``: ``[n_k, H_kv, D]`` with ``H % H_kv == 0`` (GQA). The last query sees
    every key; query ``i`` sees keys ``< n_k - n_q + i + 1``.
    """
    n_q, heads, _ = q.shape
    n_k, kv_heads, _ = k.shape
    group = heads // kv_heads
    qf = q.float().view(n_q, kv_heads, group, -1)
    logits = torch.einsum("qhgd,khd->hgqk", qf, k.float()) * scale
    limit = torch.arange(n_q, device=q.device).unsqueeze(1) + (n_k - n_q)
    visible = torch.arange(n_k, device=q.device).unsqueeze(0) <= limit
    logits = logits.masked_fill(~visible, float("-inf"))
    return torch.softmax(logits, dim=-1).mean(dim=(0, 1))


def key_redundancy(k: torch.Tensor) -> torch.Tensor:
    """``[n]`` float32: per KV head, each key's mean cosine similarity to the other ``n − 1`` keys of ``k``
    (``[n, H_kv, D]``), mean over the heads; zeros when ``n < 2``. O(n·D) per head from the unit keys' sum:
    mean_{j≠i} cos = (k̂_i·Σ_j k̂_j − k̂_i·k̂_i)/(n − 1), k̂_i·k̂_i = 1 (0 for a zero key). Pure; numpy
    reference: ``vtoken.core.step_stats.mean_cosine``."""
    n = k.shape[0]
    if n < 2:
        return torch.zeros(n, dtype=torch.float32, device=k.device)
    kf = k.float()
    norm = kf.norm(dim=-1, keepdim=True)
    unit = torch.where(norm > 0, kf / norm.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(kf))
    total = unit.sum(dim=0)
    return (((unit * total).sum(-1) - (unit * unit).sum(-1)) / (n - 1)).mean(dim=-1)


@dataclass
class RequestScores:
    """One request's accumulators for one step (mutated layer by layer)."""

    q_start: int
    q_end: int
    seq_len: int
    block_row: torch.Tensor  # int32/int64 block ids of the row (at least ceil(seq_len/B))
    want_attention: bool
    want_key_norm: bool
    window: int = 0  # > 0: queries 0..window-1 end the prompt; sum the last ≤ OBSERVATION_WINDOW of them
    want_redundancy: bool = False  # R-KV: the live keys' mean cosine similarity (``key_redundancy``)
    first: int = 0  # first row slot whose statistics are kept (vtoken.core.scored_range; softmax over all)
    probs: torch.Tensor | None = None  # [n_q, seq_len - first] summed over layers
    redundancy: torch.Tensor | None = None  # [seq_len - first] summed over layers
    live_slots: torch.Tensor | None = None  # the live keys' physical slots (Triton path)
    key_norm: torch.Tensor | None = None  # [n_q] summed over layers
    layers: int = 0
    norm_layers: int = 0

    @property
    def n_q(self) -> int:
        return self.q_end - self.q_start


def layer_mean_probs(rs: RequestScores) -> tuple[np.ndarray, np.ndarray]:
    """``(probs, visible)``: a request's ``[n_q, seq_len - first]`` probabilities (slots ``first ..``), mean
    over its scored layers, and their causal visibility (query ``i`` sees keys up to ``seq_len - n_q + i``),
    as ``finish`` reduces them (reads ``rs.probs``: a host copy once ``to_host`` ran). Pure."""
    probs = (rs.probs / rs.layers).cpu().numpy().astype(np.float64)
    n_q, n_k = probs.shape[0], rs.seq_len
    return probs, np.arange(rs.first, n_k)[None, :] <= (np.arange(n_q)[:, None] + (n_k - n_q))


def visible_counts(n_q: int, seq_len: int) -> np.ndarray:
    """``[n_q]``: how many keys each of a step's queries sees (all of them, whatever range is kept). Pure."""
    return np.arange(n_q) + (seq_len - n_q + 1)


@dataclass
class ScoreAccumulator:
    """Collects one step's scores across the attention layers (one per worker, reset every step)."""

    layout: TokenLayout
    requests: dict[str, RequestScores] = field(default_factory=dict)
    _slots: torch.Tensor | None = None  # every scored request's live slots, concatenated (same for all layers)

    def add_layer(self, query: torch.Tensor, key: torch.Tensor | None, kv_cache: torch.Tensor, scale: float) -> None:
        """Fold one layer in. ``query``: ``[T, H, D]`` of the whole batch; ``key``: ``[T, H_kv, D]``.

        One K gather per layer for all requests (their live slots never change within a step); single-query
        (decode) requests are scored together in one padded batch, the others one by one."""
        layout = self.layout if self.layout.index.device == kv_cache.device else self.layout.to(kv_cache.device)
        scored = [rs for rs in self.requests.values() if rs.want_attention]
        if scored:
            if self._slots is None:
                self._slots = torch.cat([row_slots(rs.block_row, rs.seq_len, layout.block_size) for rs in scored])
                self._plan_decode_batch(scored)
            keys = self._read_keys(kv_cache, layout, self._slots.to(kv_cache.device))
            if self._dec:
                self._add_decode_batch(query, keys, scale)
            start = 0
            for rs in scored:
                k = keys[start : start + rs.seq_len]
                start += rs.seq_len
                if rs.want_redundancy:
                    add_redundancy(rs, k)
                if rs.n_q == 1 and self._dec:
                    continue
                p = attention_probs(query[rs.q_start : rs.q_end], k, scale)[:, rs.first :]
                rs.probs = p if rs.probs is None else rs.probs + p
                rs.layers += 1
        self._add_key_norms(key)

    def _add_key_norms(self, key: torch.Tensor | None) -> None:
        """Fold one layer's key norms in: per query of each request that wants them, the mean over kv heads
        of ``key``'s L2 norms (``key``: ``[T, H_kv, D]``, None when the layer gives none: nothing added).
        Mutates the requests' ``key_norm`` and ``norm_layers``."""
        for rs in self.requests.values():
            if rs.want_key_norm and key is not None:
                n = key[rs.q_start : rs.q_end].float().norm(dim=-1).mean(dim=-1)
                rs.key_norm = n if rs.key_norm is None else rs.key_norm + n
                rs.norm_layers += 1

    def _read_keys(self, kv_cache: torch.Tensor, layout, slots: torch.Tensor) -> torch.Tensor:
        """K of ``slots``, ``[n, H_kv, D]`` (pure); other cache layouts override this (gpu_layout.py)."""
        return read_k(kv_cache, layout, slots)

    _dec: list[RequestScores] | None = None
    _dec_index: torch.Tensor | None = None  # [R, Lmax] rows of the concatenated keys (clamped)
    _dec_valid: torch.Tensor | None = None  # [R, Lmax] bool
    _dec_q: torch.Tensor | None = None  # [R] token index of each request's query
    _dec_probs: torch.Tensor | None = None  # [R, Lmax] summed over layers

    def _plan_decode_batch(self, scored: list[RequestScores]) -> None:
        starts, dec = [], []
        start = 0
        for rs in scored:
            if rs.n_q == 1:
                dec.append(rs)
                starts.append(start)
            start += rs.seq_len
        if len(dec) < 2:
            self._dec = None
            return
        lens = torch.tensor([rs.seq_len for rs in dec])
        pos = torch.arange(int(lens.max()))
        self._dec = dec
        self._dec_valid = pos[None, :] < lens[:, None]
        self._dec_index = torch.tensor(starts)[:, None] + torch.minimum(pos[None, :], lens[:, None] - 1)
        self._dec_q = torch.tensor([rs.q_start for rs in dec])

    def _add_decode_batch(self, query: torch.Tensor, keys: torch.Tensor, scale: float) -> None:
        dev = keys.device
        k = keys[self._dec_index.to(dev)].float()  # [R, L, H_kv, D]
        q = query[self._dec_q.to(dev)].float()  # [R, H, D]
        r, heads, d = q.shape
        kv_heads = k.shape[2]
        logits = torch.einsum("rhgd,rlhd->rhgl", q.view(r, kv_heads, heads // kv_heads, d), k) * scale
        logits = logits.masked_fill(~self._dec_valid.to(dev)[:, None, None, :], float("-inf"))
        p = torch.softmax(logits, dim=-1).mean(dim=(1, 2))  # [R, L]
        self._dec_probs = p if self._dec_probs is None else self._dec_probs + p
        for rs in self._dec:
            rs.layers += 1

    def linear_buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``(attention, key norms)``: the step's accumulators that are linear in the per-head values
        (summed over layers, head means), in an order fixed by the step's requests; tensor parallelism sums
        them over the ranks in place before ``finish`` (vtoken/vllm/runner/tp.py). Pure."""
        attention = [rs.probs for rs in self.requests.values() if rs.probs is not None]
        if self._dec and self._dec_probs is not None:
            attention.append(self._dec_probs)
        return attention, kv_head_means(self.requests.values())

    def to_host(self, copy: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace every buffer ``finish`` reads (``linear_buffers``) with ``copy(buffer)``: the runner passes
        a non-blocking copy into pinned host memory, so ``finish`` then reads no device memory (async
        scheduling reads the step's result after the next step was enqueued). Mutates the accumulators."""
        for rs in self.requests.values():
            rs.probs = copy(rs.probs) if rs.probs is not None else None
            rs.key_norm = copy(rs.key_norm) if rs.key_norm is not None else None
            rs.redundancy = copy(rs.redundancy) if rs.redundancy is not None else None
        if self._dec_probs is not None:
            self._dec_probs = copy(self._dec_probs)

    def finish(self) -> dict[str, SlotScores]:
        """Per request: mean over layers, reduced to the statistics (``SlotScores``, plain numpy, picklable
        across the scheduler↔worker boundary): attention statistics over the row's slots ``first..seq_len-1``
        and ``key_norm`` for the step's new tokens in order, each ``None`` when not collected; ``window`` on
        the step that ends the prompt (``RequestScores.window``). Pure apart from reading the accumulators.
        """
        if self._dec and self._dec_probs is not None:
            for i, rs in enumerate(self._dec):
                rs.probs = self._dec_probs[i, rs.first : rs.seq_len].unsqueeze(0)
        out: dict[str, SlotScores] = {}
        for rid, rs in self.requests.items():
            stats: dict[str, np.ndarray] = {}
            if rs.probs is not None and rs.layers:
                probs, visible = layer_mean_probs(rs)
                stats.update(
                    accumulated=probs.sum(axis=0),
                    last=probs[-1].copy(),
                    unimportant=unimportance_bits(probs, visible, visible_counts(rs.n_q, rs.seq_len)),
                )
                if rs.window:
                    stats["window"] = probs[max(rs.window - OBSERVATION_WINDOW, 0) : rs.window].sum(axis=0)
            if rs.key_norm is not None and rs.norm_layers:
                stats["key_norm"] = (rs.key_norm / rs.norm_layers).cpu().numpy().astype(np.float64)
            stats.update(redundancy_stat(rs))
            out[rid] = SlotScores(n_queries=rs.n_q, seq_len=rs.seq_len, first=rs.first, **stats)
        return out


def add_redundancy(rs: RequestScores, keys: torch.Tensor) -> None:
    """Fold one layer's ``key_redundancy`` of the request's live keys ``[seq_len, H_kv, D]`` (every one: the
    mean is over all of them) into ``rs``, kept for slots ``rs.first ..``."""
    r = key_redundancy(keys)[rs.first :]
    rs.redundancy = r if rs.redundancy is None else rs.redundancy + r


def redundancy_stat(rs: RequestScores) -> dict[str, np.ndarray]:
    """``{"redundancy": mean over the scored layers}`` when collected, else ``{}`` (reads the accumulator;
    one ``add_redundancy`` per scored layer, so ``rs.layers`` counts them)."""
    if rs.redundancy is None or not rs.layers:
        return {}
    return {"redundancy": (rs.redundancy / rs.layers).cpu().numpy().astype(np.float64)}


def kv_head_means(requests) -> list[torch.Tensor]:
    """The step's accumulators that are means over KV heads (key norms, redundancy), in request order:
    tensor parallelism weights them by KV heads (vtoken/vllm/runner/tp.py)."""
    out = []
    for rs in requests:
        out.extend(t for t in (rs.key_norm, rs.redundancy) if t is not None)
    return out


@dataclass
class LayerGroups:
    """One step's accumulators, one per distinct set of scored layers among its requests (``score_layers``,
    vtoken/core/config.py): ``groups`` is ``[(layers or None for every layer, accumulator)]`` in an order the
    step's plan fixes (identical on every tensor-parallel rank). A layer outside a group's set never reaches
    that group's accumulator (no gather, no softmax), so each request's statistics are the mean over its own
    scored layers. Quacks like a ``ScoreAccumulator`` for the runner, ``finish_step_result`` and the TP
    reduction (vtoken/vllm/runner/tp.py)."""

    groups: list[tuple[frozenset[int] | None, ScoreAccumulator]]

    @property
    def requests(self) -> dict[str, RequestScores]:
        return {rid: rs for _, acc in self.groups for rid, rs in acc.requests.items()}

    def add_layer(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        kv_cache: torch.Tensor,
        scale: float,
        layer: int | None = None,
    ) -> None:
        """Fold attention layer ``layer`` (forward order; ``None``: fold into every group) into the groups
        that score it."""
        for layers, acc in self.groups:
            if layers is None or layer is None or layer in layers:
                acc.add_layer(query, key, kv_cache, scale)

    def linear_buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every group's buffers, group by group (see ``ScoreAccumulator.linear_buffers``). Pure."""
        attention, norms = [], []
        for _, acc in self.groups:
            a, n = acc.linear_buffers()
            attention.extend(a)
            norms.extend(n)
        return attention, norms

    def to_host(self, copy: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Every group's ``to_host`` (see ``ScoreAccumulator.to_host``). Mutates the accumulators."""
        for _, acc in self.groups:
            acc.to_host(copy)

    def finish(self) -> dict[str, SlotScores]:
        """Every group's ``finish``, merged (a request belongs to one group)."""
        out: dict[str, SlotScores] = {}
        for _, acc in self.groups:
            out.update(acc.finish())
        return out
