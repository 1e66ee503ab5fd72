"""The Triton kernels (vtoken/kernels/triton/*.py) against their torch references, on the CPU.

CPU tensors run through Triton's interpreter; ``TRITON_INTERPRET`` is not needed (``kernels.triton.runtime`` wraps
each kernel for the interpreter itself, scoped to the launch), so nothing else in this pytest process changes.
Moves must equal the reference in every K and V element of every layer, scores within 1e-4. Shapes are tiny:
the interpreter runs every program in Python.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from vtoken.kernels.backend_check import Shape, check_moves, copy_caches, fill_random, scheduler_plan
from vtoken.kernels.gpu_layout import (
    KV_CACHE_LAYOUTS,
    PagedScoreAccumulator,
    PagedTorchMover,
    allocate_kv_caches,
    layout_for,
)
from vtoken.kernels.scores import RequestScores
from vtoken.kernels.triton.attention import paged_decode, paged_decode_reference
from vtoken.kernels.triton.moves import TritonSlotMover
from vtoken.kernels.triton.scores import TritonScoreAccumulator

BS = 16


def _caches(name, layers=2, blocks=8, heads=2, hd=64, dtype=torch.float32, seed=0):
    views = allocate_kv_caches(name, layers, blocks, BS, heads, hd, dtype)
    fill_random(views, seed)
    return views, layout_for(name, views[0])


def test_the_process_was_not_switched_to_the_interpreter():
    """These tests prove the scoped interpreter, not a process-wide TRITON_INTERPRET (make test sets none)."""
    import triton

    assert os.environ.get("TRITON_INTERPRET", "0") in ("0", "") or pytest.fail("unset TRITON_INTERPRET")
    assert not triton.knobs.runtime.interpret


@pytest.mark.parametrize(
    "name,dtype,hd",
    [
        ("cpu", torch.float32, 64),
        ("flash_attn", torch.bfloat16, 80),
        *[(n, torch.float32, 64) for n in sorted(KV_CACHE_LAYOUTS)],
    ],
)
def test_moves_equal_the_reference_in_every_element(name, dtype, hd):
    """A scheduler-style multi-request plan (disjoint, so one direct launch), chunked by a small capacity."""
    shape = Shape(2, 2, 4, hd, BS, 8, dtype)
    plan = scheduler_plan(np.random.default_rng(1), 3, shape.blocks, BS)
    assert plan.src.numel() > 4 and plan.ranges_overlap
    row = check_moves("triton", name, shape, "cpu", plan, seed=2, capacity=4)
    assert row["moves_exact"], row


@pytest.mark.parametrize("name", ["cpu", "LBNHC", "BLHNC"])
def test_staged_launches_equal_the_reference(name):
    """The two-launch gather/scatter path on a disjoint plan (padded: fewer moves than capacity)."""
    views, layout = _caches(name, seed=3)
    ref = copy_caches(name, views, Shape(2, 2, 4, 64, BS, 8))
    plan = scheduler_plan(np.random.default_rng(4), 3, 8, BS)
    src, dst = plan.src[:10], plan.dst[:10]
    mover = TritonSlotMover(layout, capacity=12)
    mover.prepare(views, staged=True)
    mover.set_plan(src, dst)
    mover.launch(staged=True)
    PagedTorchMover(layout).move(ref, src, dst)
    assert all(torch.equal(a, b) for a, b in zip(views, ref))


def test_overlapping_plan_is_gathered_before_it_is_scattered():
    """(9→2) (2→5) (5→40) (40→9): every destination gets its source's *old* tokens (a cycle), which a
    pair-by-pair copy would not give; ``move`` sees the overlap and takes the staged path."""
    views, layout = _caches("flash_attn", seed=5)
    ref = copy_caches("flash_attn", views, Shape(2, 2, 4, 64, BS, 8))
    src, dst = torch.tensor([9, 2, 5, 40]), torch.tensor([2, 5, 40, 9])
    TritonSlotMover(layout, capacity=8).move(views, src, dst)
    PagedTorchMover(layout).move(ref, src, dst)
    assert all(torch.equal(a, b) for a, b in zip(views, ref))
    sequential = copy_caches("flash_attn", ref, Shape(2, 2, 4, 64, BS, 8))
    for s, d in zip(src.tolist(), dst.tolist()):
        PagedTorchMover(layout).move(sequential, torch.tensor([s]), torch.tensor([d]))
    assert not torch.equal(sequential[0], views[0])  # the order matters for this plan
    with pytest.raises(ValueError, match="exceed the capacity 2"):
        TritonSlotMover(layout, capacity=2).move(views, src, dst)


def test_padding_and_shared_layer_tensors_touch_nothing_else():
    """Slots outside the plan keep their values in both paths (padded entries are -1 in the source *and*
    destination buffers, never a real slot); a layer tensor listed twice is prepared, so moved, once."""
    for staged in (False, True):
        views, layout = _caches("LBNHC", seed=6)
        before = [v.clone() for v in views]
        mover = TritonSlotMover(layout, capacity=16)
        mover.prepare([views[0], views[1], views[0]], staged=staged)
        assert len(mover._caches) == 2
        mover.set_plan(torch.tensor([33]), torch.tensor([70]))
        mover.launch(staged=staged)
        for v, b in zip(views, before):
            changed = (v != b).flatten(2).any(-1)  # [blocks, heads]: which (block, head) regions changed
            assert changed.nonzero()[:, 0].unique().tolist() == [70 // BS], staged
            assert torch.equal(v[70 // BS, :, 70 % BS], b[33 // BS, :, 33 % BS])


SPECS = [("a", 0, 1, 40, [3, 1, 7]), ("b", 1, 2, 7, [2]), ("c", 2, 5, 33, [0, 4, 5]), ("d", 5, 6, 16, [6])]


def _scores(cls, views, layout, q, specs, windows=None, key_norm=False, **kwargs):
    acc = cls(layout, **kwargs)
    for name, q0, q1, n, row in specs:
        acc.requests[name] = RequestScores(
            q0,
            q1,
            n,
            torch.tensor(row),
            want_attention=True,
            want_key_norm=key_norm,
            window=(windows or {}).get(name, 0),
            want_redundancy=key_norm,
        )  # R-KV's, torch on both paths
    for layer, view in enumerate(views):
        acc.add_layer(
            q * (1 + 0.25 * layer), q[:, : layout.num_kv_heads] if key_norm else None, view, q.shape[-1] ** -0.5
        )
    return acc.finish()


def _assert_same(got, ref, fields=("accumulated", "last")):
    for rid in ref:
        for f in fields:
            assert np.max(np.abs(getattr(got[rid], f) - getattr(ref[rid], f))) <= 1e-4, (rid, f)
        assert np.array_equal(got[rid].unimportant, ref[rid].unimportant), rid
        assert got[rid].n_queries == ref[rid].n_queries and got[rid].seq_len == ref[rid].seq_len


@pytest.mark.parametrize(
    "name,hd,q_heads,kv_heads,dtype",
    [
        ("flash_attn", 64, 4, 2, torch.float32),  # GQA
        ("cpu", 80, 3, 1, torch.float32),  # MQA, head_dim padded to 128 and masked, the probed-CPU index path
        ("BHLNC", 96, 2, 2, torch.float16),  # MHA
        ("LBHNC", 128, 8, 2, torch.bfloat16),
        ("flash_attn", 256, 2, 1, torch.float32),
    ],
)
def test_scores_equal_the_reference(name, hd, q_heads, kv_heads, dtype):
    """Decode and prefill-chunk requests of one step, through their block tables, over every layer."""
    views, layout = _caches(name, heads=kv_heads, hd=hd, dtype=dtype, seed=7)
    q = torch.randn(6, q_heads, hd, generator=torch.Generator().manual_seed(8)).to(dtype)
    ref = _scores(PagedScoreAccumulator, views, layout, q, SPECS, key_norm=True)
    got = _scores(TritonScoreAccumulator, views, layout, q, SPECS, key_norm=True)
    _assert_same(got, ref, ("accumulated", "last", "key_norm", "redundancy"))


def test_long_chunk_keeps_the_last_64_queries_and_the_window():
    """A 70-query chunk: the unimportance bits come from its last 64 queries only, SnapKV's window from
    queries window-32..window-1 (rows outside the last 64)."""
    views, layout = _caches("flash_attn", layers=1, blocks=6, heads=1, hd=16, seed=9)
    q = torch.randn(70, 1, 16, generator=torch.Generator().manual_seed(10))
    specs = [("long", 0, 70, 80, [5, 0, 3, 1, 2])]
    ref = _scores(PagedScoreAccumulator, views, layout, q, specs, windows={"long": 20})
    got = _scores(TritonScoreAccumulator, views, layout, q, specs, windows={"long": 20}, block_n=128)
    _assert_same(got, ref, ("accumulated", "last", "window"))
    assert ref["long"].unimportant.any() and (~ref["long"].unimportant.astype(bool)).any()


@pytest.mark.parametrize("name,dtype,tol", [("flash_attn", torch.float32, 1e-4), ("cpu", torch.bfloat16, 2e-2)])
def test_paged_decode_attention_equals_torch(name, dtype, tol):
    views, layout = _caches(name, hd=80, dtype=dtype, seed=11)
    table = torch.tensor([[3, 1, 7], [0, 2, 0], [4, 5, 6]], dtype=torch.int32)
    lens = torch.tensor([40, 20, 48], dtype=torch.int32)
    q = torch.randn(3, 4, 80, generator=torch.Generator().manual_seed(12)).to(dtype)
    out = torch.zeros(3, 4, 80, dtype=dtype)
    paged_decode(q, views[1], layout, table, lens, 80**-0.5, out)
    ref = paged_decode_reference(q, views[1], layout, table, lens, 80**-0.5)
    assert (out.float() - ref).abs().max() <= tol
