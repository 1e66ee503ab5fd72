"""The Triton kernels compiled on a CUDA device vs the torch references (``pytest tests/gpu``; not run by
``make test``). The same checks as tests/unit/kernels/test_triton_kernels.py, at Llama-3-8B-like shapes, plus a CUDA
graph capture of the fixed-shape move launch, an LHBNC cache whose offsets pass 2^31 and the start-up
warm-ups (no compile after them). ``scripts/gpu_check.py`` is the timed version. Needs only torch, triton,
numpy and pytest (conftest.py puts the repository root on ``sys.path``).
"""

import numpy as np
import pytest
import torch

from vtoken.kernels.backend_check import (
    Shape,
    check_moves,
    check_scores,
    copy_caches,
    large_offsets_check,
    run_scores,
    scheduler_plan,
    score_specs,
    setup,
)
from vtoken.kernels.gpu_layout import PagedTorchMover
from vtoken.kernels.triton.moves import _COPY, TritonSlotMover
from vtoken.kernels.triton.scores import _PROBS, _STATS, TritonScoreAccumulator
from vtoken.kernels.triton.softmax import _MERGE

pytestmark = pytest.mark.gpu
LLAMA = Shape(4, 8, 32, 128, 16, 256, torch.bfloat16)


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.fail("tests/gpu needs a CUDA device (run them on the GPU machine; make test runs the CPU suites)")
    return "cuda"


@pytest.mark.parametrize("name", ["flash_attn", "LBHNC", "LHBNC", "BLHNC", "BHLNC", "cpu"])
def test_moves_and_scores_on_cuda(cuda, name):
    plan = scheduler_plan(np.random.default_rng(0), 16, LLAMA.blocks, LLAMA.block_size)
    row = check_moves("triton", name, LLAMA, cuda, plan, 0, capacity=256)
    assert row["moves_exact"], row
    row = check_scores("triton", name, LLAMA, cuda, plan, 1)
    # the unimportance bits may differ only at near-ties (check.compare_unimportance_bits)
    assert row["scores_max_abs_err"] <= 1e-4 and row["scores_bits_ok"], row


def test_offsets_beyond_2_31_elements_on_cuda(cuda):
    """LHBNC at H200 scale (Llama-3.2-1B heads, 2 layers of 196,608 blocks: 3.2e9 elements per layer view,
    12.9 GB uninitialised): moves and scores on the highest heads and blocks (scripts/gpu_check.py too)."""
    row = large_offsets_check("LHBNC", Shape(2, 8, 32, 64, 16, 196608, torch.bfloat16), cuda)
    torch.cuda.empty_cache()
    assert row["max_element_offset"] > 2**32, row
    assert row["moves_exact"] and row["staged_moves_exact"], row
    assert row["scores_max_abs_err"] <= 1e-4 and row["scores_bits_ok"], row


def test_staged_launch_replays_in_a_cuda_graph(cuda):
    caches, layout = setup("flash_attn", LLAMA, cuda, 2)
    ref = copy_caches("flash_attn", caches, LLAMA)
    src, dst = torch.tensor([9, 2, 5, 40], device=cuda), torch.tensor([2, 5, 40, 9], device=cuda)
    mover = TritonSlotMover(layout, capacity=64)
    mover.prepare(caches, staged=True)
    mover.set_plan(src, dst)
    mover.launch(staged=True)  # compile outside the capture
    PagedTorchMover(layout).move(ref, src, dst)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mover.launch(staged=True)
    graph.replay()
    PagedTorchMover(layout).move(ref, src, dst)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(caches, ref))


def test_warmups_compile_every_variant_the_steps_use(cuda):
    """The runner's start-up warm-ups change no cache byte; later steps (moves direct and staged, score
    steps of other query counts and row lengths) compile nothing new."""
    caches, layout = setup("LBHNC", LLAMA, cuda, 7)
    before = [kv.clone() for kv in caches]
    mover = TritonSlotMover(layout, capacity=128)
    mover.warmup(caches)
    TritonScoreAccumulator.warmup(layout, caches[3], LLAMA.q_heads, LLAMA.head_dim, LLAMA.dtype, 0.1)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(caches, before))
    device = torch.device(cuda)
    kernels = (_COPY, _STATS, _MERGE, _PROBS)
    variants = [k.compiled_variants(device) for k in kernels]
    assert all(variants)
    rng = np.random.default_rng(7)
    plan = scheduler_plan(rng, 16, LLAMA.blocks, LLAMA.block_size)
    src, dst = plan.src[:128], plan.dst[:128]
    mover.move(caches, src, dst)
    mover.move(caches, src.to(cuda), dst.to(cuda))
    for max_queries in (2, 9):
        specs = score_specs(plan, rng, max_queries)
        query = torch.randn(specs[-1][1], LLAMA.q_heads, LLAMA.head_dim, device=cuda).to(LLAMA.dtype)
        run_scores(TritonScoreAccumulator(layout), caches, specs, query, 0.1)
        run_scores(TritonScoreAccumulator(layout, split_keys=64), caches, specs, query, 0.1)  # several splits
    torch.cuda.synchronize()
    assert [k.compiled_variants(device) for k in kernels] == variants
