"""``TritonScoreAccumulator``: the policies' attention statistics from Triton kernels, two or three per layer.

Same contract and results as ``ScoreAccumulator`` (the torch reference, ``scores.py``): for a step's
queries, ``softmax(q·Kᵀ·scale)`` over each request's live row slots ``0..seq_len-1`` (read through its block
table and the cache's ``PagedLayout``), causal within the step, mean over heads, summed over layers, reduced
to ``SlotScores`` (``accumulated``, ``last``, ``unimportant`` bits, ``window``; ``key_norm`` and R-KV's
``redundancy``, a gather of the live keys and ``key_redundancy``, stay torch). The
attention kernel returns no weights, so they are recomputed after it ran; never the full ``[n_q, seq_len]``
matrix, only what the statistics need:

    per layer   1. _softmax_stats  grid (queries, kv heads, splits): row max m and normaliser l of every
                   (query, head) over its visible keys (online softmax over key tiles of the block table),
                   split over key ranges at long contexts and merged exactly (``_softmax_merge``, only when
                   there are several splits: ``kernels.triton.softmax``)
                2. _probs          grid (queries, key tiles of the scored range): p = exp(s - m) / l, mean
                   over the heads; atomically added into sums[request, key - first] (Σ over queries and
                   layers) and, for the kept queries of a multi-query step (the last ≤ 64 for the bits,
                   SnapKV's window), into rows[row, key - first]
    finish      ÷ layers → accumulated = sums, last = the last query's row (a single query's: its sums),
                bits from the ≤ 64 last rows (threshold 1/all keys the query saw)

Scored range: a request's keys ``[first, seq_len)`` only (``RequestScores.first``, from the scheduler's
``vtoken.core.scored_range``: below it every token stays forever), so the buffers, the copy back and the
host work scale with what can be evicted; ``m`` and ``l`` still cover every key.

Any head_dim (padded to a power of two ≥ 16, masked), GQA/MQA (a kv head's query heads are one tile, padded
to ≥ 16 rows for ``tl.dot``), fp16/bf16/fp32 inputs with fp32 accumulation (``ieee`` dot for fp32). CPU
tensors run through Triton's interpreter (``kernels.triton.runtime``). The launch metadata and buffers are built once
per step on the first ``add_layer`` and reused by every layer (``kernels.triton.plan``); the launch shapes follow the
step's queries and longest row.

Compiled variants (CUDA): one ``_softmax_stats``, one ``_softmax_merge`` and one ``_probs`` per model,
whatever the step. What changes from step to step is the grid (query count, splits, key tiles) and integer
arguments that are not specialised (``do_not_specialize``): ``kmax`` (the longest row), ``chunk`` and
``splits`` (the key split), ``bt_stride`` (the block table's width; each would otherwise compile a variant
for 1 and for multiples of 16) and ``q_st`` (the query's token
stride: vLLM's query may be a view of the fused qkv buffer, the warm-up's is contiguous; its alignment
goes in as the constexpr Q_ALIGN = gcd(16, q_st, q_sh), which is gcd(16, head_dim) for every ``[T, H, D]``
query whose heads are contiguous, so the query tiles keep their 16-byte loads). Everything else is fixed
per model: the constexprs (heads, head dim, block size, layout strides' alignment, dtype → PRECISION,
device → UPCAST), ``q_sh`` (= head_dim, as above), the cache strides, the pointers' dtypes and 16-byte
alignment (torch allocations; a query view starting off a 16-byte boundary would add a variant).
``TritonScoreAccumulator.warmup`` compiles all three once at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton.language as tl

from vtoken.core.step_stats import SlotScores
from vtoken.kernels.gpu_layout import PagedLayout, read_k
from vtoken.kernels.scores import (
    RequestScores,
    ScoreAccumulator,
    add_redundancy,
    kv_head_means,
    redundancy_stat,
    row_slots,
)
from vtoken.kernels.triton.finish import request_stats, widened
from vtoken.kernels.triton.plan import NO_ROW, device_meta, launch_state, plan_step
from vtoken.kernels.triton.runtime import TritonKernel
from vtoken.kernels.triton.softmax import _MERGE, _STATS, SplitPlan, launch_softmax_stats
from vtoken.kernels.triton.tiles import _SUM, TILE_HELPERS, _kv_load, _kv_rows, _logits, _query_tile


def _probs(
    q_ptr,
    q_st,
    q_sh,
    cache_ptr,
    bt_ptr,
    bt_stride,
    index_ptr,
    q_tok,
    q_req,
    q_vis,
    q_row,
    q_first,
    m_ptr,
    l_ptr,
    sums_ptr,
    rows_ptr,
    kmax,
    block_stride,
    head_stride,
    token_stride,
    scale,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    GROUP: tl.constexpr,
    G_P2: tl.constexpr,
    D: tl.constexpr,
    D_P2: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STRIDED: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    ALIGN: tl.constexpr,
    Q_ALIGN: tl.constexpr,
):
    """Program (i, j): head-mean probabilities of query i over key tile j of its scored range (row positions
    q_first[i] + j·BLOCK_N ..; m and l cover every key), added into sums (atomic, shared by the request's
    queries) and into rows[q_row[i]] when the query is kept, both at column position − first."""
    i = tl.program_id(0)
    first = tl.load(q_first + i)
    start = first + tl.program_id(1) * BLOCK_N
    vis = tl.load(q_vis + i)
    if start < vis:
        t = tl.load(q_tok + i).to(tl.int64)
        req = tl.load(q_req + i).to(tl.int64)
        h = tl.arange(0, G_P2)
        acc = tl.full([BLOCK_N], 0.0, tl.float32)
        for g in range(HKV):
            q = _query_tile(q_ptr, q_st, q_sh, t, g, GROUP, G_P2, D, D_P2, cache_ptr.dtype.element_ty, Q_ALIGN)
            kv_row, off, pos, valid = _kv_rows(
                bt_ptr, req, g, start, vis, block_stride, head_stride, bt_stride, BLOCK_SIZE, BLOCK_N
            )
            k = _kv_load(cache_ptr, index_ptr, kv_row, off, valid, token_stride, D, D_P2, WIDTH, STRIDED, ALIGN, 0)
            s = _logits(q, k, scale, UPCAST, PRECISION)
            m = tl.load(m_ptr + i * HQ + g * GROUP + h, mask=h < GROUP, other=0.0)
            den = tl.load(l_ptr + i * HQ + g * GROUP + h, mask=h < GROUP, other=1.0)
            p = tl.exp(s - m[:, None]) / den[:, None]
            p = tl.where((h < GROUP)[:, None] & valid[None, :], p, 0.0)
            acc += tl.reduce(p, 0, _SUM)
        mean = acc / HQ
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < vis
        col = pos - first
        tl.atomic_add(sums_ptr + req * kmax + col, mean, mask=valid)
        row = tl.load(q_row + i).to(tl.int64)
        if row >= 0:
            old = tl.load(rows_ptr + row * kmax + col, mask=valid, other=0.0)
            tl.store(rows_ptr + row * kmax + col, old + mean, mask=valid)


_PROBS = TritonKernel(_probs, helpers=TILE_HELPERS, do_not_specialize=("q_st", "bt_stride", "kmax"))
# by name, for the device check's compiled-variant counts
KERNELS = {"_softmax_stats": _STATS, "_softmax_merge": _MERGE, "_probs": _PROBS}


@dataclass
class TritonScoreAccumulator(ScoreAccumulator):
    """``ScoreAccumulator`` whose attention statistics come from the Triton kernels (``layout``: a
    ``PagedLayout``). ``block_n``: keys per tile; ``split_keys``, ``max_splits``: the split of the softmax
    statistics over key ranges (``kernels.triton.softmax.plan_splits``: one split up to ``split_keys`` keys)."""

    block_n: int = 32
    split_keys: int = 2048
    max_splits: int = 16
    _meta: dict | None = None

    def _plan(self, scored: list[RequestScores], device: torch.device) -> dict:
        """The step's launch metadata (``kernels.triton.plan.plan_step``), built once, used by every layer."""
        return plan_step(scored, device, self.block_n, self.split_keys, self.max_splits)

    @classmethod
    def warmup(
        cls,
        layout: PagedLayout,
        kv_cache: torch.Tensor,
        num_q_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        scale: float,
        block_n: int | None = None,
    ) -> None:
        """Compile (CUDA) the model's one ``_softmax_stats``, ``_softmax_merge`` and ``_probs`` variant
        (module doc): each launched once through the same ``_launch`` as a step (the merge forced), for one
        scratch query of ``num_q_heads × head_dim`` in ``dtype`` that sees no key (visible length 0, no kept
        row), so no kernel reads or writes ``kv_cache`` (only its pointer, dtype and device are used). Side
        effects: scratch buffers, three launches on the current stream (asynchronous), Triton's compile
        cache. Call once at start-up, outside graph capture, with any layer's cache view (all layers share
        one layout). ``block_n``: the accumulators' (default: the class default). Raises ``ValueError`` on
        heads or head_dim that do not fit ``layout``."""
        if head_dim != layout.head_dim or num_q_heads < 1 or num_q_heads % layout.num_kv_heads:
            raise ValueError(
                f"warmup: {num_q_heads} query heads of {head_dim} do not fit "
                f"{layout.num_kv_heads} kv heads of {layout.head_dim}"
            )
        acc = cls(layout) if block_n is None else cls(layout, block_n=block_n)
        device = kv_cache.device
        tables = np.array([[0], [0], [0], [NO_ROW], [0]], dtype=np.int32)  # QUERY_FIELDS of one query
        one = SplitPlan(1, acc.block_n)
        meta = device_meta(device, tables, torch.zeros(1, 1, dtype=torch.int32), 1, 0, one)
        query = torch.zeros(1, num_q_heads, head_dim, dtype=dtype, device=device)
        acc._launch(query, kv_cache, scale, meta, merge=True)

    def add_layer(self, query: torch.Tensor, key: torch.Tensor | None, kv_cache: torch.Tensor, scale: float) -> None:
        """Fold one layer in (see ``ScoreAccumulator.add_layer``); mutates the step's sums/rows buffers."""
        scored = [rs for rs in self.requests.values() if rs.want_attention]
        if scored:
            if self._meta is None:
                self._meta = self._plan(scored, kv_cache.device)
            self._launch(query, kv_cache, scale, self._meta)
            for rs in scored:
                if rs.want_redundancy:  # torch: the live keys through the paged layout (docs/gpu.md)
                    if rs.live_slots is None or rs.live_slots.device != kv_cache.device:
                        row = rs.block_row.to(kv_cache.device)
                        rs.live_slots = row_slots(row, rs.seq_len, self.layout.block_size)
                    add_redundancy(rs, read_k(kv_cache, self.layout, rs.live_slots))
                rs.layers += 1
        self._add_key_norms(key)

    def _launch(
        self, query: torch.Tensor, kv_cache: torch.Tensor, scale: float, meta: dict, merge: bool = False
    ) -> None:
        """One layer's launches: the split softmax statistics (and their merge: always when ``merge``), then
        ``_probs`` into ``meta``'s sums/rows. Mutates ``meta`` (its buffers; ``launch_state`` on the first
        layer). Asynchronous on CUDA."""
        lay: PagedLayout = self.layout
        if query.stride(-1) != 1:
            query = query.contiguous()
        state = launch_state(meta, lay, query, kv_cache, self.block_n)
        common, (m, den) = state["constexprs"], state["out"]
        head = (
            query,
            query.stride(0),
            query.stride(1),
            kv_cache,
            meta["bt"],
            meta["bt"].stride(0),
            state["index"],
            meta["tok"],
            meta["req"],
            meta["vis"],
        )
        tail = (lay.block_stride, lay.head_stride, lay.token_stride or 0, float(scale))
        device = kv_cache.device
        launch_softmax_stats(
            device, meta["split"], lay.num_kv_heads, head, tail, state["parts"], (m, den), common, merge
        )
        tiles = -(-meta["kmax"] // self.block_n)
        _PROBS.launch(
            device,
            (int(meta["tok"].numel()), tiles),
            *head,
            meta["row"],
            meta["first"],
            m,
            den,
            meta["sums"],
            meta["rows"],
            meta["kmax"],
            *tail,
            HKV=lay.num_kv_heads,
            **common,
        )

    def linear_buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``(attention, key norms)`` (see ``ScoreAccumulator.linear_buffers``): the step's sums and kept
        query rows (not when no query is kept: a decode-only step), then the key norms. Pure."""
        norms = kv_head_means(self.requests.values())
        meta = self._meta
        attention = [] if meta is None else [meta["sums"], meta["rows"]] if meta["n_rows"] else [meta["sums"]]
        return attention, norms

    def to_host(self, copy) -> None:
        """Replace the step's sums, kept query rows and key norms with ``copy(buffer)`` (see
        ``ScoreAccumulator.to_host``). Mutates the buffers' owners."""
        if self._meta is not None:
            self._meta["sums"] = copy(self._meta["sums"])
            if self._meta["n_rows"]:
                self._meta["rows"] = copy(self._meta["rows"])
        for rs in self.requests.values():
            rs.key_norm = copy(rs.key_norm) if rs.key_norm is not None else None
            rs.redundancy = copy(rs.redundancy) if rs.redundancy is not None else None

    def finish(self) -> dict[str, SlotScores]:
        """Per request: the same ``SlotScores`` as ``ScoreAccumulator.finish`` (pure apart from reading)."""
        meta = self._meta
        attention: dict[int, dict] = {}
        if meta is not None:
            sums = widened(meta["sums"].cpu().numpy(), meta["scored"])
            rows = meta["rows"].cpu().numpy() if meta["n_rows"] else None
            start = 0
            for r, rs in enumerate(meta["scored"]):
                attention[id(rs)] = request_stats(rs, sums[r], rows, start, meta["kept"][r])
                start += len(meta["kept"][r])
        out: dict[str, SlotScores] = {}
        for rid, rs in self.requests.items():
            stats = dict(attention.get(id(rs), {}))
            if rs.key_norm is not None and rs.norm_layers:
                stats["key_norm"] = (rs.key_norm / rs.norm_layers).cpu().numpy().astype(np.float64)
            stats.update(redundancy_stat(rs))
            out[rid] = SlotScores(n_queries=rs.n_q, seq_len=rs.seq_len, first=rs.first, **stats)
        return out
