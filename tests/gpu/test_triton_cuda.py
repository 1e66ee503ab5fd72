"""The Triton kernels compiled on a CUDA device vs the torch references (``pytest tests/gpu``; not run by
``make test``). The same checks as tests/cpu/test_triton_kernels.py, at Llama-3-8B-like shapes, plus a CUDA
graph capture of the fixed-shape move launch. ``scripts/gpu_check.py`` is the timed version.
"""

import numpy as np
import pytest
import torch

from vtoken.kernels.check import Shape, check_moves, check_scores, copy_caches, scheduler_plan, setup
from vtoken.kernels.gpu_layout import PagedTorchMover
from vtoken.kernels.triton_moves import TritonSlotMover

pytestmark = pytest.mark.gpu
LLAMA = Shape(4, 8, 32, 128, 16, 256, torch.bfloat16)


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.fail("tests/gpu needs a CUDA device (run them on the GPU machine; make test runs tests/cpu)")
    return "cuda"


@pytest.mark.parametrize("name", ["flash_attn", "LBHNC", "BLHNC", "BHLNC", "cpu"])
def test_moves_and_scores_on_cuda(cuda, name):
    plan = scheduler_plan(np.random.default_rng(0), 16, LLAMA.blocks, LLAMA.block_size)
    row = check_moves("triton", name, LLAMA, cuda, plan, 0, capacity=256)
    assert row["moves_exact"], row
    row = check_scores("triton", name, LLAMA, cuda, plan, 1)
    assert row["scores_max_abs_err"] <= 1e-4 and row["scores_bits_equal"], row


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
