"""Kernel correctness checks shared by ``vtoken bench kernels`` and ``scripts/gpu_check.py``.

Torch, numpy and ``vtoken.kernels`` only (no vLLM, typer, rich): the GPU check runs it on a machine that has
nothing else. Everything is seeded; nothing here touches a tensor it did not allocate.

* ``scheduler_plan``: a multi-request repack plan built like ``TokenTable.plan`` builds one per request
  (holes below ``live`` ascending ← live tail tokens at slots ≥ ``live`` descending), through block rows
  drawn from one shuffled pool, so the requests' physical source and destination ranges interleave.
* ``check_moves`` / ``check_scores``: a backend (``torch`` or ``triton``) against the layout-generic torch
  reference (``PagedTorchMover``, ``PagedScoreAccumulator``): every K and V element, and the statistics;
  the unimportance bits through ``compare_unimportance_bits`` (a flip is accepted only at a near-tie).
* ``large_offsets_check``: moves and scores on the highest kv heads and blocks of a cache whose layer view
  exceeds 2^31 elements (vLLM's LHBNC layout at H200 scale), allocated uninitialised so that only the
  touched blocks cost memory.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vtoken.kernels.gpu_layout import (
    BACKEND_LAYOUTS,
    KV_CACHE_LAYOUTS,
    PagedLayout,
    PagedScoreAccumulator,
    PagedTorchMover,
    allocate_kv_caches,
    element_offsets,
    gather,
    layout_for,
    scatter,
)
from vtoken.kernels.layout import TokenLayout
from vtoken.kernels.moves import TorchSlotMover
from vtoken.kernels.scores import RequestScores, ScoreAccumulator, layer_mean_probs
from vtoken.policies.context import HISTORY_BITS

BACKENDS = ("torch", "triton")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# A flipped unimportance bit is a near-tie when the reference probability is within this fraction of the
# threshold 1/visible: the kernels sum bf16/fp16 products in fp32 in another order than torch, which moves
# a probability by ~1e-6 of itself; a wrong key, head or row moves it by far more than 1e-3.
NEAR_TIE_RTOL = 1e-3


@dataclass(frozen=True)
class Shape:
    layers: int
    kv_heads: int
    q_heads: int
    head_dim: int
    block_size: int
    blocks: int
    dtype: torch.dtype = torch.float32


@dataclass
class Plan:
    rows: list[np.ndarray]  # each request's block ids, row order
    seen: list[int]  # each request's tokens before eviction (row slots 0..seen-1)
    victims: list[np.ndarray]  # each request's evicted row slots
    live: list[int]  # each request's live tokens after the plan (its dense row length)
    src: torch.Tensor  # int64 physical slots
    dst: torch.Tensor
    ranges_overlap: bool  # some request's source range overlaps another request's destination range


def scheduler_plan(rng: np.random.Generator, requests: int, blocks: int, block_size: int) -> Plan:
    """Per request: a row of random pool blocks, a random number of tokens, random victims, and the plan
    that makes the row dense again (``TokenTable.plan``'s rule). Pure apart from drawing from ``rng``."""
    pool = rng.permutation(blocks)
    per = max(1, blocks // max(requests, 1))
    rows, seens, dead, lives, srcs, dsts, spans = [], [], [], [], [], [], []
    for r in range(requests):
        row = pool[r * per : (r + 1) * per]
        if row.size == 0:
            break
        seen = int(rng.integers(max(1, (row.size - 1) * block_size + 1), row.size * block_size + 1))
        victims = rng.random(seen) < rng.uniform(0.1, 0.6)
        victims[0] = False  # at least one live token
        live = seen - int(victims.sum())
        holes = np.flatnonzero(victims[:live])
        tail = (np.flatnonzero(~victims[live:]) + live)[::-1][: holes.size]
        phys_src = row[tail // block_size] * block_size + tail % block_size
        phys_dst = row[holes // block_size] * block_size + holes % block_size
        rows.append(row)
        seens.append(seen)
        dead.append(np.flatnonzero(victims))
        lives.append(live)
        srcs.append(phys_src)
        dsts.append(phys_dst)
        if holes.size:
            spans.append((r, phys_src.min(), phys_src.max(), phys_dst.min(), phys_dst.max()))
    overlap = any(a != b and s0 <= d1 and d0 <= s1 for a, s0, s1, _, _ in spans for b, _, _, d0, d1 in spans)
    src = torch.from_numpy(np.concatenate(srcs).astype(np.int64))
    dst = torch.from_numpy(np.concatenate(dsts).astype(np.int64))
    return Plan(rows, seens, dead, lives, src, dst, overlap)


def fill_random(caches: list[torch.Tensor], seed: int) -> None:
    """Random values in every layer view (mutates them), drawn in fp32 by a generator seeded with ``seed`` on
    the caches' own device: on the CPU the values are the same as ever, on CUDA no value crosses from the host
    (``scripts/gpu_check.py`` fills ~28e9 elements; the host's generator took most of its time budget)."""
    gen = torch.Generator(device=caches[0].device).manual_seed(seed)
    for kv in caches:
        kv.copy_(torch.randn(kv.shape, generator=gen, device=kv.device).to(kv.dtype))


def copy_caches(name: str, caches: list[torch.Tensor], shape: Shape) -> list[torch.Tensor]:
    """A second set of layer views in the same layout holding the same values (``clone`` would not keep
    the layout's strides)."""
    out = allocate_kv_caches(
        name,
        shape.layers,
        shape.blocks,
        shape.block_size,
        shape.kv_heads,
        shape.head_dim,
        shape.dtype,
        caches[0].device,
    )
    for a, b in zip(out, caches):
        a.copy_(b)
    return out


def make_mover(backend: str, name: str, layout: PagedLayout, capacity: int = 512):
    """``triton``: ``TritonSlotMover``; ``torch``: the production CPU mover on ``cpu``, else the paged one."""
    if backend == "triton":
        from vtoken.kernels.triton.moves import TritonSlotMover

        return TritonSlotMover(layout, capacity=capacity)
    if name == "cpu":
        return TorchSlotMover(TokenLayout(layout.block_size, layout.head_dim, layout.index))
    return PagedTorchMover(layout)


def make_accumulator(backend: str, name: str, layout: PagedLayout) -> ScoreAccumulator:
    if backend == "triton":
        from vtoken.kernels.triton.scores import TritonScoreAccumulator

        return TritonScoreAccumulator(layout)
    if name == "cpu":
        return ScoreAccumulator(TokenLayout(layout.block_size, layout.head_dim, layout.index))
    return PagedScoreAccumulator(layout)


def setup(name: str, shape: Shape, device: str, seed: int) -> tuple[list[torch.Tensor], PagedLayout]:
    caches = allocate_kv_caches(
        name, shape.layers, shape.blocks, shape.block_size, shape.kv_heads, shape.head_dim, shape.dtype, device
    )
    fill_random(caches, seed)
    return caches, layout_for(name, caches[0])


def check_moves(
    backend: str,
    name: str,
    shape: Shape,
    device: str,
    plan: Plan,
    seed: int,
    capacity: int = 512,
    plan_on_device: bool = False,
) -> dict:
    """Run ``plan`` with the backend and with the reference on equal caches; compare every element. The
    plan is handed over on the host, as the worker does (the Triton mover then sees it is disjoint: one
    direct launch), or with ``plan_on_device`` already on ``device`` (Triton: the staged pair)."""
    caches, layout = setup(name, shape, device, seed)
    ref = copy_caches(name, caches, shape)
    mover = make_mover(backend, name, layout, capacity)
    where = device if plan_on_device else "cpu"
    mover.move(caches, plan.src.to(where), plan.dst.to(where))
    PagedTorchMover(layout).move(ref, plan.src.to(device), plan.dst.to(device))
    bad = sum(int((a != b).sum()) for a, b in zip(caches, ref))
    return {"moves": int(plan.src.numel()), "moves_exact": bad == 0, "moves_mismatched_elements": bad}


def score_specs(plan: Plan, rng: np.random.Generator, max_queries: int = 5) -> list[tuple]:
    """Per request ``(q_start, q_end, seq_len, block_row)``: a decode query or a short prefill chunk over
    its dense row (the ``live`` slots after the plan)."""
    specs, start = [], 0
    for row, live in zip(plan.rows, plan.live):
        n_q = int(min(live, 1 if rng.random() < 0.5 else rng.integers(2, max_queries + 1)))
        specs.append((start, start + n_q, live, torch.from_numpy(row.astype(np.int64))))
        start += n_q
    return specs


def run_scores(
    acc: ScoreAccumulator, caches: list[torch.Tensor], specs: list[tuple], query: torch.Tensor, scale: float
) -> dict:
    """Fold every layer into ``acc`` (a different query scale per layer) and finish (mutates ``acc``)."""
    for i, (q0, q1, n, row) in enumerate(specs):
        acc.requests[f"r{i}"] = RequestScores(
            q0, q1, n, row.to(caches[0].device), want_attention=True, want_key_norm=False
        )
    for layer, kv in enumerate(caches):
        acc.add_layer(query * (1.0 + 0.1 * layer), None, kv, scale)
    return acc.finish()


@dataclass(frozen=True)
class BitsComparison:
    mismatched: int  # bits (query row, key) where the backend and the reference disagree
    near_threshold: int  # of those, where the reference probability is a near-tie (NEAR_TIE_RTOL)

    @property
    def ok(self) -> bool:
        """Every mismatch is a near-tie."""
        return self.mismatched == self.near_threshold

    def __add__(self, other: BitsComparison) -> BitsComparison:
        return BitsComparison(self.mismatched + other.mismatched, self.near_threshold + other.near_threshold)


def compare_unimportance_bits(
    got: np.ndarray, ref: np.ndarray, probs: np.ndarray, visible: np.ndarray, rtol: float = NEAR_TIE_RTOL
) -> BitsComparison:
    """Compare two ``unimportance_bits`` results (uint64 ``[k]``) where ``ref`` was computed from ``probs``
    and ``visible`` (``[q, k]``, oldest query first, as ``unimportance_bits`` takes them). A bit is set where
    a row's probability is below ``1 / visible keys``; a disagreement counts as a near-tie when the reference
    probability is within ``rtol × threshold`` of that threshold (a correct kernel summing in another order
    may land on either side), otherwise it is an error. Pure."""
    rows = probs[max(0, probs.shape[0] - HISTORY_BITS) :]
    vis = visible[max(0, visible.shape[0] - HISTORY_BITS) :]
    threshold = 1.0 / np.maximum(vis.sum(axis=1, keepdims=True), 1)  # [h, 1]
    diff = np.asarray(got, dtype=np.uint64) ^ np.asarray(ref, dtype=np.uint64)
    bit = np.arange(rows.shape[0] - 1, -1, -1, dtype=np.uint64)[:, None]  # newest row → bit 0
    flipped = ((diff[None, :] >> bit) & np.uint64(1)).astype(bool)  # [h, k]
    # bits beyond the rows (a row count mismatch) have no probability: all of them are errors
    extra = int(sum(bin(int(v) >> rows.shape[0]).count("1") for v in diff)) if rows.shape[0] < 64 else 0
    near = flipped & (np.abs(rows - threshold) <= rtol * threshold)
    return BitsComparison(int(flipped.sum()) + extra, int(near.sum()))


def compare_scores(got: dict, ref: dict, ref_acc: ScoreAccumulator) -> dict:
    """``got`` vs ``ref`` (``finish`` results; ``ref_acc``: the reference accumulator after its ``finish``):
    max |Δ| over ``accumulated`` and ``last``, the unimportance bits' mismatches (near-ties apart). Pure."""
    err = max(
        float(np.max(np.abs(getattr(got[k], f) - getattr(ref[k], f)))) for k in ref for f in ("accumulated", "last")
    )
    bits = BitsComparison(0, 0)
    for k in ref:
        probs, visible = layer_mean_probs(ref_acc.requests[k])
        bits += compare_unimportance_bits(got[k].unimportant, ref[k].unimportant, probs, visible)
    return {
        "scores_max_abs_err": err,
        "bits_mismatched": bits.mismatched,
        "bits_mismatched_near_threshold": bits.near_threshold,
        "bits_near_tie_rtol": NEAR_TIE_RTOL,
        "scores_bits_ok": bits.ok,
    }


def check_scores(backend: str, name: str, shape: Shape, device: str, plan: Plan, seed: int) -> dict:
    """Statistics of the backend vs the reference on one random step (``compare_scores``)."""
    caches, layout = setup(name, shape, device, seed)
    rng = np.random.default_rng(seed)
    specs = score_specs(plan, rng)
    gen = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(specs[-1][1], shape.q_heads, shape.head_dim, generator=gen).to(shape.dtype).to(device)
    scale = shape.head_dim**-0.5
    got = run_scores(make_accumulator(backend, name, layout), caches, specs, query, scale)
    ref_acc = PagedScoreAccumulator(layout)
    ref = run_scores(ref_acc, caches, specs, query, scale)
    return {"score_queries": int(query.shape[0]), **compare_scores(got, ref, ref_acc)}


def empty_kv_caches(name: str, shape: Shape, device: str) -> list[torch.Tensor]:
    """``allocate_kv_caches`` without the zeros: uninitialised layer views of a CUDA layout (one backing
    buffer), so on the CPU only the pages a check writes or reads get memory (the kernels' interpreter reads
    raw addresses; nothing copies the buffer). Contents undefined until written."""
    order = KV_CACHE_LAYOUTS[BACKEND_LAYOUTS.get(name, name)]
    logical = (shape.layers, shape.blocks, shape.kv_heads, shape.block_size, 2 * shape.head_dim)
    raw = torch.empty([logical[d] for d in order], dtype=shape.dtype, device=device)
    five = raw.permute(*[order.index(d) for d in range(5)])
    return [five[layer] for layer in range(shape.layers)]


def large_offsets_check(
    name: str, shape: Shape, device: str, seed: int = 0, caches: list[torch.Tensor] | None = None
) -> dict:
    """Moves (direct and staged) and scores on the four highest blocks, every kv head, of every layer of an
    uninitialised ``shape`` cache (``empty_kv_caches``), against the int64 torch reference; block 0 too, so
    a plan spans the whole view. Sized so that ``head * head_stride`` and the layer offsets pass 2^31
    elements, it fails where a kernel computes an offset in 32 bits. Writes only the blocks it uses (of
    ``caches`` when given: ``empty_kv_caches(name, shape, device)``'s, so the caller can inspect them)."""
    caches = empty_kv_caches(name, shape, device) if caches is None else caches
    layout = layout_for(name, caches[0]).to(device)
    bs, top = shape.block_size, shape.blocks - 1
    used = torch.tensor([top, top - 1, top - 2, top - 3, 0], device=device)
    slots = (used[:, None] * bs + torch.arange(bs, device=device)).reshape(-1)
    gen = torch.Generator().manual_seed(seed)
    for kv in caches:  # random values in the used blocks only
        scatter(
            kv,
            layout,
            slots,
            torch.randn(slots.numel(), shape.kv_heads, layout.width, generator=gen).to(shape.dtype).to(device),
        )
    from vtoken.kernels.triton.moves import TritonSlotMover

    last_layer = (caches[-1].data_ptr() - caches[0].data_ptr()) // caches[0].element_size()
    report = {
        "layout": name,
        "blocks": shape.blocks,
        "layers": shape.layers,
        "dtype": str(shape.dtype),
        "layer_view_elements": shape.blocks * shape.kv_heads * bs * layout.width,
        "max_element_offset": last_layer + int(element_offsets(layout, slots).max()),
    }
    # top → top-2 (direct: a host plan, disjoint), then top-1 → 0 staged (the plan on the device)
    for key, src_block, dst_block, where in (
        ("moves_exact", top, top - 2, "cpu"),
        ("staged_moves_exact", top - 1, 0, device),
    ):
        src = torch.arange(bs, device=device) + src_block * bs
        dst = torch.arange(bs, device=device).flip(0) + dst_block * bs
        others = slots[~torch.isin(slots, dst)]
        want = [gather(kv, layout, src) for kv in caches]
        keep = [gather(kv, layout, others) for kv in caches]
        TritonSlotMover(layout, capacity=bs).move(caches, src.to(where), dst.to(where))
        report[key] = all(torch.equal(gather(kv, layout, dst), w) for kv, w in zip(caches, want)) and all(
            torch.equal(gather(kv, layout, others), k) for kv, k in zip(caches, keep)
        )
    # two requests over the highest blocks (rows [top, top-3] and [top-1, 0, top-2]), decode + chunk
    from vtoken.kernels.triton.scores import TritonScoreAccumulator

    rows = [torch.tensor([top, top - 3]), torch.tensor([top - 1, 0, top - 2])]
    specs = [(0, 1, 2 * bs - 3, rows[0]), (1, 4, 3 * bs - 5, rows[1])]
    query = torch.randn(4, shape.q_heads, shape.head_dim, generator=gen).to(shape.dtype).to(device)
    scale = shape.head_dim**-0.5
    got = run_scores(TritonScoreAccumulator(layout), caches, specs, query, scale)
    ref_acc = PagedScoreAccumulator(layout)
    report.update(compare_scores(got, run_scores(ref_acc, caches, specs, query, scale), ref_acc))
    return report


def timed(fn: Callable[[], object], device: str, repeats: int = 10, warmup: int = 2) -> float:
    """Median milliseconds of ``fn()`` (CUDA events on a GPU, ``perf_counter`` on the CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def token_bytes(shape: Shape) -> int:
    """Bytes of one token in one layer: every kv head, K and V."""
    return shape.kv_heads * 2 * shape.head_dim * torch.empty(0, dtype=shape.dtype).element_size()
