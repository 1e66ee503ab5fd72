"""The Triton movers and score kernels at element offsets beyond 2^31, run on the CPU (issue 24).

vLLM's LHBNC layout puts the kv heads outside the blocks, so ``head * head_stride`` of one layer's view
passes 2^31 elements on an H200-sized cache although the stride itself does not (Triton then passes it as
int32, and an int32 product wraps). Triton's interpreter computes in numpy with the same integer widths as
the compiled kernel, so the same overflow happens here; the cache is allocated uninitialised
(``empty_kv_caches``): 10.7 GB of address space, of which only the used blocks' pages get memory.

What this proves: with 2 layers of 655,360 blocks (8 kv heads, head_dim 16, fp16: 2.7e9 elements per
layer view, the last layer's last head at offset 5.4e9) the direct and staged moves, the scores and the
key norms (``TritonKeyNorms``) on the highest heads and blocks equal the int64 torch reference. Before the
int64 fix this process died of a segmentation fault (the wrapped offset pointed outside the allocation), so
the check runs in a subprocess: a crash fails this test, not the session. ``test_every_stride_product_is_64_bit``
(test_triton_compile.py) checks the compiled sm_90 IR for the same property.
"""

from __future__ import annotations

import json
import subprocess
import sys

from support.paths import ROOT

# resident_mb: the cache buffer's pages in memory, by mincore(2) -- the buffer alone, not the process's
# peak RSS, which also counts the interpreter, numpy and thread arenas (2 GB on one CI host, 0.3 GB here).
CODE = """
import ctypes, json, mmap, resource, torch
from vtoken.kernels.backend_check import Shape, empty_kv_caches, large_offsets_check
shape = Shape(2, 8, 8, 16, 16, 655360, torch.float16)
caches = empty_kv_caches("LHBNC", shape, "cpu")
row = large_offsets_check("LHBNC", shape, "cpu", caches=caches)
from vtoken.kernels.gpu_layout import key_offsets, layout_for, read_k
from vtoken.kernels.triton.knorm import TritonKeyNorms
lay, top = layout_for("LHBNC", caches[0]), shape.blocks - 1
slots = torch.cat([torch.arange(16) + b * 16 for b in (top, top - 1, top - 2, top - 3, 0)])
got = TritonKeyNorms(lay).sum(caches, slots)
offs = key_offsets(lay, slots)
want = sum(read_k(kv, lay, slots, offs).float().norm(dim=-1).mean(dim=-1) for kv in caches)
row["knorm_max_abs_err"] = float((got - want).abs().max())
row["knorm_min"] = float(want.min())
storage = caches[0].untyped_storage()
start = storage.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
pages = (storage.data_ptr() + storage.nbytes() - start + mmap.PAGESIZE - 1) // mmap.PAGESIZE
vec = (ctypes.c_ubyte * pages)()
libc = ctypes.CDLL(None, use_errno=True)
assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * mmap.PAGESIZE), vec) == 0, ctypes.get_errno()
row["cache_mb"] = storage.nbytes() / 2**20
row["resident_mb"] = sum(b & 1 for b in vec) * mmap.PAGESIZE / 2**20
row["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(row))
"""


def test_moves_and_scores_beyond_2_31_elements_in_the_interpreter():
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    row = json.loads(proc.stdout.splitlines()[-1])
    assert row["layer_view_elements"] > 2**31 and row["max_element_offset"] > 2**32, row
    assert row["moves_exact"] and row["staged_moves_exact"], row
    assert row["scores_max_abs_err"] <= 1e-4 and row["scores_bits_ok"], row
    assert row["knorm_max_abs_err"] <= 1e-4 and row["knorm_min"] > 0, row  # TritonKeyNorms, all layers at once
    # only the used blocks were touched: 2 layers x 8 heads x 2 block runs, even as 2 MB huge pages 64 MB
    assert row["cache_mb"] > 10_000 and row["resident_mb"] < 256, row
