"""``TritonKeyNorms`` (vtoken/kernels/triton/knorm.py): every layer's key norms in one launch, in Triton's
interpreter against the runner's torch path (per layer ``read_k`` → ``float`` → ``norm`` → ``mean``, summed
over layers), and compiled for sm_90 without a GPU (issue 41, item 4)."""

from __future__ import annotations

import re

import pytest
import torch

from vtoken.kernels.backend_check import fill_random
from vtoken.kernels.gpu_layout import allocate_kv_caches, key_offsets, layout_for, read_k
from vtoken.kernels.triton.knorm import _KNORM, TritonKeyNorms

BS = 16


def _reference(caches, layout, slots):
    """The runner's ``_vt_key_norms`` loop (vtoken/vllm/runner/mixin.py) on the same caches."""
    offsets = key_offsets(layout, slots)
    total = None
    for kv in caches:
        n = read_k(kv, layout, slots, offsets).float().norm(dim=-1).mean(dim=-1)
        total = n if total is None else total + n
    return total


@pytest.mark.parametrize(
    "name,dtype,heads,hd",
    [
        ("flash_attn", torch.float32, 2, 64),
        ("cpu", torch.float32, 3, 80),  # the probed CPU index path, separate layer tensors, odd head count
        ("LHBNC", torch.bfloat16, 2, 128),  # heads outside blocks
        ("BLHNC", torch.float16, 1, 96),  # block-outer: every layer's page of a block interleaved
    ],
)
def test_key_norms_equal_the_torch_path(name, dtype, heads, hd):
    caches = allocate_kv_caches(name, 3, 6, BS, heads, hd, dtype)
    fill_random(caches, 5)
    layout = layout_for(name, caches[0])
    slots = torch.tensor([0, 17, 95, 40, 41, 3, 63, 17])  # any order, repeats allowed
    got = TritonKeyNorms(layout).sum(caches, slots)
    want = _reference(caches, layout, slots)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_layer_tensors_listed_twice_count_once_and_warmup_changes_nothing():
    caches = allocate_kv_caches("flash_attn", 2, 4, BS, 2, 64, torch.float32)
    fill_random(caches, 6)
    before = [kv.clone() for kv in caches]
    norms = TritonKeyNorms(layout_for("flash_attn", caches[0]))
    norms.warmup(caches)
    assert all(torch.equal(a, b) for a, b in zip(caches, before))
    slots = torch.tensor([5, 60])
    torch.testing.assert_close(norms.sum([caches[0], caches[1], caches[0]], slots), norms.sum(caches, slots))
    assert norms.sum(caches, torch.zeros(0, dtype=torch.int64)).numel() == 0


# the key-norm kernel's argument types as triton.jit specialises them (a stride of 2^31 or more: i64) and a
# Llama-3-8B-like LBNHC layout's constexprs (STRIDED per test)
KNORM_TYPES = {
    "cache_ptr": "*bf16",
    "layer_off_ptr": "*i64",
    "slot_ptr": "*i64",
    "out_ptr": "*fp32",
    "index_ptr": "*i32",
    "n_layers": "i32",
    "block_stride": "i64",
    "head_stride": "i32",
    "token_stride": "i32",
}
KNORM_CONSTEXPRS = dict(HEADS=8, H_P2=8, D=128, D_P2=128, WIDTH=256, BLOCK_SIZE=16, ALIGN=16)


def test_key_norm_kernel_compiles_for_sm90():
    """The compiled variant for a Llama-3-8B-like LBNHC layout: key rows loaded as 16-byte vectors."""
    from support.sm90 import compile_sm90

    constexprs = {**KNORM_CONSTEXPRS, "STRIDED": True}
    ptx = compile_sm90(_KNORM, KNORM_TYPES, constexprs)
    assert re.search(r"ld\.global(\.\w+)*\.v4", ptx)
    compile_sm90(_KNORM, KNORM_TYPES, {**constexprs, "STRIDED": False, "HEADS": 3, "H_P2": 4, "D": 80})


def test_key_norm_offsets_are_64_bit():
    """Every stride product in i64 (``test_every_stride_product_is_64_bit``): an LHBNC layer view passes 2^31
    elements on an H200-sized cache."""
    from support.sm90 import compile_sm90, stride_products

    types = {**KNORM_TYPES, "block_stride": "i32"}
    for strided in (True, False):
        constexprs = {**KNORM_CONSTEXPRS, "STRIDED": strided}
        products = stride_products(compile_sm90(_KNORM, types, constexprs, asm="ttir"))
        assert "head_stride" in {name for name, _, _ in products}
        assert not [line for _, ty, line in products if not re.search(r"(^|x)i64>?$", ty)]
