"""Warm-up of vToken's Triton kernels and the fixed set of compiled variants (issue 24, defect 3).

``triton.jit`` compiles one variant per combination of the integer arguments' "== 1" and "divisible by 16"
(and turns a 1 into a constant). Arguments that change from step to step would compile new variants while
requests run (seconds of stall; an error under vLLM's ``--jit-monitor-mode=error``). The specialisation key
is computed here exactly as ``triton.jit`` computes it at launch (its own binder, for the sm_90 backend, no
GPU needed) from the arguments the accumulator and the mover really pass (launches recorded, not run).
The warm-ups run in Triton's interpreter to show they leave the caches bit-identical.
"""

from __future__ import annotations

import pytest
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import create_function_from_signature

from vtoken.kernels.backend_check import Shape, copy_caches, fill_random
from vtoken.kernels.gpu_layout import PagedTorchMover, allocate_kv_caches, layout_for
from vtoken.kernels.scores import RequestScores
from vtoken.kernels.triton.moves import _COPY, TritonSlotMover
from vtoken.kernels.triton.scores import _PROBS, TritonScoreAccumulator
from vtoken.kernels.triton.softmax import _MERGE, _STATS

BS, HKV, HQ, HD = 16, 2, 4, 64


def _caches(name="flash_attn", blocks=8, dtype=torch.bfloat16):
    views = allocate_kv_caches(name, 2, blocks, BS, HKV, HD, dtype)
    fill_random(views, 0)
    return views, layout_for(name, views[0])


@pytest.fixture
def recorded(monkeypatch):
    """Launches of the four kernels recorded as (kernel, args, kwargs) instead of run."""
    calls = []
    for kernel in (_COPY, _STATS, _MERGE, _PROBS):
        monkeypatch.setattr(kernel, "launch", lambda device, grid, *a, _k=kernel, **kw: calls.append((_k, a, kw)))
    return calls


def keys(calls, kernel) -> set[str]:
    """The compiled-variant keys ``triton.jit`` would compute for ``kernel``'s recorded launches."""
    fn = kernel.compiled()
    binder = create_function_from_signature(fn.signature, fn.params, make_backend(GPUTarget("cuda", 90, 32)))
    return {repr(binder(*a, **kw)[1:]) for k, a, kw in calls if k is kernel}


def _step(views, layout, specs, query, split_keys=2048):
    acc = TritonScoreAccumulator(layout, split_keys=split_keys)
    for i, (q0, q1, n, row) in enumerate(specs):
        acc.requests[f"r{i}"] = RequestScores(q0, q1, n, torch.tensor(row), want_attention=True, want_key_norm=False)
    for kv in views:
        acc.add_layer(query, None, kv, HD**-0.5)


def _steps(views, layout):
    """A one-token decode (kmax 1, a one-column block table, a contiguous query, one split), then a decode
    and a 3-query chunk (kmax 48, three columns, the query a view of a fused qkv buffer, 2 splits: merged)."""
    gen = torch.Generator().manual_seed(1)
    _step(views, layout, [(0, 1, 1, [5])], torch.randn(1, HQ, HD, generator=gen).to(views[0].dtype))
    qkv = torch.randn(4, (HQ + 2 * HKV) * HD, generator=gen).to(views[0].dtype)
    _step(views, layout, [(0, 1, 48, [1, 2, 3]), (1, 4, 33, [4, 6, 0])], qkv[:, : HQ * HD].view(4, HQ, HD), 32)


def test_steps_with_different_query_counts_and_rows_share_one_variant(recorded):
    """Before ``do_not_specialize`` (kmax, bt_stride, q_st; chunk, splits) the two steps mapped to different
    variants."""
    views, layout = _caches()
    _steps(views, layout)
    assert len([c for c in recorded if c[0] is _PROBS]) == 4  # 2 steps × 2 layers
    assert len([c for c in recorded if c[0] is _MERGE]) == 2  # the split step's 2 layers
    assert all(len(keys(recorded, k)) == 1 for k in (_STATS, _MERGE, _PROBS))
    for kernel, names in (
        (_STATS, {"q_st", "bt_stride", "chunk"}),
        (_MERGE, {"splits"}),
        (_PROBS, {"q_st", "bt_stride", "kmax"}),
    ):
        assert {p.name for p in kernel.compiled().params if p.do_not_specialize} == names


def test_score_warmup_launches_the_variant_the_steps_use(recorded):
    views, layout = _caches()
    TritonScoreAccumulator.warmup(layout, views[1], HQ, HD, views[0].dtype, HD**-0.5)
    warm = {k: keys(recorded, k) for k in (_STATS, _MERGE, _PROBS)}
    assert all(len(v) == 1 for v in warm.values())
    _steps(views, layout)
    assert all(keys(recorded, k) == warm[k] for k in (_STATS, _MERGE, _PROBS))


def test_mover_warmup_launches_the_three_variants_moves_use(recorded):
    views, layout = _caches()
    mover = TritonSlotMover(layout, capacity=8)
    mover.warmup(views)
    warm = keys(recorded, _COPY)
    assert len(warm) == 3 and mover._stage is None  # DIRECT, GATHER, SCATTER; no staging buffer kept
    mover.move(views, torch.tensor([40, 41]), torch.tensor([3, 4]))  # host plan, disjoint: direct
    mover.move(views, torch.tensor([9, 2, 5]), torch.tensor([2, 5, 9]))  # a cycle: staged
    assert keys(recorded, _COPY) == warm


@pytest.mark.parametrize("name", ["flash_attn", "LHBNC", "cpu"])
def test_warmups_leave_every_cache_byte_unchanged(name):
    """Interpreted: the mover's three launches over an all-padding plan and the score kernels over a
    query that sees no key change nothing; a move after the warm-up is still exact."""
    views, layout = _caches(name, dtype=torch.float32)
    before = copy_caches(name, views, Shape(2, HKV, HQ, HD, BS, 8, torch.float32))
    mover = TritonSlotMover(layout, capacity=8)
    mover.warmup(views)
    TritonScoreAccumulator.warmup(layout, views[0], HQ, HD, torch.float32, HD**-0.5)
    assert all(torch.equal(a, b) for a, b in zip(views, before))
    src, dst = torch.tensor([40, 17]), torch.tensor([3, 100])
    mover.move(views, src, dst)
    PagedTorchMover(layout).move(before, src, dst)
    assert all(torch.equal(a, b) for a, b in zip(views, before))


def test_score_warmup_refuses_heads_that_do_not_fit():
    views, layout = _caches()
    with pytest.raises(ValueError, match="3 query heads of 64"):
        TritonScoreAccumulator.warmup(layout, views[0], 3, HD, torch.bfloat16, 1.0)


def test_what_the_warmups_launch_compiles_for_sm90(recorded):
    """Each variant the warm-ups launch, bound by ``triton.jit``'s own binder from the real arguments and
    compiled the way its ``_do_compile`` does (``ASTSource`` of the bound signature, constexprs and
    attributes), for sm_90 without a GPU; UPCAST off as on CUDA. Before the constexpr annotations were
    kept (``kernels.triton.runtime._with_globals``) the binder failed: every constexpr was a runtime argument."""
    import triton
    from triton.compiler import ASTSource

    views, layout = _caches()
    TritonSlotMover(layout, capacity=8).warmup(views)
    TritonScoreAccumulator.warmup(layout, views[0], HQ, HD, torch.bfloat16, HD**-0.5)
    backend = make_backend(GPUTarget("cuda", 90, 32))
    assert len(recorded) == 6  # 3 mover variants, the 3 score kernels
    for kernel, args, kwargs in recorded:
        fn = kernel.compiled()
        kwargs = {**kwargs, "UPCAST": False} if "UPCAST" in kwargs else kwargs
        bound, spec, options = create_function_from_signature(fn.signature, fn.params, backend)(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
        compiled = triton.compile(
            ASTSource(fn, signature, constexprs, attrs), target=backend.target, options=options.__dict__
        )
        assert compiled.asm["ptx"], kernel.fn.__name__
