"""``vtoken bench kernels``: a KV-move and score-collection backend against the torch reference.

One random step at the given shapes (``vtoken.kernels.backend_check``): a multi-request repack plan built the way the
scheduler builds it, moved by the backend and by the layout-generic torch reference on equal caches
(``moves_exact``: every K and V element of every layer equal, with the plan handed over on the host and
on the device: the Triton mover's direct and staged paths), then one step of q·K statistics over the
dense rows (``scores_max_abs_err``; the unimportance bits through ``compare_unimportance_bits``:
``bits_mismatched``, of which ``bits_mismatched_near_threshold`` where the reference probability is within
``bits_near_tie_rtol`` of the threshold, and ``scores_bits_ok``: every mismatch is such a near-tie).
``--layout`` takes the CUDA backends' names, every vLLM 0.32 physical order (``LAYOUT_NAMES``: LBHNC,
LBNHC, LHBNC, BLHNC, BLNHC, BHLNC) and ``cpu``. On ``--device cpu`` the Triton backend runs in Triton's
interpreter (correctness only: its timings mean nothing); on ``--device cuda`` the report adds timings: the
move's effective bandwidth (bytes read + written of the moved tokens, every layer) next to a plain torch copy
of the same bytes, and the score kernels' milliseconds per layer. Prints JSON (``report.emit``); writes
nothing else.
"""

from __future__ import annotations

import shlex
import sys

import numpy as np
import torch

from vtoken.kernels.backend_check import (
    BACKENDS,
    DTYPES,
    Shape,
    check_moves,
    check_scores,
    make_accumulator,
    make_mover,
    run_scores,
    scheduler_plan,
    score_specs,
    setup,
    timed,
    token_bytes,
)
from vtoken.kernels.gpu_layout import BACKEND_LAYOUTS, LAYOUT_NAMES

# the top-level keys ``run_kernels`` returns on any device; ``--device cuda`` adds ``timings`` and
# ``report.emit`` adds ``environment``
REPORT_KEYS = frozenset(
    {
        "bench",
        "command",
        "backend",
        "device",
        "layout",
        "kv_cache_layout",
        "dtype",
        "shape",
        "plan",
        "capacity",
        "moves",
        "moves_exact",
        "moves_mismatched_elements",
        "score_queries",
        "scores_max_abs_err",
        "bits_mismatched",
        "bits_mismatched_near_threshold",
        "bits_near_tie_rtol",
        "scores_bits_ok",
    }
)


def problems(
    backend: str, device: str, layout: str, dtype: str, ints: dict[str, int], q_heads: int, kv_heads: int
) -> list[str]:
    """Every bad input, each naming its value (empty: all good). Pure apart from asking torch for CUDA."""
    out = []
    if backend not in BACKENDS:
        out.append(f"--backend {backend!r}: valid backends are {', '.join(BACKENDS)}")
    if device not in ("cpu", "cuda"):
        out.append(f"--device {device!r}: valid devices are cpu, cuda")
    elif device == "cuda" and not torch.cuda.is_available():
        out.append("--device 'cuda': no CUDA device on this machine (use --device cpu: Triton's interpreter)")
    if layout not in LAYOUT_NAMES:
        out.append(f"--layout {layout!r}: valid layouts are {', '.join(LAYOUT_NAMES)}")
    if dtype not in DTYPES:
        out.append(f"--dtype {dtype!r}: valid dtypes are {', '.join(DTYPES)}")
    for flag, value in ints.items():
        if value < 1:
            out.append(f"{flag} {value}: need at least 1")
    if kv_heads >= 1 and q_heads >= 1 and q_heads % kv_heads:
        out.append(f"--q-heads {q_heads}: must be a multiple of --kv-heads {kv_heads}")
    if ints.get("--blocks", 1) < ints.get("--requests", 1):
        out.append(f"--blocks {ints['--blocks']}: need at least one block per request ({ints['--requests']})")
    return out


def run_kernels(backend: str, device: str, layout: str, shape: Shape, requests: int, seed: int, capacity: int) -> dict:
    """The report (see module doc; ``REPORT_KEYS``, plus ``timings`` on CUDA). Allocates two sets of caches
    of ``shape`` on ``device``."""
    plan = scheduler_plan(np.random.default_rng(seed), requests, shape.blocks, shape.block_size)
    report: dict = {
        "bench": "kernels",
        "command": "vtoken " + shlex.join(sys.argv[1:]),
        "backend": backend,
        "device": device,
        "layout": layout,
        "kv_cache_layout": "cpu (vec ISA)" if layout == "cpu" else BACKEND_LAYOUTS.get(layout, layout),
        "dtype": str(shape.dtype).removeprefix("torch."),
        "shape": {
            "layers": shape.layers,
            "kv_heads": shape.kv_heads,
            "q_heads": shape.q_heads,
            "head_dim": shape.head_dim,
            "block_size": shape.block_size,
            "blocks": shape.blocks,
        },
        "plan": {"requests": len(plan.rows), "moves": int(plan.src.numel()), "ranges_overlap": plan.ranges_overlap},
        "capacity": capacity,
    }
    # the plan on the host, as the worker hands it over (Triton: one direct launch), then on the device
    # (Triton: the staged gather/scatter pair); both must be exact
    report.update(check_moves(backend, layout, shape, device, plan, seed, capacity))
    staged = check_moves(backend, layout, shape, device, plan, seed, capacity, plan_on_device=True)
    report["moves_exact"] = report["moves_exact"] and staged["moves_exact"]
    report["moves_mismatched_elements"] += staged["moves_mismatched_elements"]
    report.update(check_scores(backend, layout, shape, device, plan, seed))
    if device == "cuda":
        report["timings"] = timings(backend, layout, shape, plan, seed, capacity)
    return report


def timings(backend: str, layout: str, shape: Shape, plan, seed: int, capacity: int) -> dict:
    """CUDA timings (median of 10 after 2 warm-ups; the plan is re-applied to the same caches each time)."""
    caches, lay = setup(layout, shape, "cuda", seed)
    mover = make_mover(backend, layout, lay, capacity)
    src, dst = plan.src.cuda(), plan.dst.cuda()
    move_ms = timed(lambda: mover.move(caches, src, dst), "cuda")
    moved = 2 * int(src.numel()) * shape.layers * token_bytes(shape)  # read each source, write each destination
    a = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    copy_ms = timed(lambda: b.copy_(a), "cuda")
    specs = score_specs(plan, np.random.default_rng(seed))
    query = torch.randn(specs[-1][1], shape.q_heads, shape.head_dim, device="cuda").to(shape.dtype)
    score_ms = timed(
        lambda: run_scores(make_accumulator(backend, layout, lay), caches, specs, query, shape.head_dim**-0.5),
        "cuda",
    )
    return {
        "moves_ms": round(move_ms, 4),
        "moves_gb_s": round(moved / move_ms / 1e6, 2),
        "copy_same_bytes_ms": round(copy_ms, 4),
        "copy_gb_s": round(moved / copy_ms / 1e6, 2),
        "score_step_ms": round(score_ms, 4),
        "score_ms_per_layer": round(score_ms / shape.layers, 4),
        "note": "score_step_ms includes building the step's metadata and finish() (host side)",
    }
