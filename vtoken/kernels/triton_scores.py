"""``TritonScoreAccumulator``: the policies' attention statistics from two Triton kernels per layer.

Same contract and results as ``ScoreAccumulator`` (the torch reference, ``scores.py``): for a step's
queries, ``softmax(q·Kᵀ·scale)`` over each request's live row slots ``0..seq_len-1`` (read through its block
table and the cache's ``PagedLayout``), causal within the step, mean over heads, summed over layers, reduced
to ``SlotScores`` (``accumulated``, ``last``, ``unimportant`` bits, ``window``; ``key_norm`` and R-KV's
``redundancy``, a gather of the live keys and ``key_redundancy``, stay torch). The
attention kernel returns no weights, so they are recomputed after it ran; never the full ``[n_q, seq_len]``
matrix, only what the statistics need:

    per layer   1. _softmax_stats  grid (queries, kv heads): row max m and normaliser l of every (query,
                   head) over its visible keys (online softmax over key tiles of the block table)
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
tensors run through Triton's interpreter (``triton_runtime``). Buffers are allocated per step on the first
``add_layer``; the launch shapes follow the step's queries and longest row.

Compiled variants (CUDA): one ``_softmax_stats`` and one ``_probs`` per model, whatever the step. What
changes from step to step is the grid (query count, key tiles) and three integer arguments that are not
specialised (``do_not_specialize``): ``kmax`` (the longest row), ``bt_stride`` (the block table's width;
both would otherwise compile a variant for 1 and for multiples of 16) and ``q_st`` (the query's token
stride: vLLM's query may be a view of the fused qkv buffer, the warm-up's is contiguous; its alignment
goes in as the constexpr Q_ALIGN = gcd(16, q_st, q_sh), which is gcd(16, head_dim) for every ``[T, H, D]``
query whose heads are contiguous, so the query tiles keep their 16-byte loads). Everything else is fixed
per model: the constexprs (heads, head dim, block size, layout strides' alignment, dtype → PRECISION,
device → UPCAST), ``q_sh`` (= head_dim, as above), the cache strides, the pointers' dtypes and 16-byte
alignment (torch allocations; a query view starting off a 16-byte boundary would add a variant).
``TritonScoreAccumulator.warmup`` compiles both once at start-up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import triton.language as tl

from vtoken.core.stats import SlotScores, unimportance_bits
from vtoken.kernels.gpu_layout import PagedLayout, read_k
from vtoken.kernels.scores import (
    RequestScores,
    ScoreAccumulator,
    add_redundancy,
    kv_head_means,
    redundancy_stat,
    row_slots,
)
from vtoken.kernels.triton_runtime import TritonKernel, next_pow2
from vtoken.policies.context import HISTORY_BITS, OBSERVATION_WINDOW

# Triton's own combine functions: tl.reduce with them is tl.sum / tl.max, and the interpreter maps them to
# numpy; tl.sum, tl.max and tl.zeros themselves are @jit functions that an interpreted kernel cannot call
# unless TRITON_INTERPRET was set before triton was imported (triton_runtime).
_SUM = tl.standard._sum_combine
_MAX = tl.standard._elementwise_max


def _kv_tile(
    cache_ptr,
    bt_ptr,
    index_ptr,
    req,
    g,
    start,
    vis,
    block_stride,
    head_stride,
    token_stride,
    bt_stride,
    BLOCK_SIZE,
    BLOCK_N,
    D,
    D_P2,
    WIDTH,
    STRIDED,
    ALIGN,
    C0,
):
    """Keys (C0 = 0) or values (C0 = D) of row positions start..start+BLOCK_N-1 of request ``req``, kv head
    ``g``, through its block table: ``[BLOCK_N, D_P2]`` (0 beyond ``vis`` or D), positions, validity. Element
    offsets are int64 (a layer view of vLLM's LHBNC layout exceeds 2^31 elements on an H200-sized cache:
    ``g * head_stride`` alone does, and Triton passes a stride below 2^31 as int32)."""
    pos = start + tl.arange(0, BLOCK_N)
    valid = pos < vis
    d = tl.arange(0, D_P2)[None, :]
    blk = tl.load(bt_ptr + req.to(tl.int64) * bt_stride + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    off = (pos % BLOCK_SIZE).to(tl.int64)[:, None]
    kmask = valid[:, None] & (d < D)
    row = blk[:, None] * block_stride + g * head_stride.to(tl.int64)  # g: a Python int when interpreted
    if STRIDED:  # [ALIGN, ALIGN], not [ALIGN, 1]: every element is a multiple of ALIGN, along the size-1
        # dim too; triton 3.6 takes dim 1's divisibility from the hint and with 1 loaded the keys element by
        # element (ld.global.b16, no cp.async pipelining); 3.9 vectorised either way (test_triton_compile)
        at = tl.multiple_of(row + off * token_stride, [ALIGN, ALIGN]) + C0 + d
    else:
        at = row + tl.load(index_ptr + off * WIDTH + C0 + d, mask=kmask, other=0)
    k = tl.load(cache_ptr + at, mask=kmask, other=0.0)
    return k, pos, valid


def _query_tile(q_ptr, q_st, q_sh, t, g, GROUP, G_P2, D, D_P2, dtype, Q_ALIGN):
    """Query token ``t``'s heads of kv group ``g``: ``[G_P2, D_P2]`` (0 beyond GROUP or D); int64 offsets.
    Q_ALIGN divides q_st (16-byte vector loads although q_st itself is not specialised)."""
    h = tl.arange(0, G_P2)[:, None]
    d = tl.arange(0, D_P2)[None, :]
    at = tl.multiple_of(t.to(tl.int64) * q_st, Q_ALIGN) + (g * GROUP + h).to(tl.int64) * q_sh
    q = tl.load(q_ptr + at + d, mask=(h < GROUP) & (d < D), other=0.0)
    return q.to(dtype)


def _logits(q, k, scale, UPCAST, PRECISION):
    if UPCAST:  # Triton 3.9's interpreter returns garbage from a bf16 tl.dot: CPU tensors go through fp32
        return tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
    return tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale


def _softmax_stats(
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
    m_ptr,
    l_ptr,
    block_stride,
    head_stride,
    token_stride,
    scale,
    HQ: tl.constexpr,
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
    """Program (i, g): m and l of query i's heads in kv group g (writes m_ptr/l_ptr[i, heads])."""
    i = tl.program_id(0)
    g = tl.program_id(1)
    t = tl.load(q_tok + i).to(tl.int64)
    req = tl.load(q_req + i).to(tl.int64)
    vis = tl.load(q_vis + i)
    q = _query_tile(q_ptr, q_st, q_sh, t, g, GROUP, G_P2, D, D_P2, cache_ptr.dtype.element_ty, Q_ALIGN)
    m = tl.full([G_P2], float("-inf"), tl.float32)
    den = tl.full([G_P2], 0.0, tl.float32)
    for start in range(0, vis, BLOCK_N):  # interpreted: range() calls vis.__index__ (triton_runtime)
        k, pos, valid = _kv_tile(
            cache_ptr,
            bt_ptr,
            index_ptr,
            req,
            g,
            start,
            vis,
            block_stride,
            head_stride,
            token_stride,
            bt_stride,
            BLOCK_SIZE,
            BLOCK_N,
            D,
            D_P2,
            WIDTH,
            STRIDED,
            ALIGN,
            0,
        )
        s = _logits(q, k, scale, UPCAST, PRECISION)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.reduce(s, 1, _MAX))
        den = den * tl.exp(m - m_new) + tl.reduce(tl.exp(s - m_new[:, None]), 1, _SUM)
        m = m_new
    h = tl.arange(0, G_P2)
    tl.store(m_ptr + i * HQ + g * GROUP + h, m, mask=h < GROUP)
    tl.store(l_ptr + i * HQ + g * GROUP + h, den, mask=h < GROUP)


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
            k, pos, valid = _kv_tile(
                cache_ptr,
                bt_ptr,
                index_ptr,
                req,
                g,
                start,
                vis,
                block_stride,
                head_stride,
                token_stride,
                bt_stride,
                BLOCK_SIZE,
                BLOCK_N,
                D,
                D_P2,
                WIDTH,
                STRIDED,
                ALIGN,
                0,
            )
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


_STATS = TritonKernel(_softmax_stats, helpers=(_kv_tile, _query_tile, _logits), do_not_specialize=("q_st", "bt_stride"))
_PROBS = TritonKernel(_probs, helpers=(_kv_tile, _query_tile, _logits), do_not_specialize=("q_st", "bt_stride", "kmax"))
NO_ROW = -1  # a query whose probabilities no kept row records (q_row)
KERNELS = {"_softmax_stats": _STATS, "_probs": _PROBS}  # by name, for the device check's variant counts


def _device_meta(
    device: torch.device,
    tok: list[int],
    req: list[int],
    vis: list[int],
    row: list[int],
    first: list[int],
    bt: torch.Tensor,
    kmax: int,
    n_rows: int,
) -> dict:
    """The launch metadata on ``device``: int32 query tables (``first``: each query's first scored row
    position), the int32 block table, zeroed fp32 ``sums`` ``[requests, kmax]`` (``kmax``: the longest
    scored range) and ``rows`` ``[n_rows, kmax]`` (``[1, 1]``, never written, without kept rows;
    ``n_rows`` records how many) (new tensors; pure)."""

    def dev(values):  # CUDA: through pinned memory, so planning never waits for the stream
        t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.int32)
        return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)

    return dict(
        tok=dev(tok),
        req=dev(req),
        vis=dev(vis),
        row=dev(row),
        first=dev(first),
        bt=dev(bt),
        kmax=kmax,
        n_rows=n_rows,
        sums=torch.zeros(bt.shape[0], kmax, device=device),
        rows=torch.zeros(n_rows or 1, kmax if n_rows else 1, device=device),
    )


def kept_queries(rs: RequestScores) -> list[int]:
    """Query indices whose rows ``finish`` needs: the last ≤ ``HISTORY_BITS`` and SnapKV's window; none for
    a single query (its row is bit-identical to the request's sums, which ``finish`` reads instead) (pure)."""
    if rs.n_q == 1:
        return []
    keep = set(range(max(0, rs.n_q - HISTORY_BITS), rs.n_q))
    if rs.window:
        keep.update(range(max(rs.window - OBSERVATION_WINDOW, 0), rs.window))
    return sorted(keep)


@dataclass
class TritonScoreAccumulator(ScoreAccumulator):
    """``ScoreAccumulator`` whose attention statistics come from the Triton kernels (``layout``: a
    ``PagedLayout``)."""

    block_n: int = 32
    _meta: dict | None = None

    def _plan(self, scored: list[RequestScores], device: torch.device) -> dict:
        tok, req, vis, row, first, tables, kept = [], [], [], [], [], [], []
        n_rows = 0
        for r, rs in enumerate(scored):
            keep = kept_queries(rs)
            where = {qi: n_rows + j for j, qi in enumerate(keep)}
            n_rows += len(keep)
            kept.append(keep)
            for qi in range(rs.n_q):
                tok.append(rs.q_start + qi)
                req.append(r)
                vis.append(rs.seq_len - rs.n_q + qi + 1)
                row.append(where.get(qi, NO_ROW))
                first.append(rs.first)
            tables.append(rs.block_row.to("cpu", torch.int32))
        width = max(int(t.numel()) for t in tables)
        bt = torch.zeros(len(scored), width, dtype=torch.int32)
        for r, t in enumerate(tables):
            bt[r, : t.numel()] = t
        kmax = max(max(rs.seq_len - rs.first for rs in scored), 1)
        return dict(_device_meta(device, tok, req, vis, row, first, bt, kmax, n_rows), kept=kept, scored=scored)

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
        """Compile (CUDA) the model's one ``_softmax_stats`` and one ``_probs`` variant (module doc): both
        launched once through the same ``_launch`` as a step, for one scratch query of ``num_q_heads ×
        head_dim`` in ``dtype`` that sees no key (visible length 0, no kept row), so neither kernel reads or
        writes ``kv_cache`` (only its pointer, dtype and device are used). Side effects: scratch buffers,
        two launches on the current stream (asynchronous), Triton's compile cache. Call once at start-up,
        outside graph capture, with any layer's cache view (all layers share one layout). ``block_n``: the
        accumulators' (default: the class default). Raises ``ValueError`` on heads or head_dim that do not
        fit ``layout``."""
        if head_dim != layout.head_dim or num_q_heads < 1 or num_q_heads % layout.num_kv_heads:
            raise ValueError(
                f"warmup: {num_q_heads} query heads of {head_dim} do not fit "
                f"{layout.num_kv_heads} kv heads of {layout.head_dim}"
            )
        acc = cls(layout) if block_n is None else cls(layout, block_n=block_n)
        device = kv_cache.device
        meta = _device_meta(device, [0], [0], [0], [NO_ROW], [0], torch.zeros(1, 1, dtype=torch.int32), 1, 0)
        query = torch.zeros(1, num_q_heads, head_dim, dtype=dtype, device=device)
        acc._launch(query, kv_cache, scale, meta)

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
        for rs in self.requests.values():
            if rs.want_key_norm and key is not None:
                n = key[rs.q_start : rs.q_end].float().norm(dim=-1).mean(dim=-1)
                rs.key_norm = n if rs.key_norm is None else rs.key_norm + n
                rs.norm_layers += 1

    def _launch(self, query: torch.Tensor, kv_cache: torch.Tensor, scale: float, meta: dict) -> None:
        lay: PagedLayout = self.layout
        if query.stride(-1) != 1:
            query = query.contiguous()
        heads, d = query.shape[1], query.shape[2]
        group = heads // lay.num_kv_heads
        nq = int(meta["tok"].numel())
        m = torch.empty(nq, heads, dtype=torch.float32, device=kv_cache.device)
        den = torch.empty_like(m)
        index = lay.index.to(device=kv_cache.device, dtype=torch.int32)
        common = dict(
            HQ=heads,
            GROUP=group,
            G_P2=max(16, next_pow2(group)),
            D=d,
            D_P2=max(16, next_pow2(d)),
            WIDTH=lay.width,
            BLOCK_SIZE=lay.block_size,
            BLOCK_N=self.block_n,
            STRIDED=lay.token_stride is not None,
            PRECISION="ieee" if kv_cache.dtype == torch.float32 else "tf32",
            UPCAST=kv_cache.device.type == "cpu",
            ALIGN=math.gcd(16, lay.block_stride, lay.head_stride, lay.token_stride or 1),
            Q_ALIGN=math.gcd(16, query.stride(0), query.stride(1)),
        )
        head = (
            query,
            query.stride(0),
            query.stride(1),
            kv_cache,
            meta["bt"],
            meta["bt"].stride(0),
            index,
            meta["tok"],
            meta["req"],
            meta["vis"],
        )
        tail = (lay.block_stride, lay.head_stride, lay.token_stride or 0, float(scale))
        _STATS.launch(kv_cache.device, (nq, lay.num_kv_heads), *head, m, den, *tail, **common)
        tiles = -(-meta["kmax"] // self.block_n)
        _PROBS.launch(
            kv_cache.device,
            (nq, tiles),
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
            sums = _widened(meta["sums"].cpu().numpy(), meta["scored"])
            rows = meta["rows"].cpu().numpy() if meta["n_rows"] else None
            start = 0
            for r, rs in enumerate(meta["scored"]):
                attention[id(rs)] = _request_stats(rs, sums[r], rows, start, meta["kept"][r])
                start += len(meta["kept"][r])
        out: dict[str, SlotScores] = {}
        for rid, rs in self.requests.items():
            stats = dict(attention.get(id(rs), {}))
            if rs.key_norm is not None and rs.norm_layers:
                stats["key_norm"] = (rs.key_norm / rs.norm_layers).cpu().numpy().astype(np.float64)
            stats.update(redundancy_stat(rs))
            out[rid] = SlotScores(n_queries=rs.n_q, seq_len=rs.seq_len, first=rs.first, **stats)
        return out


def _widened(sums: np.ndarray, scored: list[RequestScores]) -> np.ndarray | list[np.ndarray]:
    """Each request's ``sums`` row over its scored range, float64, divided by its layers: the whole buffer
    at once when the ranges fill at least half of it (a decode batch of similar rows: a few numpy calls in
    all), else each request's slice alone (never a long row's width for every request). Pure."""
    used = sum(rs.seq_len - rs.first for rs in scored)
    if 2 * used >= sums.size:
        return sums.astype(np.float64) / np.array([float(rs.layers) for rs in scored])[:, None]
    return [sums[r, : rs.seq_len - rs.first].astype(np.float64) / rs.layers for r, rs in enumerate(scored)]


def _request_stats(
    rs: RequestScores, sums: np.ndarray, rows: np.ndarray | None, start: int, keep: list[int]
) -> dict[str, np.ndarray]:
    """One request's attention statistics over its scored range (``seq_len - first`` columns) from the
    host buffers: its ``sums`` row (float64, ÷ layers: ``_widened``) and, from row ``start``, the rows of its
    ``keep`` queries (none for a single query: its row is its sums), each sliced before it is widened. The
    arrays may share memory with each other and the buffers: read-only. Pure."""
    n = rs.seq_len - rs.first
    acc = sums[:n]
    if not keep:  # one query: accumulated, last and the window are its row
        # unimportance_bits of one row that saw every key: bit 0 ⇔ below 1/seq_len (same values, no 2-D pass)
        stats = {"accumulated": acc, "last": acc, "unimportant": (acc < 1.0 / rs.seq_len).astype(np.uint64)}
        if rs.window:
            stats["window"] = acc
        return stats
    by_q = dict(zip(keep, rows[start : start + len(keep), :n].astype(np.float64) / rs.layers))
    last = [qi for qi in keep if qi >= rs.n_q - HISTORY_BITS]
    seen = np.array(last)[:, None] + rs.seq_len - rs.n_q + 1  # keys each kept query saw, in all
    visible = np.arange(rs.first, rs.seq_len)[None, :] < seen
    stats = {
        "accumulated": acc,
        "last": by_q[rs.n_q - 1].copy(),
        "unimportant": unimportance_bits(np.stack([by_q[qi] for qi in last]), visible, seen[:, 0]),
    }
    if rs.window:
        rows_w = range(max(rs.window - OBSERVATION_WINDOW, 0), rs.window)
        stats["window"] = sum(by_q[qi] for qi in rows_w)
    return stats
