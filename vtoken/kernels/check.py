"""Kernel correctness checks shared by ``vtoken bench kernels`` and ``scripts/gpu_check.py``.

Torch, numpy and ``vtoken.kernels`` only (no vLLM, typer, rich): the GPU check runs it on a machine that has
nothing else. Everything is seeded; nothing here touches a tensor it did not allocate.

* ``scheduler_plan``: a multi-request repack plan built like ``TokenTable.plan`` builds one per request
  (holes below ``live`` ascending ← live tail tokens at slots ≥ ``live`` descending), through block rows
  drawn from one shuffled pool, so the requests' physical source and destination ranges interleave.
* ``check_moves`` / ``check_scores``: a backend (``torch`` or ``triton``) against the layout-generic torch
  reference (``PagedTorchMover``, ``PagedScoreAccumulator``): every K and V element, and the statistics.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vtoken.kernels.gpu_layout import (
    PagedLayout,
    PagedScoreAccumulator,
    PagedTorchMover,
    allocate_kv_caches,
    layout_for,
)
from vtoken.kernels.layout import TokenLayout
from vtoken.kernels.moves import TorchSlotMover
from vtoken.kernels.scores import RequestScores, ScoreAccumulator

BACKENDS = ("torch", "triton")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    """Random values in every layer view (mutates them; drawn on the CPU so every device agrees)."""
    gen = torch.Generator().manual_seed(seed)
    for kv in caches:
        kv.copy_(torch.randn(kv.shape, generator=gen).to(kv.dtype))


def copy_caches(name: str, caches: list[torch.Tensor], shape: Shape) -> list[torch.Tensor]:
    """A second set of layer views in the same layout holding the same values (``clone`` would not keep
    the layout's strides)."""
    out = allocate_kv_caches(name, shape.layers, shape.blocks, shape.block_size, shape.kv_heads,
                             shape.head_dim, shape.dtype, caches[0].device)
    for a, b in zip(out, caches):
        a.copy_(b)
    return out


def make_mover(backend: str, name: str, layout: PagedLayout, capacity: int = 512):
    """``triton``: ``TritonSlotMover``; ``torch``: the production CPU mover on ``cpu``, else the paged one."""
    if backend == "triton":
        from vtoken.kernels.triton_moves import TritonSlotMover

        return TritonSlotMover(layout, capacity=capacity)
    if name == "cpu":
        return TorchSlotMover(TokenLayout(layout.block_size, layout.head_dim, layout.index))
    return PagedTorchMover(layout)


def make_accumulator(backend: str, name: str, layout: PagedLayout) -> ScoreAccumulator:
    if backend == "triton":
        from vtoken.kernels.triton_scores import TritonScoreAccumulator

        return TritonScoreAccumulator(layout)
    if name == "cpu":
        return ScoreAccumulator(TokenLayout(layout.block_size, layout.head_dim, layout.index))
    return PagedScoreAccumulator(layout)


def setup(name: str, shape: Shape, device: str, seed: int) -> tuple[list[torch.Tensor], PagedLayout]:
    caches = allocate_kv_caches(name, shape.layers, shape.blocks, shape.block_size, shape.kv_heads,
                                shape.head_dim, shape.dtype, device)
    fill_random(caches, seed)
    return caches, layout_for(name, caches[0])


def check_moves(backend: str, name: str, shape: Shape, device: str, plan: Plan, seed: int,
                capacity: int = 512, plan_on_device: bool = False) -> dict:
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


def check_scores(backend: str, name: str, shape: Shape, device: str, plan: Plan, seed: int) -> dict:
    """Statistics of the backend vs the reference on one random step: max |Δ| over ``accumulated`` and
    ``last``, and whether the unimportance bits agree."""
    caches, layout = setup(name, shape, device, seed)
    rng = np.random.default_rng(seed)
    specs = score_specs(plan, rng)
    gen = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(specs[-1][1], shape.q_heads, shape.head_dim, generator=gen).to(shape.dtype).to(device)
    scale = shape.head_dim**-0.5
    got = run_scores(make_accumulator(backend, name, layout), caches, specs, query, scale)
    ref = run_scores(PagedScoreAccumulator(layout), caches, specs, query, scale)
    err = max(float(np.max(np.abs(getattr(got[k], f) - getattr(ref[k], f)))) for k in ref
              for f in ("accumulated", "last"))
    bits = all(np.array_equal(got[k].unimportant, ref[k].unimportant) for k in ref)
    return {"score_queries": int(query.shape[0]), "scores_max_abs_err": err, "scores_bits_equal": bits}


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
