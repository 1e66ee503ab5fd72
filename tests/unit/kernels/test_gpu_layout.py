"""The CUDA KV layouts of vLLM 0.32 (vtoken/kernels/gpu_layout.py), checked on the CPU against vLLM itself.

Views are built the way vLLM builds them (its own ``create_kv_cache_views`` is the reference for shapes,
strides and layer offsets); tokens are written and read back through the backends' own K/V split
(``kv_cache.transpose(1, 2).split(head_size, -1)``, what ``reshape_and_cache_flash`` writes into), never
through the offsets under test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vtoken.kernels.backend_check import Shape, fill_random, scheduler_plan
from vtoken.kernels.gpu_layout import (
    BACKEND_LAYOUTS,
    KV_CACHE_LAYOUTS,
    PagedScoreAccumulator,
    PagedTorchMover,
    allocate_kv_caches,
    backend_kv_views,
    check_view,
    layout_for,
    read_kv,
)
from vtoken.kernels.layout import TokenLayout
from vtoken.kernels.moves import TorchSlotMover
from vtoken.kernels.moves import read_kv as cpu_read_kv
from vtoken.kernels.scores import RequestScores, ScoreAccumulator

L, NB, BS, H = 3, 6, 16, 2


@pytest.mark.parametrize("name", sorted(KV_CACHE_LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_views_are_the_ones_vllm_creates(name, dtype):
    """Shape, element strides and each layer's byte offset equal vLLM's ``create_kv_cache_views`` with the
    strides ``get_kv_cache_config_from_groups`` gives a one-group model (block stride = all layers' pages
    when the layout is block-outermost)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    hd = 40
    layout = KVCacheLayout[name]
    assert layout.stride_order == KV_CACHE_LAYOUTS[name]
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=hd, dtype=dtype)
    block = spec.page_size_bytes * L if layout.is_block_outermost else None
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, NB, L, layout, fixed_strides=(None, block, None, None, None)
    )
    raw = torch.zeros(L * NB * spec.page_size_bytes, dtype=torch.int8)
    theirs = create_kv_cache_views(
        raw,
        spec,
        NB,
        layout,
        KVCacheTensor(raw.numel(), [f"l{i}" for i in range(L)], layer_stride, block_stride),
    )
    ours = allocate_kv_caches(name, L, NB, BS, H, hd, dtype)
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
        assert a.data_ptr() - ours[0].data_ptr() == b.data_ptr() - theirs[0].data_ptr()


def test_backends_resolve_to_the_documented_layouts():
    """FlashAttention and Triton declare no layout, so vLLM's default preference (LBNHC first) wins;
    FlashInfer declares (LBHNC, BLHNC) only on SM100 (its module needs the flashinfer package: source)."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

    assert FlashAttentionBackend.supported_kv_cache_layouts() is None
    assert TritonAttentionBackend.supported_kv_cache_layouts() is None
    first = get_supported_kv_cache_layouts([FlashAttentionBackend, TritonAttentionBackend])[0]
    assert first.name == BACKEND_LAYOUTS["flash_attn"] == BACKEND_LAYOUTS["triton_attn"] == "LBNHC"


def test_flashinfer_layout_choice_in_vllm_source():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("vllm")
    text = (Path(spec.origin).parent / "v1/attention/backends/flashinfer.py").read_text()
    method = text[text.index("def supported_kv_cache_layouts") :][:600]
    assert "capability.major == 10" in method and "(KVCacheLayout.LBHNC, KVCacheLayout.BLHNC)" in method
    assert "return super().supported_kv_cache_layouts()" in method and BACKEND_LAYOUTS["flashinfer"] == "LBNHC"


def _write_tokens(views, hd, slots, seed):
    """K and V written per layer through the backend's split (block, offset) views; returns them."""
    gen = torch.Generator().manual_seed(seed)
    written = []
    for view in views:
        k = torch.randn(len(slots), H, hd, generator=gen).to(view.dtype)
        v = torch.randn(len(slots), H, hd, generator=gen).to(view.dtype)
        kc, vc = backend_kv_views(view, hd)
        kc[slots // BS, slots % BS] = k
        vc[slots // BS, slots % BS] = v
        written.append((k, v))
    return written


def _read_backend(view, hd, slots):
    kc, vc = backend_kv_views(view, hd)
    return kc[slots // BS, slots % BS], vc[slots // BS, slots % BS]


@pytest.mark.parametrize("name", [*BACKEND_LAYOUTS, *KV_CACHE_LAYOUTS])
@pytest.mark.parametrize("dtype,hd", [(torch.float32, 64), (torch.bfloat16, 80)])
def test_backend_written_tokens_move_slot_by_slot(name, dtype, hd):
    """Tokens written by the backend's own split are found by the layout's offsets; after a scheduler-style
    plan moved by the torch mover, every destination holds its source's K and V (read through the backend's
    split), every other slot is unchanged, in every layer."""
    views = allocate_kv_caches(name, L, NB, BS, H, hd, dtype)
    layout = layout_for(name, views[0])
    slots = torch.arange(NB * BS)
    written = _write_tokens(views, hd, slots, seed=1)
    for view, (k, v) in zip(views, written):
        rk, rv = read_kv(view, layout, slots)
        assert torch.equal(rk, k) and torch.equal(rv, v)
    plan = scheduler_plan(np.random.default_rng(2), 3, NB, BS)
    assert plan.src.numel() > 0
    PagedTorchMover(layout).move(views, plan.src, plan.dst)
    origin = slots.clone()
    origin[plan.dst] = plan.src  # where each slot's content came from
    for view, (k, v) in zip(views, written):
        rk, rv = _read_backend(view, hd, slots)
        assert torch.equal(rk, k[origin]) and torch.equal(rv, v[origin]), name


def test_cpu_paged_layout_is_the_token_layout():
    """On the CPU layout the paged torch mover and reader give what the production ones give."""
    hd = 32
    views = allocate_kv_caches("cpu", 2, NB, BS, H, hd, torch.float32)
    fill_random(views, 3)
    other = [v.clone() for v in views]
    layout = layout_for("cpu", views[0])
    token_layout = TokenLayout.cpu_vec(BS, hd)
    assert torch.equal(
        read_kv(views[0], layout, torch.arange(40))[0], cpu_read_kv(views[0], token_layout, torch.arange(40))[0]
    )
    plan = scheduler_plan(np.random.default_rng(4), 3, NB, BS)
    PagedTorchMover(layout).move(views, plan.src, plan.dst)
    TorchSlotMover(token_layout).move(other, plan.src, plan.dst)
    assert all(torch.equal(a, b) for a, b in zip(views, other))


def test_paged_score_reference_equals_the_production_one_on_cpu():
    hd = 32
    views = allocate_kv_caches("cpu", 2, NB, BS, H, hd, torch.float32)
    fill_random(views, 5)
    q = torch.randn(3, 4, hd, generator=torch.Generator().manual_seed(6))
    outs = []
    for acc in (ScoreAccumulator(TokenLayout.cpu_vec(BS, hd)), PagedScoreAccumulator(layout_for("cpu", views[0]))):
        acc.requests["a"] = RequestScores(0, 2, 40, torch.tensor([4, 1, 3]), want_attention=True, want_key_norm=False)
        acc.requests["b"] = RequestScores(2, 3, 9, torch.tensor([0]), want_attention=True, want_key_norm=False)
        for view in views:
            acc.add_layer(q, None, view, 0.2)
        outs.append(acc.finish())
    for rid in "ab":
        assert np.allclose(outs[0][rid].accumulated, outs[1][rid].accumulated, atol=1e-7)


def test_a_clone_is_another_layout():
    views = allocate_kv_caches("BLHNC", L, NB, BS, H, 16, torch.float32)
    layout = layout_for("BLHNC", views[0])
    check_view(views[1], layout)
    with pytest.raises(ValueError, match="BLHNC"):
        check_view(views[1].clone(), layout)
    with pytest.raises(ValueError, match="unknown KV layout 'NHDX'"):
        allocate_kv_caches("NHDX", 1, 1, BS, H, 16, torch.float32)


def test_scheduler_plan_is_the_token_table_plan():
    """``scheduler_plan``'s per-request moves are exactly ``TokenTable.plan``'s for the same victims."""
    from vtoken.core.token_table import TokenTable

    plan = scheduler_plan(np.random.default_rng(7), 5, 40, BS)
    start = 0
    for row, seen, victims, live in zip(plan.rows, plan.seen, plan.victims, plan.live):
        table = TokenTable(block_size=BS)
        table.place(seen)
        table.evict(victims)
        moves = table.plan().moves
        assert table.live == live
        n = moves.shape[0]
        phys = row[moves // BS] * BS + moves % BS
        assert np.array_equal(plan.src[start : start + n].numpy(), phys[:, 0])
        assert np.array_equal(plan.dst[start : start + n].numpy(), phys[:, 1])
        start += n
    assert start == plan.src.numel() and plan.ranges_overlap
    assert Shape(1, 1, 1, 1, 1, 1).dtype == torch.float32
