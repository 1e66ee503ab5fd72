"""The Triton kernels compile for the H200 (sm_90) here, without a GPU: Triton's own front end and the
``ptxas`` shipped in the triton wheel, ``triton.compile(ASTSource, GPUTarget("cuda", 90, 32))``.

The interpreter tests (test_triton_kernels.py) check what the kernels compute; these check that the compiled
variant (the one a GPU runs, with the same helper functions) is valid Triton for CUDA: constexpr branches,
nested helpers, ``tl.dot`` shapes and dtypes, and that the strided move and key loads are 16-byte vectors.
Argument types follow what ``triton.jit`` specialises at run time (pointers and strides divisible by 16,
except the arguments a kernel marks ``do_not_specialize``).
"""

from __future__ import annotations

import re

import pytest
from support.sm90 import compile_sm90, stride_products  # imports triton: a broken one fails, never skips

from vtoken.kernels.triton.attention import _DECODE
from vtoken.kernels.triton.moves import _COPY, DIRECT, GATHER, SCATTER
from vtoken.kernels.triton.scores import _PROBS
from vtoken.kernels.triton.softmax import _MERGE, _STATS

LLAMA = dict(
    GROUP=4,
    G_P2=16,
    D=128,
    D_P2=128,
    WIDTH=256,
    BLOCK_SIZE=16,
    BLOCK_N=32,
    STRIDED=True,
    UPCAST=False,
    ALIGN=16,
    Q_ALIGN=16,
)


MOVE_TYPES = {
    "cache_ptr": "*bf16",
    "layer_off_ptr": "*i64",
    "src_ptr": "*i64",
    "dst_ptr": "*i64",
    "stage_ptr": "*bf16",
    "index_ptr": "*i32",
    "block_stride": "i64",
    "head_stride": "i32",
    "token_stride": "i32",
}
MOVE_CONSTEXPRS = dict(CAP=512, BLOCK_SIZE=16, HEADS=8, HEAD_TILE=8, WIDTH=256, WIDTH_P2=256, ALIGN=16)


@pytest.mark.parametrize("mode", [GATHER, SCATTER, DIRECT])
@pytest.mark.parametrize("strided", [True, False])
def test_move_kernel_compiles_and_vectorises(mode, strided):
    ptx = compile_sm90(_COPY, MOVE_TYPES, {**MOVE_CONSTEXPRS, "STRIDED": strided, "MODE": mode})
    if strided:  # the CUDA layouts: whole 16-byte vectors in and out
        assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx


SCORE_TYPES = {
    "q_st": "i32",
    "q_sh": "i32",
    "bt_ptr": "*i32",
    "bt_stride": "i32",
    "index_ptr": "*i32",
    "q_tok": "*i32",
    "q_req": "*i32",
    "q_vis": "*i32",
    "m_ptr": "*fp32",
    "l_ptr": "*fp32",
    "block_stride": "i64",
    "head_stride": "i32",
    "token_stride": "i32",
    "scale": "fp32",
}


@pytest.mark.parametrize("dtype,precision", [("bf16", "tf32"), ("fp16", "tf32"), ("fp32", "ieee")])
def test_score_kernels_compile(dtype, precision):
    types = {**SCORE_TYPES, "q_ptr": f"*{dtype}", "cache_ptr": f"*{dtype}"}
    common = {**LLAMA, "HQ": 32, "PRECISION": precision}
    ptx = compile_sm90(_STATS, {**types, "chunk": "i32"}, common)
    assert re.search(r"ld\.global(\.\w+)*\.v4", ptx)  # the query tile: 16-byte vectors (Q_ALIGN)
    assert re.search(r"cp\.async\.cg\.shared\.global .*, 0x10", ptx)  # keys: 16-byte async copies
    ptx = compile_sm90(
        _PROBS,
        {**types, "q_row": "*i32", "q_first": "*i32", "sums_ptr": "*fp32", "rows_ptr": "*fp32", "kmax": "i32"},
        {**common, "HKV": 8},
    )
    assert re.search(r"cp\.async\.cg\.shared\.global .*, 0x10", ptx)
    assert not re.search(r"ld\.global(\.\w+)*\.b16", ptx)  # triton 3.6 loaded keys by the element before


def test_score_kernels_compile_for_odd_head_dims_and_mqa():
    types = {**SCORE_TYPES, "q_ptr": "*bf16", "cache_ptr": "*bf16"}
    compile_sm90(
        _STATS,
        {**types, "chunk": "i32"},
        {**LLAMA, "HQ": 8, "GROUP": 8, "D": 80, "D_P2": 128, "WIDTH": 160, "PRECISION": "tf32", "ALIGN": 16},
    )


@pytest.mark.parametrize("hq", [32, 8, 28])
def test_softmax_merge_compiles(hq):
    """The merge of the split statistics (one variant per model: HQ fixed, ``splits`` not specialised)."""
    types = {"mp_ptr": "*fp32", "lp_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "splits": "i32"}
    ttir = compile_sm90(_MERGE, types, {"HQ": hq, "HQ_P2": 1 << (hq - 1).bit_length()}, asm="ttir")
    assert "scf.for" in ttir  # the loops over the splits are runtime loops, not unrolled per split count


DECODE_TYPES = {
    "q_ptr": "*bf16",
    "q_st": "i32",
    "q_sh": "i32",
    "cache_ptr": "*bf16",
    "bt_ptr": "*i32",
    "bt_stride": "i32",
    "index_ptr": "*i64",
    "seq_ptr": "*i32",
    "out_ptr": "*bf16",
    "o_st": "i32",
    "o_sh": "i32",
    "block_stride": "i64",
    "head_stride": "i32",
    "token_stride": "i32",
    "scale": "fp32",
}


def test_paged_decode_compiles():
    ptx = compile_sm90(_DECODE, DECODE_TYPES, {**LLAMA, "PRECISION": "tf32"})
    assert re.search(r"cp\.async\.cg\.shared\.global .*, 0x10", ptx)  # keys and values: 16-byte copies
    assert not re.search(r"ld\.global(\.\w+)*\.b16", ptx)


# ---------------------------------------------------------------- 64-bit element offsets (issue 24)
def _ttir_cases():
    moves = {**MOVE_TYPES, "block_stride": "i32"}
    scores = {**SCORE_TYPES, "q_ptr": "*bf16", "cache_ptr": "*bf16", "block_stride": "i32"}
    probs = {**scores, "q_row": "*i32", "q_first": "*i32", "sums_ptr": "*fp32", "rows_ptr": "*fp32", "kmax": "i32"}
    decode = {**DECODE_TYPES, "index_ptr": "*i32", "block_stride": "i32"}
    for mode in (GATHER, SCATTER, DIRECT):
        for strided in (True, False):
            name = f"move{mode}{'s' if strided else 'i'}"
            yield name, _COPY, moves, {**MOVE_CONSTEXPRS, "STRIDED": strided, "MODE": mode}
    for strided in (True, False):
        common = {**LLAMA, "STRIDED": strided, "PRECISION": "tf32"}
        yield f"stats{strided:d}", _STATS, {**scores, "chunk": "i32"}, {**common, "HQ": 32}
        yield f"probs{strided:d}", _PROBS, probs, {**common, "HQ": 32, "HKV": 8}
        yield f"decode{strided:d}", _DECODE, decode, common


@pytest.mark.parametrize("case", list(_ttir_cases()), ids=lambda c: c[0])
def test_every_stride_product_is_64_bit(case):
    """Each stride argument, passed as i32 (what ``triton.jit`` makes of a stride below 2^31), is multiplied
    in i64 only: on an H200-sized LHBNC cache ``head * head_stride`` exceeds 2^31 although head_stride does
    not, and an i32 product wraps to a negative offset. What this proves: the IR Triton generates for sm_90
    promotes every index before it meets a stride (the heads, blocks, slots, tokens, query rows), for every
    kernel and branch compiled here; not that no other offset (e.g. one without a stride) could overflow."""
    _, kernel, types, constexprs = case
    products = stride_products(compile_sm90(kernel, types, constexprs, asm="ttir"))
    assert "head_stride" in {name for name, _, _ in products}  # the check is not vacuous
    narrow = [line for name, ty, line in products if not re.search(r"(^|x)i64>?$", ty)]
    assert not narrow, narrow
