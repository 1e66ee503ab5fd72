"""GPU checks (run on a CUDA machine: ``pytest tests/gpu``; ``make test`` runs the CPU suites only).

The reference mover is layout-generic torch, so it must give the same slot-by-slot result on CUDA
tensors as on CPU. The Triton mover of the GPU issue will be checked against it here.
"""

import pytest
import torch

from vtoken.kernels.layout import TokenLayout
from vtoken.kernels.moves import TorchSlotMover, read_kv

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.fail("tests/gpu needs a CUDA device (run them on the GPU machine; make test runs the CPU suites)")
    return torch.device("cuda")


@pytest.mark.parametrize("bs", [16, 32])
def test_torch_mover_on_cuda_matches_cpu(cuda, bs):
    hd, nkv, nb = 64, 4, 8
    layout = TokenLayout.cpu_vec(bs, hd)
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(nb, nkv, bs, 2 * hd, generator=gen) for _ in range(3)]
    src = torch.tensor([7 * bs - 1, 5 * bs + 3, 6 * bs])
    dst = torch.tensor([1, bs + 2, 3])
    before = [read_kv(c, layout, src) for c in caches]
    on_gpu = [c.to(cuda) for c in caches]
    TorchSlotMover(layout.to(cuda)).move(on_gpu, src.to(cuda), dst.to(cuda))
    TorchSlotMover(layout).move(caches, src, dst)
    for cpu_c, gpu_c, (k0, v0) in zip(caches, on_gpu, before):
        assert torch.equal(cpu_c, gpu_c.cpu())
        k1, v1 = read_kv(cpu_c, layout, dst)
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
